"""``longattn paper zoology-fig2``: Zoology's Figure 2 (MQAR accuracy against model width, one panel per sequence
length) for every mechanism, with its long-context arm (:mod:`longattn.experiment.recall`, docs/mqar.md)."""

from __future__ import annotations

import argparse

from longattn.commands._args import (add_list_argument, add_resume_argument, add_set_argument,
                                     add_workers_argument)
from longattn.experiment.analyses import register_paper

SWEEP = "zoology_fig2"


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="cpu", help="cpu (reduced training, see docs/mqar.md) or paper "
                        "(Zoology's settings): the task preset, with the sweep file's rates and batches for it")
    parser.add_argument("--config", default=SWEEP, help="recall sweep file, or the name of a shipped one in "
                        "configs/mqar/sweeps")
    add_list_argument(parser, "--attentions", "--attention", dest="attentions", kind="row",
                      help="rows to train, by name: a mechanism, or a named row such as softmax-bidirectional "
                      "(default: every row of the sweep file)")
    add_list_argument(parser, "--lengths", item=int, kind="length", help="sequence lengths to train: 64 128 256 "
                      "(the main arm), 1024 4096 (the long-context arm) (default: all of the sweep file's)")
    add_list_argument(parser, "--widths", item=int, kind="width", help="model widths (default: the sweep file's)")
    add_list_argument(parser, "--seeds", item=int, kind="seed", help="seeds per cell; the first one searches the "
                      "learning rate (default: the sweep file's, 0 1 2)")
    add_list_argument(parser, "--lrs", item=float, kind="rate", help="candidate learning rates, chosen per cell on "
                      "validation accuracy (default: the preset's in the sweep file)")
    parser.add_argument("--per-length", action="store_true", help="train one model per sequence length even where "
                        "the preset trains one on a mixture of the lengths (the cpu preset; see docs/mqar.md)")
    add_set_argument(parser, help="override for every run, e.g. --set data.train_examples=2000 (repeatable)")
    parser.add_argument("--out", help="output folder: the runs, table.md, results.json, zoology_fig2.png (with "
                        "--estimate: cost.md and cost.json)")
    add_resume_argument(parser, help="reuse finished runs in --out and resume interrupted ones (per cell, rate and "
                        "seed)")
    add_workers_argument(parser)
    parser.add_argument("--estimate", action="store_true", help="train nothing: time one training step and one "
                        "evaluated example of every cell on the device the runs would use (process CPU time on a "
                        "CPU, synchronised wall time on a GPU) and print the cost of the sweep at its full budget")


def _run(args: argparse.Namespace) -> int:
    from longattn.experiment.recall import (estimate_sweep_cost, load_recall_sweep, plan_sweep, run_recall_sweep,
                                            write_cost_estimate)

    spec = load_recall_sweep(args.config)
    plan = plan_sweep(spec, args.preset, attentions=args.attentions, lengths=args.lengths, widths=args.widths,
                      seeds=args.seeds, lrs=args.lrs, extra_overrides=args.overrides,
                      per_length=args.per_length)
    if args.estimate:
        write_cost_estimate(estimate_sweep_cost(plan), args.out)
        return 0
    if not args.out:
        raise ValueError("--out is required (the folder the sweep writes), except with --estimate")
    summary = run_recall_sweep(plan, args.out, resume=args.resume, workers=args.workers)
    return 1 if any(cell["error"] for cell in summary["cells"]) else 0


register_paper("zoology-fig2", "Zoology", "Figure 2", "multi-query associative recall (MQAR) accuracy against model "
               "width, one panel per sequence length, for every mechanism, with a long-context arm (docs/mqar.md)",
               _arguments, _run)
