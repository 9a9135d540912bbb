"""Singularformer's 5-fold cross-validation protocol and its Table 4 (docs/doccls.md): ``longattn paper
singularformer-table4`` trains, ``longattn report crossval`` tabulates the folds finished in a folder."""

from __future__ import annotations

import argparse

from longattn.commands._args import (add_config_arguments, add_data_dir_argument, add_list_argument,
                                    add_no_progress_argument, add_resume_argument, add_workers_argument,
                                    deprecated_alias, no_progress, task_names)
from longattn.experiment.analyses import register_paper, register_report


def _cmd(args: argparse.Namespace) -> int:
    from longattn.experiment.crossval import run_crossval

    overrides = no_progress(args)
    if args.data_dir:
        overrides.insert(0, f"data.data_dir={args.data_dir}")
    report = getattr(args, "report", False)
    summary = run_crossval(args.tasks, args.models, args.run if report else args.out, preset=args.preset,
                           config_file=args.config, overrides=overrides, folds=args.folds,
                           only_folds=args.only_folds, seed=args.seed, resume=getattr(args, "resume", False),
                           report_only=report, workers=getattr(args, "workers", 1),
                           overwrite=getattr(args, "overwrite", False))
    return 1 if any(entry["errors"] for entry in summary["entries"]) else 0


def _common(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment.crossval import TABLE4_DATASETS, table4_models
    from longattn.models.registry import model_names

    add_list_argument(parser, "--tasks", names=task_names, kind="task", default=["r8"],
                      help=f"datasets (Table 4's: {', '.join(TABLE4_DATASETS)})")
    add_list_argument(parser, "--models", names=lambda: model_names("classifier"), kind="model",
                      default=table4_models(), help="registered classifiers (default: the seven of Table 4)")
    add_data_dir_argument(parser, help="the dataset's folder (same as --set data.data_dir=DIR)")
    add_config_arguments(parser, tasks=["r8"])
    parser.set_defaults(preset="cpu")
    parser.add_argument("--folds", type=int, default=5, help="number of folds (the paper: 5)")
    parser.add_argument("--seed", type=int, default=0, help="training seed of every fold")


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    add_list_argument(parser, "--only-folds", item=int, kind="fold", help="folds to train now (default: all)")
    parser.add_argument("--out", default="runs/table4", help="output folder")
    add_resume_argument(parser, help="reuse finished folds and resume interrupted ones")
    deprecated_alias(parser, "--report", "`longattn report crossval --run OUT`", "report", nargs=0,
                     transform=lambda _: True)
    add_no_progress_argument(parser)
    add_workers_argument(parser)
    parser.set_defaults(report=False)


def _report(args: argparse.Namespace) -> int:
    args.report = True
    return _cmd(args)


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default="runs/table4", metavar="DIR",
                        help="output folder of `longattn paper singularformer-table4` (read; the table is "
                        "written there)")
    _common(parser)
    parser.set_defaults(only_folds=None)


def _run_report_flag(args: argparse.Namespace) -> int:
    if args.report:  # the old `crossval --report`: the folder named by --out is the one read
        args.run = args.out
    return _cmd(args)


register_paper("singularformer-table4", "Singularformer", "Table 4", "document classification, k-fold "
               "cross-validation of the seven models (test accuracy, mean ± std over folds, beside the paper's)",
               _train_arguments, _run_report_flag)
register_report("crossval", "Singularformer Table 4 from the folds finished in a `paper singularformer-table4` "
                "folder (a missing fold is counted as not done)", _report_arguments, _report)
