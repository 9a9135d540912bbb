"""The papers' remaining analyses as ``longattn bench ...`` commands (issue 18, items 3-5).

* ``bench flops``: Skeinformer Table 3, analytic FLOPs against torch's counter (:mod:`longattn.bench.flops`);
* ``bench fsat-fig3``: FSAT Figure 3, training time and memory per sequence against N (:mod:`longattn.bench.speed`).

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


register_analysis("flops", "FLOPs of computing attention, analytic against measured (Skeinformer Table 3)",
                  _flops_arguments, _flops)
register_analysis("fsat-fig3", "training time and memory per sequence against N (FSAT Figure 3)",
                  _fsat_fig3_arguments, _fsat_fig3)
