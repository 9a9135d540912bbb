"""Choosing the settings a paper does not give, on the validation split only.

``select_settings`` trains every candidate (the product of a few ``--set`` values) for the given seeds with
``data.use_test=false``: the runs have no test split, so no test window is ever scored, and no forecast plot
(which draws test windows) is made. The candidate with the lowest mean validation MSE wins; ``selection.json``
records every candidate's validation MSE per seed and the winner's overrides, ready for a config file.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from longattn.config import ConfigError
from longattn.experiment.grid import Cell, markdown_table, run_cells
from longattn.experiment.results import write_results
from longattn.forecast.table import dataset_name
from longattn.tasks.forecasting import find_preset

__all__ = ["candidates", "select_settings"]


def candidates(grid: list[str]) -> list[list[str]]:
    """``["optim.lr=1e-4,1e-3", "model.d_model=64,128"]`` -> every combination as override lists."""
    axes = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid takes KEY=V1,V2,... ; got {item!r}")
        axes.append([f"{key}={value}" for value in values.split(",")])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


def select_settings(dataset: str, data_dir: str | None, model: str, pred_len: int, grid: list[str],
                    out: str | Path, overrides: list[str] = (), seeds: list[int] = (0,), attention: str | None = None,
                    log: Any = print, workers: int | None = 1, overwrite: bool = False) -> dict[str, Any]:
    """Train every candidate without a test split (``workers`` runs at once); the one with the lowest mean
    validation MSE wins."""
    name = dataset_name(dataset)
    source = dataset if dataset.lower().endswith(".csv") else name
    cells = []
    for combo in candidates(grid):
        label = " ".join(combo) or "defaults"
        explicit = {"model_name": model, "attention": attention,
                    "data": {"dataset": source, "data_dir": data_dir, "pred_len": pred_len, "use_test": False}}
        cells.append(Cell(label, model, "forecasting", find_preset(dataset), None, [*overrides, *combo], explicit))
    out = Path(out)
    run_cells(cells, list(seeds), out, resume=not overwrite, overwrite=overwrite, log=log, plots=False,
              workers=workers)
    rows = []
    for cell, combo in zip(cells, candidates(grid)):
        values = cell.values("mse", split="val")
        rows.append({"candidate": cell.row, "overrides": combo, "val_mse": values,
                     "mean": statistics.mean(values) if values else None, "error": cell.error})
    finished = [r for r in rows if r["mean"] is not None]
    if not finished:
        raise ConfigError(f"no candidate finished on {name}; see the errors in {out}")
    best = min(finished, key=lambda r: r["mean"])
    table = markdown_table(["candidate", "val MSE (mean over seeds)", "per seed"],
                           [[r["candidate"], "failed" if r["mean"] is None else f"{r['mean']:.4f}",
                             " ".join(f"{v:.4f}" for v in r["val_mse"])] for r in rows])
    text = (f"{name} h{pred_len} {model}: chosen on validation MSE only (no test split in these runs)\n\n{table}\n\n"
            f"best: {best['candidate']}\n")
    (out / "selection.md").write_text(text)
    summary = {"dataset": name, "model": model, "pred_len": pred_len, "candidates": rows, "best": best,
               "fixed_overrides": list(overrides)}
    write_results(out / "selection.json", summary, seeds=list(seeds))
    log(text)
    return summary
