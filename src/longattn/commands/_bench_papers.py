"""The papers' remaining analyses as ``longattn bench ...`` commands (issue 18, items 3-5).

* ``bench flops``: Skeinformer Table 3, analytic FLOPs against torch's counter (:mod:`longattn.bench.flops`);
* ``bench batch-limit``: Skeinformer Table 2, the largest batch within a memory budget and the time per
  thousand steps with accumulation to the paper's batch (:mod:`longattn.bench.batch_limit`);
* ``bench lr-batch``: Skeinformer Figure 3, accuracy and training time against learning rate and batch
  (:mod:`longattn.experiment.sensitivity`);
* ``bench fsat-fig3``: FSAT Figure 3, training time and memory per sequence against N (:mod:`longattn.bench.speed`);
* ``bench incoherence``: S^3 Table 14 and Figure 2, the token matrix before and after the Smoother
  (:mod:`longattn.experiment.incoherence`).

Each writes JSON (through write_results), a markdown table and a plot into ``--out``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path

from longattn.bench import speed as speed_defaults
from longattn.bench.speed import MODEL_DEFAULTS
from longattn.bench.targets import SDPA
from longattn.commands.bench import _int_list, _options, _write
from longattn.experiment.analyses import register_analysis
from longattn.experiment.grid import default_seeds

# FSAT Table 2 / Figure 3: FSAT and the baselines of its efficiency comparison
FSAT_BASELINES = ("softmax", "local", "linformer", "reformer", "sinkhorn", "synthesizer", "bigbird", "linear", "performer")
FSAT_LENGTHS = "1k,2k,4k,8k"


def _flops(args: argparse.Namespace) -> int:
    from longattn.bench.flops import FLOP_MODELS, flop_rows, flops_table, plot_flops

    rows = flop_rows(args.attention or list(FLOP_MODELS), _int_list(args.lengths), d=args.features, p=args.head_dim,
                     seed=args.seed)
    out = Path(args.out)
    _write(out, "flops", rows, flops_table(rows), {"unit": "multiply-adds (torch's FLOPs / 2)"})
    plot_flops(rows, out / "flops.png")
    print(f"wrote {out / 'flops.png'}")
    return 0


def _flops_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench.flops import FLOP_MODELS, PAPER_FEATURES, PAPER_HEAD_DIM

    parser.add_argument("--attention", nargs="*", choices=sorted(FLOP_MODELS),
                        help="mechanisms of Skeinformer Table 3 (default: all)")
    parser.add_argument("--lengths", default="1k,2k,4k", help="comma list, k suffix")
    parser.add_argument("--features", type=int, default=PAPER_FEATURES, help="d: samples / landmarks / k / features")
    parser.add_argument("--head-dim", type=int, default=PAPER_HEAD_DIM, help="p")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-flops")


def _fsat_fig3(args: argparse.Namespace) -> int:
    from longattn.bench.speed import per_sequence_table, plot_speed, run_speed

    base = replace(MODEL_DEFAULTS, batch=args.batch, threads=args.threads, repeats=args.repeats, seed=args.seed,
                   options=_options(args.options))
    names = args.attention or ["fsat", *FSAT_BASELINES]
    targets = [SDPA] + [n for n in names if n != SDPA]
    rows = run_speed(targets, _int_list(args.lengths), base, timeout_s=args.timeout,
                     reference_max_length=args.reference_max_length)
    out = Path(args.out)
    _write(out, "fsat_fig3", rows, per_sequence_table(rows), {"config": asdict(base)})
    plot_speed(rows, out / "fsat_fig3.png", per_sequence=True)
    print(f"wrote {out / 'fsat_fig3.png'}")
    return 0


def _fsat_fig3_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attention", nargs="*", help=f"mechanisms (default: fsat {' '.join(FSAT_BASELINES)})")
    parser.add_argument("--lengths", default=FSAT_LENGTHS, help="comma list, k suffix")
    parser.add_argument("--batch", type=int, default=4, help="sequences per training step (figures are per sequence)")
    parser.add_argument("--threads", type=int, default=MODEL_DEFAULTS.threads)
    parser.add_argument("--repeats", type=int, default=MODEL_DEFAULTS.repeats)
    parser.add_argument("--seed", type=int, default=MODEL_DEFAULTS.seed)
    parser.add_argument("--options", default="{}", help="JSON object of mechanism options (not given to softmax)")
    parser.add_argument("--timeout", type=float, default=speed_defaults.MODEL_TIMEOUT_S, help="seconds per configuration")
    parser.add_argument("--reference-max-length", type=int, default=speed_defaults.DEFAULT_REFERENCE_MAX_LENGTH,
                        help="longest N at which the softmax model runs")
    parser.add_argument("--out", default="runs/bench-fsat-fig3")


def _data_dirs(pairs: list[str], tasks: list[str]) -> dict[str, list[str]]:
    """``TASK=PATH`` pairs -> per-task ``data.data_dir`` overrides (tasks that read files take one each)."""
    out: dict[str, list[str]] = {}
    for pair in pairs:
        task, sep, path = pair.partition("=")
        if not sep or task not in tasks or not path:
            raise ValueError(f"--data-dir takes TASK=PATH for one of {', '.join(tasks)}, got {pair!r}")
        out.setdefault(task, []).append(f"data.data_dir={path}")
    return out


def _seeds(args: argparse.Namespace) -> list[int]:
    """--seeds if given, else the number of seeds the project uses for the preset (one place: grid.default_seeds)."""
    return _int_list(args.seeds) if args.seeds else default_seeds(args.preset)


def _incoherence(args: argparse.Namespace) -> int:
    from longattn.experiment import incoherence

    tasks = [t for t in args.tasks.split(",") if t]
    overrides = _data_dirs(args.data_dir, tasks)
    for task in tasks:
        overrides[task] = [*overrides.get(task, []), *args.set]
    ranks = tuple(_int_list(args.ranks))
    seeds = _seeds(args)
    out = Path(args.out)
    rows, examples = incoherence.run_incoherence(tasks, seeds, out, ranks=ranks, steps=args.steps, preset=args.preset,
                                                 overrides=overrides, layer=args.layer)
    summary = incoherence.summarise(rows)
    _write(out, "incoherence", summary, incoherence.incoherence_table(summary),
           {"per_seed": rows, "steps": args.steps, "layer": args.layer, "preset": args.preset, "seeds": seeds})
    incoherence.plot_incoherence(summary, out / "incoherence.png")
    for task, (before, after) in examples.items():
        incoherence.plot_token_matrices(before, after, out / f"token_matrix_{task}.png",
                                        f"{task}: first validation example after {args.steps} steps (S^3 Figure 2)")
    print(f"wrote {out / 'incoherence.png'} and token_matrix_<task>.png")
    return 0


def _incoherence_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment import incoherence

    parser.add_argument("--tasks", default=",".join(incoherence.PAPER_TASKS), help="comma list of LRA tasks")
    parser.add_argument("--seeds", default=None,
                        help="comma list; one training run each (default: the preset's, experiment.grid.default_seeds)")
    parser.add_argument("--steps", type=int, default=incoherence.PAPER_STEPS, help="training steps before measuring")
    parser.add_argument("--ranks", default=",".join(map(str, incoherence.PAPER_RANKS)), help="comma list")
    parser.add_argument("--layer", type=int, default=0, help="which skeleton layer's Smoother (0: the first)")
    parser.add_argument("--preset", default="demo", help="each task's preset (demo: small subsets for a CPU)")
    parser.add_argument("--data-dir", action="append", default=[], metavar="TASK=PATH",
                        help="data folder of a task that reads files, e.g. text=../shared/data/imdb (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every run (repeatable)")
    parser.add_argument("--out", default="runs/bench-incoherence")


def _batch_limit(args: argparse.Namespace) -> int:
    from longattn.bench.batch_limit import batch_table, plot_batch, run_batch_limit

    base = replace(MODEL_DEFAULTS, threads=args.threads, repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    rows = run_batch_limit(args.attention, args.length, int(args.budget_mib * 2**20), args.paper_batch, base,
                           features=args.features, timeout_s=args.timeout)
    out = Path(args.out)
    _write(out, "batch_limit", rows, batch_table(rows, base), {"config": asdict(base)})
    plot_batch(rows, str(out / "batch_limit.png"))
    print(f"wrote {out / 'batch_limit.png'}")
    return 0


def _batch_limit_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench.batch_limit import PAPER_BATCH, TABLE_2_MECHANISMS
    from longattn.bench.flops import PAPER_FEATURES

    parser.add_argument("--attention", nargs="*", default=list(TABLE_2_MECHANISMS),
                        help=f"mechanisms (default: Skeinformer Table 2's, {' '.join(TABLE_2_MECHANISMS)})")
    parser.add_argument("--length", type=int, default=4096, help="sequence length N (LRA Text: 4096)")
    parser.add_argument("--budget-mib", type=float, default=16 * 1024,
                        help="peak memory a training step may use, MiB (default: the paper's 16 GB V100)")
    parser.add_argument("--paper-batch", type=int, default=PAPER_BATCH["text"],
                        help="batch reached by gradient accumulation (Skeinformer A.1, Text: 128)")
    parser.add_argument("--features", type=int, default=PAPER_FEATURES, help="samples / landmarks / k / features")
    parser.add_argument("--threads", type=int, default=MODEL_DEFAULTS.threads)
    parser.add_argument("--warmup", type=int, default=MODEL_DEFAULTS.warmup)
    parser.add_argument("--repeats", type=int, default=MODEL_DEFAULTS.repeats)
    parser.add_argument("--seed", type=int, default=MODEL_DEFAULTS.seed)
    parser.add_argument("--timeout", type=float, default=speed_defaults.MODEL_TIMEOUT_S, help="seconds per probe")
    parser.add_argument("--out", default="runs/bench-batch-limit")


def _lr_batch(args: argparse.Namespace) -> int:
    from longattn.experiment.sensitivity import plot_sensitivity, run_sensitivity, sensitivity_table

    learning_rates = [float(x) for x in args.lrs.split(",") if x]
    batches = _int_list(args.batches)
    seeds = _seeds(args)
    out = Path(args.out)
    rows = run_sensitivity(args.task, args.attention, learning_rates, batches, seeds, out / "runs", preset=args.preset,
                           overrides=args.set, resume=args.resume)
    _write(out, "lr_batch", rows, sensitivity_table(rows),
           {"task": args.task, "attention": args.attention, "preset": args.preset, "seeds": seeds, "set": args.set})
    plot_sensitivity(rows, out / "lr_batch.png", f"{args.attention} on {args.task} (Skeinformer Figure 3)")
    print(f"wrote {out / 'lr_batch.png'}")
    return 0


def _lr_batch_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment.sensitivity import PAPER_BATCHES, PAPER_LEARNING_RATES

    parser.add_argument("--task", default="text")
    parser.add_argument("--attention", default="skein")
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in PAPER_LEARNING_RATES), help="comma list")
    parser.add_argument("--batches", default=",".join(map(str, PAPER_BATCHES)), help="comma list")
    parser.add_argument("--seeds", default=None,
                        help="comma list (default: the preset's, experiment.grid.default_seeds)")
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--resume", action="store_true", help="reuse finished runs under --out")
    parser.add_argument("--out", default="runs/bench-lr-batch")


register_analysis("flops", "FLOPs of computing attention, analytic against measured (Skeinformer Table 3)",
                  _flops_arguments, _flops)
register_analysis("batch-limit", "largest batch within a memory budget, time per 1000 steps (Skeinformer Table 2)",
                  _batch_limit_arguments, _batch_limit)
register_analysis("lr-batch", "accuracy and training time against learning rate and batch (Skeinformer Figure 3)",
                  _lr_batch_arguments, _lr_batch)
register_analysis("fsat-fig3", "training time and memory per sequence against N (FSAT Figure 3)",
                  _fsat_fig3_arguments, _fsat_fig3)
register_analysis("incoherence", "incoherence of the token matrix before / after the Smoother (S^3 Table 14, Fig. 2)",
                  _incoherence_arguments, _incoherence)
