"""``longattn crossval``: Singularformer's 5-fold cross-validation protocol and its Table 4 (docs/doccls.md)."""

from __future__ import annotations

import argparse

from longattn.commands._args import add_config_arguments, add_workers_argument, int_list, no_progress
from longattn.config import ConfigError
from longattn.experiment.crossval import TABLE4_DATASETS, run_crossval, table4_models


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(f"expected comma-separated names, got {text!r}")
    return names


def _cmd(args: argparse.Namespace) -> int:
    overrides = no_progress(args)
    if args.data_dir:
        overrides.insert(0, f"data.data_dir={args.data_dir}")
    summary = run_crossval(_names(args.tasks), _names(args.models), args.out, preset=args.preset,
                           config_file=args.config, overrides=overrides, folds=args.folds,
                           only_folds=int_list(args.only_folds) if args.only_folds else None, seed=args.seed,
                           resume=args.resume, report_only=args.report, workers=args.workers)
    return 1 if any(entry["errors"] for entry in summary["entries"]) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "crossval", help="k-fold cross-validation of models on document classification (Singularformer Table 4)",
        description="Train every model on every fold of each dataset's training set (each fold keeps its best "
        "validation epoch), test each fold's model, and write OUT/<dataset>/<model>/fold<k>/ (config.yaml, "
        "checkpoints/best.pt, results.json) and OUT/{results.json,table.md,table4.png}: test accuracy as mean ± std "
        "over folds beside the paper's Table 4.")
    p.add_argument("--tasks", default="r8", help=f"comma-separated tasks (Table 4's: {', '.join(TABLE4_DATASETS)})")
    p.add_argument("--models", default=",".join(table4_models()), help="comma-separated registered classifiers "
                   "(default: the seven of Table 4)")
    p.add_argument("--data-dir", help="the dataset's folder (same as --set data.data_dir=DIR)")
    add_config_arguments(p)
    p.set_defaults(preset="cpu")
    p.add_argument("--folds", type=int, default=5, help="number of folds (the paper: 5)")
    p.add_argument("--only-folds", help="comma-separated folds to train now (default: all)")
    p.add_argument("--seed", type=int, default=0, help="training seed of every fold")
    p.add_argument("--out", default="runs/table4", help="output folder")
    p.add_argument("--resume", action="store_true", help="reuse finished folds and resume interrupted ones")
    p.add_argument("--report", action="store_true", help="train nothing: write the table from the folds finished in --out")
    p.add_argument("--no-progress", action="store_true")
    add_workers_argument(p)
    p.set_defaults(func=_cmd)
