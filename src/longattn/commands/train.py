"""``longattn train`` and ``longattn eval``: one run of any registered task, and re-evaluating its checkpoints."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from longattn.commands._args import add_config_arguments, add_run_arguments, no_progress
from longattn.config import merge, parse_set
from longattn.experiment.config import resolve_config
from longattn.experiment.results import write_results
from longattn.experiment.run import evaluate_run, run
from longattn.tasks.base import get_task


def _train(args: argparse.Namespace) -> int:
    config = resolve_config(args.task, args.preset, args.config, no_progress(args), attention=args.attention,
                            model_name=args.model_name)
    results = run(config, args.out, resume=args.resume)
    if results.get("world_size", 1) == 1 or os.environ.get("RANK", "0") == "0":
        print(json.dumps(get_task(config.task).summary(results), indent=2, default=str))
    return 0


def _eval(args: argparse.Namespace) -> int:
    options: dict = {}
    for text in args.data_option:
        options = merge(options, parse_set(text))
    result = evaluate_run(args.out, split=args.split, checkpoint=args.checkpoint, data_options=options)
    suffix = "".join(f"_{k}={v}" for k, v in options.items())
    write_results(Path(args.out) / f"eval_{args.split}_{Path(args.checkpoint).stem}{suffix}.json", result)
    print(json.dumps(result, indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train one model/attention on one task (LRA, forecasting, ...)",
                              description="Train on a registered task. Writes config.yaml, metrics.jsonl, "
                              "checkpoints/ and results.json to --out. Run under torchrun for DDP.")
    add_run_arguments(p)
    add_config_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help="continue exactly from --out/checkpoints/last.pt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)

    e = subparsers.add_parser("eval", help="evaluate a trained run's checkpoint on a split",
                              description="Re-evaluate the best (or last, or any) checkpoint of a `longattn train` "
                              "run, in eval mode, on every example of the split.")
    e.add_argument("--out", required=True, help="the --out folder of a training run")
    e.add_argument("--split", default="test", choices=("train", "val", "test"))
    e.add_argument("--checkpoint", default="best", help="best, last, or a checkpoint path")
    e.add_argument("--data-option", action="append", default=[], metavar="KEY=VALUE",
                   help="dataset option for this evaluation, e.g. noise_amplitude=4 (repeatable)")
    e.set_defaults(func=_eval)
