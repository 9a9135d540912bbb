"""``longattn paper zoology-fig2``: Zoology's Figure 2 (MQAR accuracy against model width, one panel per sequence
length) for every mechanism, with its long-context arm (:mod:`longattn.experiment.recall`, docs/mqar.md)."""

from __future__ import annotations

import argparse

from longattn.commands._args import add_workers_argument, int_list
from longattn.experiment.recall import (estimate_sweep_cost, load_recall_sweep, plan_sweep, run_recall_sweep,
                                        write_cost_estimate)

SWEEP = "zoology_fig2"


def _words(values: list[str] | None) -> list[str] | None:
    """Space- and comma-separated items (``a b``, ``a,b``) as one list; None when not given."""
    return None if values is None else [part.strip() for value in values for part in value.split(",") if part.strip()]


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="cpu", help="cpu (reduced training, see docs/mqar.md) or paper (Zoology's "
                        "settings): the task preset, with the sweep file's rates and batches for it (default: cpu)")
    parser.add_argument("--config", default=SWEEP, help=f"recall sweep file, or the name of a shipped one in "
                        f"configs/mqar/sweeps (default: {SWEEP})")
    parser.add_argument("--attentions", nargs="+", metavar="ROW", help="rows to train, by name: a mechanism, or a "
                        "named row such as softmax-bidirectional (default: every row of the sweep file)")
    parser.add_argument("--lengths", nargs="+", metavar="N", help="sequence lengths to train: 64 128 256 (the main "
                        "arm), 1024 4096 (the long-context arm) (default: all of the sweep file)")
    parser.add_argument("--widths", nargs="+", metavar="D", help="model widths (default: the sweep file's)")
    parser.add_argument("--seeds", nargs="+", metavar="SEED", help="seeds per cell; the first one searches the "
                        "learning rate (default: the sweep file's, 0 1 2)")
    parser.add_argument("--lrs", nargs="+", metavar="LR", help="candidate learning rates, chosen per cell on "
                        "validation accuracy (default: the preset's in the sweep file)")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override for every run, e.g. --set data.train_examples=2000 (repeatable)")
    parser.add_argument("--out", help="output folder: the runs, table.md, results.json, zoology_fig2.png (with "
                        "--estimate: cost.md and cost.json)")
    parser.add_argument("--resume", action="store_true", help="reuse finished runs in --out and resume interrupted "
                        "ones (per cell, rate and seed)")
    add_workers_argument(parser)
    parser.add_argument("--estimate", action="store_true", help="train nothing: time one training step and one "
                        "evaluated example of every cell (process CPU time) and print the cost of the sweep at its "
                        "full budget")


def _floats(values: list[str] | None) -> list[float] | None:
    try:
        return None if values is None else [float(v) for v in _words(values)]
    except ValueError:
        raise ValueError(f"--lrs takes numbers, got {' '.join(values)}") from None


def _ints(values: list[str] | None) -> list[int] | None:
    return None if values is None else int_list(",".join(_words(values)))


def _run(args: argparse.Namespace) -> int:
    spec = load_recall_sweep(args.config)
    plan = plan_sweep(spec, args.preset, attentions=_words(args.attentions), lengths=_ints(args.lengths),
                      widths=_ints(args.widths), seeds=_ints(args.seeds), lrs=_floats(args.lrs),
                      extra_overrides=args.overrides)
    if args.estimate:
        write_cost_estimate(estimate_sweep_cost(plan), args.out)
        return 0
    if not args.out:
        raise ValueError("--out is required (the folder the sweep writes), except with --estimate")
    summary = run_recall_sweep(plan, args.out, resume=args.resume, workers=args.workers)
    return 1 if any(cell["error"] for cell in summary["cells"]) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    paper = subparsers.add_parser("paper", help="reproduce the papers' tables and figures",
                                  description="Each entry runs one table or figure of a paper.")
    entries = paper.add_subparsers(dest="paper_command", metavar="NAME", required=True)
    fig2 = entries.add_parser("zoology-fig2", help="Zoology Figure 2: MQAR accuracy against model width for every "
                              "mechanism", description="Zoology Figure 2: multi-query associative recall (MQAR) "
                              "accuracy against model width, one panel per sequence length, for every mechanism (with "
                              "a long-context arm); see docs/mqar.md.")
    _arguments(fig2)
    fig2.set_defaults(func=_run)
