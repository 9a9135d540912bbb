"""``longattn forecast``, ``longattn forecast-table`` and ``longattn forecast-download``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from longattn.commands._args import add_workers_argument
from longattn.data.timeseries import SERIES, download_series
from longattn.experiment.config import resolve_config
from longattn.experiment.results import write_results
from longattn.experiment.run import run
from longattn.experiment.grid import PAPER_SEEDS
from longattn.forecast.table import difference_table, format_table, run_table, summarise
from longattn.models.registry import model_names
from longattn.tasks.base import get_task
from longattn.tasks.forecasting import find_preset


def _forecast(args: argparse.Namespace) -> int:
    # --config replaces the dataset's shipped config (it is a complete forecast config of its own).
    preset = None if args.config else find_preset(args.dataset)
    config = resolve_config("forecasting", preset, args.config, args.set or [], model_name=args.model,
                            attention=args.attention, seed=args.seed,
                            data={"dataset": args.dataset, "data_dir": args.data_dir, "pred_len": args.pred_len},
                            train={"device": args.device})
    results = run(config, args.out, resume=True, log=print, plots=not args.no_plot)
    print(json.dumps(get_task("forecasting").summary(results), indent=2))
    return 0


def _table(args: argparse.Namespace) -> int:
    if args.reference and args.reference not in args.models:  # say so before hours of training, not after
        raise ValueError(f"--reference {args.reference!r} is not among --models ({', '.join(args.models)})")
    rows = run_table(args.data_dir, args.datasets, args.models, args.out, horizons=args.horizons,
                     overrides=args.set or [], seeds=args.seeds, device=args.device, collect_only=args.collect_only,
                     workers=args.workers)
    table = format_table(rows, args.models)
    differences = difference_table(rows, args.models, args.reference)
    if differences:
        table += "\n\n" + differences
    print(table)
    out = Path(args.out)
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


def _select(args: argparse.Namespace) -> int:
    from longattn.forecast.select import select_settings

    select_settings(args.dataset, args.data_dir, args.model, args.pred_len, args.grid or [], args.out,
                    overrides=args.set or [], seeds=args.seeds, attention=args.attention, workers=args.workers)
    return 0


def _download(args: argparse.Namespace) -> int:
    for name in args.datasets:
        print(download_series(name, args.data_dir))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    forecasters = model_names("forecaster")
    p = subparsers.add_parser("forecast", help="train and test one long-term forecaster on one dataset/horizon")
    p.add_argument("--dataset", required=True, help=f"{', '.join(SERIES)} or a path to a CSV with a date column")
    p.add_argument("--data-dir", help="folder holding the benchmark CSV files")
    p.add_argument("--model", required=True, choices=forecasters, metavar="MODEL",
                   help=f"registered forecaster: {', '.join(forecasters)}")
    p.add_argument("--attention", help="registered attention for models that take one (default: the config's)")
    p.add_argument("--pred-len", type=int, required=True)
    p.add_argument("--config", help="YAML config (default: configs/forecast/<dataset>.yaml if present)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override, e.g. train.epochs=3, model.d_model=64, data.seq_len=36 (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu (default), cuda, ...")
    p.add_argument("--no-plot", action="store_true", help="skip forecast.png")
    p.add_argument("--out", required=True, help="folder for results.json, checkpoints and forecast.png")
    p.set_defaults(func=_forecast)

    t = subparsers.add_parser("forecast-table", help="run datasets x horizons x models and print Table 2's layout")
    t.add_argument("--data-dir", required=True)
    t.add_argument("--datasets", nargs="+", required=True)
    t.add_argument("--horizons", nargs="+", type=int, help="default: each dataset's config horizons")
    t.add_argument("--models", nargs="+", default=["skt", "dlinear", "encoder:softmax", "encoder:skein"],
                   help="model or model:attention, e.g. skt encoder:skein dlinear")
    t.add_argument("--seeds", nargs="+", type=int,
                   help=f"seeds per cell (default 0-{PAPER_SEEDS - 1}: the papers repeat each cell {PAPER_SEEDS} times)")
    t.add_argument("--reference", help="model the others' MSE is compared with, paired by seed (default: the first)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override applied to every cell")
    t.add_argument("--device", help="cpu (default), cuda, ...")
    t.add_argument("--collect-only", action="store_true", help="train nothing; tabulate the finished cells")
    t.add_argument("--no-plot", action="store_true", help="skip the per-dataset MSE-against-horizon plots")
    t.add_argument("--out", required=True, help="folder for per-cell results and table.md/table.json")
    add_workers_argument(t)
    t.set_defaults(func=_table)

    s = subparsers.add_parser("forecast-select", help="choose settings the papers do not give, on validation "
                              "MSE only (the runs have no test split)")
    s.add_argument("--dataset", required=True)
    s.add_argument("--data-dir")
    s.add_argument("--model", required=True, choices=forecasters, metavar="MODEL")
    s.add_argument("--attention", help="registered attention for models that take one")
    s.add_argument("--pred-len", type=int, required=True)
    s.add_argument("--grid", action="append", metavar="KEY=V1,V2",
                   help="candidate values of one key (repeatable; every combination is tried)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="fixed override for every candidate")
    s.add_argument("--seeds", nargs="+", type=int, default=[0])
    s.add_argument("--out", required=True, help="folder for the candidates' runs and selection.md/json")
    add_workers_argument(s)
    s.set_defaults(func=_select)

    d = subparsers.add_parser("forecast-download", help="download benchmark CSVs and verify their checksums")
    d.add_argument("datasets", nargs="+")
    d.add_argument("--data-dir", required=True)
    d.set_defaults(func=_download)
