"""SKTformer Table 2 / 16 (long-term forecasting, datasets x horizons x models x seeds) as ``longattn paper
sktformer-table2``, its table from finished cells as ``longattn report forecast-table``, and ``longattn data
download`` (the benchmark CSVs and the other downloadable datasets)."""

from __future__ import annotations

import argparse
from pathlib import Path

from longattn.commands._args import (add_data_dir_argument, add_list_argument, add_overwrite_argument,
                                    add_set_argument, add_workers_argument, deprecated_alias)
from longattn.experiment.analyses import register_paper, register_report

DEFAULT_MODELS = ("skt", "dlinear", "encoder:softmax", "encoder:skein")


def _table(args: argparse.Namespace) -> int:
    from longattn.experiment.results import write_results
    from longattn.forecast.table import difference_table, format_table, run_table, summarise

    if args.reference and args.reference not in args.models:  # say so before hours of training, not after
        raise ValueError(f"--reference {args.reference!r} is not among --models ({', '.join(args.models)})")
    out = args.run if args.collect_only else args.out
    rows = run_table(args.data_dir, args.datasets, args.models, out, horizons=args.horizons,
                     overrides=args.overrides, seeds=args.seeds, device=args.device, collect_only=args.collect_only,
                     workers=args.workers, overwrite=args.overwrite)
    table = format_table(rows, args.models)
    differences = difference_table(rows, args.models, args.reference)
    if differences:
        table += "\n\n" + differences
    print(table)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    summary = summarise(rows)
    write_results(out / "table.json", {"rows": rows, "cells": summary, "reference": args.reference or args.models[0]},
                  seeds=sorted({row["seed"] for row in rows if row.get("seed") is not None}))
    if not args.no_plot:
        from longattn.forecast.plots import plot_mse_by_horizon

        for path in plot_mse_by_horizon(summary, out):
            print(f"wrote {path}")
    return 0 if not any("error" in r for r in rows) else 1


def _table_run(args: argparse.Namespace) -> int:
    if args.collect_only:  # the old `forecast-table --collect-only`: the folder named by --out is the one read
        args.run = args.out
    return _table(args)


def _cells(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment.grid import PAPER_SEEDS

    add_list_argument(parser, "--datasets", required=True, kind="dataset",
                      help="benchmark series names (ETTm2 exchange ili ...) or CSV paths")
    add_list_argument(parser, "--horizons", item=int, kind="horizon", help="default: each dataset's config horizons")
    add_list_argument(parser, "--models", kind="model", default=list(DEFAULT_MODELS),
                      help="model or model:attention, e.g. skt encoder:skein dlinear")
    add_list_argument(parser, "--seeds", item=int, kind="seed",
                      help=f"seeds per cell (default 0-{PAPER_SEEDS - 1}: the papers repeat each cell {PAPER_SEEDS} "
                      "times)")
    parser.add_argument("--reference", help="model the others' MSE is compared with, paired by seed (default: the "
                        "first)")
    parser.add_argument("--no-plot", action="store_true", help="skip the per-dataset MSE-against-horizon plots")
    add_set_argument(parser, help="override applied to every cell (repeatable)")


def _table_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_dir_argument(parser, required=True, help="folder holding the benchmark CSV files")
    _cells(parser)
    parser.add_argument("--device", help="cpu (default), cuda, ...")
    parser.add_argument("--out", required=True, help="folder for per-cell results and table.md/table.json (finished "
                        "cells are reused, interrupted ones continued)")
    add_overwrite_argument(parser)
    deprecated_alias(parser, "--collect-only", "`longattn report forecast-table --run OUT`", "collect_only", nargs=0,
                     transform=lambda _: True)
    add_workers_argument(parser)
    parser.set_defaults(collect_only=False)


def _report(args: argparse.Namespace) -> int:
    args.collect_only = True
    return _table(args)


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="DIR",
                        help="output folder of `longattn paper sktformer-table2` (read; the table is written there)")
    _cells(parser)
    parser.set_defaults(data_dir=None, device=None, workers=1, overwrite=False)


register_paper("sktformer-table2", "SKTformer", "Table 2 / 16", "long-term forecasting: MSE and MAE per dataset, "
               "horizon and model over seeds, the paper's numbers beside ours, MSE-against-horizon plots",
               _table_arguments, _table_run)
register_report("forecast-table", "SKTformer Table 2's layout from the cells finished in a `paper sktformer-table2` "
                "folder (a cell without results is marked missing)", _report_arguments, _report)
