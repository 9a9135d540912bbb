"""The papers' remaining analyses:

* ``bench flops`` (also ``paper skeinformer-table3``): analytic FLOPs against torch's counter
  (:mod:`longattn.bench.flops`);
* ``bench batch-limit`` (also ``paper skeinformer-table2``): the largest batch within a memory budget and the time
  per thousand steps with accumulation to the paper's batch (:mod:`longattn.bench.batch_limit`);
* ``paper skeinformer-fig3``: accuracy and training time against learning rate and batch
  (:mod:`longattn.experiment.sensitivity`);
* ``paper fsat-fig3``: training time and memory per sequence against N (:mod:`longattn.bench.speed`);
* ``paper s3-table14``: S^3 Table 14 and Figure 2, the token matrix before and after the Smoother
  (:mod:`longattn.experiment.incoherence`).

Each writes JSON (through write_results), a markdown table and a plot into ``--out``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path

from longattn.commands._args import (add_attentions_argument, add_data_dir_argument, add_list_argument,
                                    add_overwrite_argument, add_resume_argument, add_set_argument, attention_names,
                                    name_type, preset_help, task_data_dirs, task_names)
from longattn.commands.bench import _lengths, _options, _write
from longattn.experiment.analyses import register_analysis, register_paper

# FSAT Table 2 / Figure 3: FSAT and the baselines of its efficiency comparison
FSAT_BASELINES = ("softmax", "local", "linformer", "reformer", "sinkhorn", "synthesizer", "bigbird", "linear", "performer")
FSAT_LENGTHS = "1k,2k,4k,8k"


def _flops(args: argparse.Namespace) -> int:
    from longattn.bench.flops import FLOP_MODELS, flop_rows, flops_table, plot_flops

    rows = flop_rows(args.attentions or list(FLOP_MODELS), args.lengths, d=args.features, p=args.head_dim,
                     seed=args.seed)
    out = Path(args.out)
    _write(out, "flops", rows, flops_table(rows), {"unit": "multiply-adds (torch's FLOPs / 2)"})
    plot_flops(rows, out / "flops.png")
    print(f"wrote {out / 'flops.png'}")
    return 0


def _flops_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench.flops import FLOP_MODELS, PAPER_FEATURES, PAPER_HEAD_DIM

    add_list_argument(parser, "--attentions", "--attention", dest="attentions", names=lambda: sorted(FLOP_MODELS),
                      kind="mechanism", help="mechanisms of Skeinformer Table 3 (default: all)")
    _lengths(parser, "1k,2k,4k")
    parser.add_argument("--features", type=int, default=PAPER_FEATURES, help="d: samples / landmarks / k / features")
    parser.add_argument("--head-dim", type=int, default=PAPER_HEAD_DIM, help="p, the width of one head")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    parser.add_argument("--out", default="runs/bench-flops", help="output folder")


def _fsat_fig3(args: argparse.Namespace) -> int:
    from longattn.bench.speed import MODEL_DEFAULTS, per_sequence_table, plot_speed, run_speed
    from longattn.bench.targets import SDPA

    base = replace(MODEL_DEFAULTS, batch=args.batch, threads=args.threads, repeats=args.repeats, seed=args.seed,
                   options=_options(args.options))
    names = args.attentions or ["fsat", *FSAT_BASELINES]
    targets = [SDPA] + [n for n in names if n != SDPA]
    rows = run_speed(targets, args.lengths, base, timeout_s=args.timeout,
                     reference_max_length=args.reference_max_length)
    out = Path(args.out)
    _write(out, "fsat_fig3", rows, per_sequence_table(rows), {"config": asdict(base)})
    plot_speed(rows, out / "fsat_fig3.png", per_sequence=True)
    print(f"wrote {out / 'fsat_fig3.png'}")
    return 0


def _fsat_fig3_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import speed as speed_defaults
    from longattn.bench.speed import MODEL_DEFAULTS

    add_attentions_argument(parser, help=f"mechanisms (default: fsat {' '.join(FSAT_BASELINES)})")
    _lengths(parser, FSAT_LENGTHS)
    parser.add_argument("--batch", type=int, default=4, help="sequences per training step (figures are per sequence)")
    parser.add_argument("--threads", type=int, default=MODEL_DEFAULTS.threads, help="torch threads")
    parser.add_argument("--repeats", type=int, default=MODEL_DEFAULTS.repeats, help="timed steps (median kept)")
    parser.add_argument("--seed", type=int, default=MODEL_DEFAULTS.seed, help="seed of the weights and inputs")
    parser.add_argument("--options", default="{}", help="JSON object of mechanism options (not given to softmax)")
    parser.add_argument("--timeout", type=float, default=speed_defaults.MODEL_TIMEOUT_S, help="seconds per configuration")
    parser.add_argument("--reference-max-length", type=int, default=speed_defaults.DEFAULT_REFERENCE_MAX_LENGTH,
                        help="longest N at which the softmax model runs")
    parser.add_argument("--out", default="runs/bench-fsat-fig3", help="output folder")


def _seeds(args: argparse.Namespace) -> list[int]:
    """--seeds if given, else the number of seeds the project uses for the preset (one place: grid.default_seeds)."""
    from longattn.experiment.grid import default_seeds

    return list(args.seeds) if args.seeds else default_seeds(args.preset)


def _incoherence(args: argparse.Namespace) -> int:
    from longattn.experiment import incoherence

    tasks = list(args.tasks)
    folders = task_data_dirs(args.data_dir, tasks)
    overrides = {task: [*([f"data.data_dir={folders[task]}"] if task in folders else []), *args.overrides]
                 for task in tasks}
    ranks = tuple(args.ranks)
    seeds = _seeds(args)
    out = Path(args.out)
    rows, examples = incoherence.run_incoherence(tasks, seeds, out, ranks=ranks, steps=args.steps, preset=args.preset,
                                                 overrides=overrides, layer=args.layer, overwrite=args.overwrite)
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

    add_list_argument(parser, "--tasks", names=lambda: task_names("lra"), kind="task",
                      default=list(incoherence.PAPER_TASKS), help="LRA tasks")
    add_list_argument(parser, "--seeds", item=int, kind="seed",
                      help="one training run each (default: the preset's, 3 for demo and 5 for the papers')")
    parser.add_argument("--steps", type=int, default=incoherence.PAPER_STEPS, help="training steps before measuring")
    add_list_argument(parser, "--ranks", item=int, kind="rank", default=list(incoherence.PAPER_RANKS),
                      help="ranks at which incoherence is measured")
    parser.add_argument("--layer", type=int, default=0, help="which skeleton layer's Smoother (0: the first)")
    parser.add_argument("--preset", default="demo", help="each task's preset (demo: small subsets for a CPU); "
                        + preset_help(task_names("lra")))
    parser.add_argument("--data-dir", nargs="+", action="extend", default=[], metavar="TASK=DIR",
                        help="data folder of each task that reads files, e.g. --data-dir text=DIR image=DIR2")
    add_set_argument(parser, help="config override for every run (repeatable)")
    parser.add_argument("--out", default="runs/bench-incoherence", help="output folder")
    add_overwrite_argument(parser)


def _batch_limit(args: argparse.Namespace) -> int:
    from longattn.bench.batch_limit import batch_table, plot_batch, run_batch_limit
    from longattn.bench.speed import MODEL_DEFAULTS

    base = replace(MODEL_DEFAULTS, threads=args.threads, repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    rows = run_batch_limit(args.attentions, args.length, int(args.budget_mib * 2**20), args.paper_batch, base,
                           features=args.features, timeout_s=args.timeout)
    out = Path(args.out)
    _write(out, "batch_limit", rows, batch_table(rows, base), {"config": asdict(base)})
    plot_batch(rows, str(out / "batch_limit.png"))
    print(f"wrote {out / 'batch_limit.png'}")
    return 0


def _batch_limit_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import speed as speed_defaults
    from longattn.bench.batch_limit import PAPER_BATCH, TABLE_2_MECHANISMS
    from longattn.bench.flops import PAPER_FEATURES
    from longattn.bench.speed import MODEL_DEFAULTS

    add_attentions_argument(parser, default=list(TABLE_2_MECHANISMS), help="mechanisms (Skeinformer Table 2's)")
    parser.add_argument("--length", type=int, default=4096, help="sequence length N (LRA Text: 4096)")
    parser.add_argument("--budget-mib", type=float, default=16 * 1024,
                        help="peak memory a training step may use, MiB (default: the paper's 16 GB V100)")
    parser.add_argument("--paper-batch", type=int, default=PAPER_BATCH["text"],
                        help="batch reached by gradient accumulation (Skeinformer A.1, Text: 128)")
    parser.add_argument("--features", type=int, default=PAPER_FEATURES, help="samples / landmarks / k / features")
    parser.add_argument("--threads", type=int, default=MODEL_DEFAULTS.threads, help="torch threads")
    parser.add_argument("--warmup", type=int, default=MODEL_DEFAULTS.warmup, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=MODEL_DEFAULTS.repeats, help="timed steps (median kept)")
    parser.add_argument("--seed", type=int, default=MODEL_DEFAULTS.seed, help="seed of the weights and inputs")
    parser.add_argument("--timeout", type=float, default=speed_defaults.MODEL_TIMEOUT_S, help="seconds per probe")
    parser.add_argument("--out", default="runs/bench-batch-limit", help="output folder")


def _lr_batch(args: argparse.Namespace) -> int:
    from longattn.experiment.sensitivity import plot_sensitivity, run_sensitivity, sensitivity_table

    learning_rates = list(args.lrs)
    batches = list(args.batches)
    seeds = _seeds(args)
    out = Path(args.out)
    overrides = [*([f"data.data_dir={args.data_dir}"] if args.data_dir else []), *args.overrides]
    rows = run_sensitivity(args.task, args.attention, learning_rates, batches, seeds, out / "runs", preset=args.preset,
                           overrides=overrides, resume=args.resume, overwrite=args.overwrite)
    _write(out, "lr_batch", rows, sensitivity_table(rows),
           {"task": args.task, "attention": args.attention, "preset": args.preset, "seeds": seeds,
            "set": args.overrides})
    plot_sensitivity(rows, out / "lr_batch.png", f"{args.attention} on {args.task} (Skeinformer Figure 3)")
    print(f"wrote {out / 'lr_batch.png'}")
    return 0


def _lr_batch_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment.sensitivity import PAPER_BATCHES, PAPER_LEARNING_RATES

    parser.add_argument("--task", default="text", type=name_type("task", task_names), metavar="TASK",
                        help="LRA task")
    parser.add_argument("--attention", default="skein", type=name_type("mechanism", attention_names),
                        metavar="MECHANISM", help="the mechanism trained")
    add_list_argument(parser, "--lrs", item=float, kind="learning rate", default=list(PAPER_LEARNING_RATES),
                      help="learning rates")
    add_list_argument(parser, "--batches", item=int, kind="batch", default=list(PAPER_BATCHES), help="batch sizes")
    add_list_argument(parser, "--seeds", item=int, kind="seed",
                      help="seeds per point (default: the preset's, 3 for demo and 5 for the papers')")
    parser.add_argument("--preset", default="demo", help=preset_help(["text"]))
    add_data_dir_argument(parser, help="the task's data folder (same as --set data.data_dir=DIR)")
    add_set_argument(parser)
    add_resume_argument(parser, help="reuse finished runs under --out")
    parser.add_argument("--out", default="runs/bench-lr-batch", help="output folder")


register_analysis("flops", "FLOPs of computing attention, analytic against measured (Skeinformer Table 3)",
                  _flops_arguments, _flops)
register_analysis("batch-limit", "largest batch within a memory budget, time per 1000 steps (Skeinformer Table 2)",
                  _batch_limit_arguments, _batch_limit)
register_paper("skeinformer-table3", "Skeinformer", "Table 3", "FLOPs of computing attention, analytic against "
               "measured (= `longattn bench flops`)", _flops_arguments, _flops)
register_paper("skeinformer-table2", "Skeinformer", "Table 2", "largest batch within a memory budget and time per "
               "1000 steps (= `longattn bench batch-limit`)", _batch_limit_arguments, _batch_limit)
register_paper("skeinformer-fig3", "Skeinformer", "Figure 3", "accuracy and training time against learning rate and "
               "batch size", _lr_batch_arguments, _lr_batch)
register_paper("fsat-fig3", "FSAT", "Figure 3", "training time and memory per sequence against N",
               _fsat_fig3_arguments, _fsat_fig3)
register_paper("s3-table14", "S^3", "Table 14 and Figure 2", "incoherence of the token matrix before and after the "
               "Smoother", _incoherence_arguments, _incoherence)
