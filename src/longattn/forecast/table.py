"""SKTformer Table 2 as a grid: datasets x horizons (rows) x models (columns) x seeds, each cell a run.

``run_table`` builds the cells and hands them to the one grid runner (:mod:`longattn.experiment.grid`);
each (cell, seed) trains in ``<out>/<dataset>/<model>/h<horizon>_s<seed>`` and a finished cell (one with a
``results.json``) is never trained again. ``format_table`` prints the layout of the papers' Table 2 with
the paper's numbers beside ours.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longattn.experiment.config import resolve_config
from longattn.experiment.grid import PAPER_SEEDS, Cell, run_cells
from longattn.experiment.results import markdown_table
from longattn.experiment.stats import format_difference, legend, mean_std, paired_difference
from longattn.data.timeseries import resolve_series
from longattn.forecast.paper import paper_result
from longattn.tasks.forecasting import find_preset

__all__ = ["cell_dir", "difference_table", "format_table", "forecast_cells", "run_table", "split_model_spec"]


def cell_dir(out: str | Path, dataset: str, model_spec: str, horizon: int, seed: int) -> Path:
    return Path(out) / dataset / model_spec.replace(":", "-") / f"h{horizon}_s{seed}"


def split_model_spec(spec: str) -> tuple[str, str | None]:
    """'encoder:skein' -> ('encoder', 'skein'); 'dlinear' -> ('dlinear', None)."""
    model, _, attention = spec.partition(":")
    return model, attention or None


def dataset_name(dataset: str) -> str:
    return Path(dataset).stem if dataset.lower().endswith(".csv") else resolve_series(dataset)[0]


def forecast_cells(data_dir: str | Path | None, datasets: list[str], models: list[str],
                   horizons: list[int] | None = None, overrides: list[str] = (),
                   device: str | None = None) -> list[Cell]:
    """One cell per (dataset, horizon, model spec); horizons default to each dataset's config."""
    cells = []
    for dataset in datasets:
        name = dataset_name(dataset)
        preset = find_preset(dataset)
        source = dataset if dataset.lower().endswith(".csv") else name
        dataset_horizons = horizons or resolve_config(
            "forecasting", preset, overrides=list(overrides), data={"dataset": source}).data.horizons
        for horizon in dataset_horizons:
            for spec in models:
                model, attention = split_model_spec(spec)
                explicit = {"model_name": model, "attention": attention,
                            "data": {"dataset": source, "data_dir": None if data_dir is None else str(data_dir),
                                     "pred_len": horizon},
                            "train": {"device": device}}
                cells.append(Cell(f"{name}/{horizon}", spec, "forecasting", preset, None, list(overrides), explicit))
    return cells


def _rows(cells: list[Cell], seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for cell in cells:
        dataset, horizon = cell.row.rsplit("/", 1)
        base = {"dataset": dataset, "horizon": int(horizon), "model": cell.column}
        for seed, result in zip(seeds, cell.results):
            rows.append({**base, "seed": seed, "mse": result["test"]["mse"], "mae": result["test"]["mae"],
                         "mae_denorm": result["test"]["mae_denorm"], "seconds": result["time_seconds"]})
        if cell.error:
            rows.append({**base, "seed": seeds[len(cell.results)] if len(cell.results) < len(seeds) else None,
                         "error": cell.error})
    return rows


def run_table(data_dir: str | Path | None, datasets: list[str], models: list[str], out: str | Path,
              horizons: list[int] | None = None, overrides: list[str] = (), seeds: list[int] | None = None,
              device: str | None = None, log: Any = print, collect_only: bool = False) -> list[dict[str, Any]]:
    """Run every (dataset, horizon, model, seed) cell not already done (results.json present); the rows.

    ``collect_only`` trains nothing: cells without results are left out of the rows.
    """
    seeds = seeds or list(range(PAPER_SEEDS))  # the configs are the papers' settings
    cells = forecast_cells(data_dir, datasets, models, horizons, overrides, device)

    def run_dir(cell: Cell, seed: int) -> Path:
        dataset, horizon = cell.row.rsplit("/", 1)
        return cell_dir(out, dataset, cell.column, int(horizon), seed)

    if collect_only:
        rows = []
        for cell in cells:
            for seed in seeds:
                done = run_dir(cell, seed) / "results.json"
                if done.is_file():
                    cell.results = [json.loads(done.read_text())]
                    rows += _rows([cell], [seed])
        return rows
    run_cells(cells, seeds, out, run_dir=run_dir, resume=True, log=log)
    return _rows(cells, seeds)


def format_table(rows: list[dict[str, Any]], models: list[str]) -> str:
    """Markdown table in the layout of the papers' Table 2 (dataset, horizon, MSE/MAE per model), paper columns
    first, then the reproduced models (mean ± std over seeds), with the SKT mean's deviation from the paper."""
    from longattn.forecast.paper import PAPER_MODELS

    cells: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    errors: dict[tuple[str, int, str], str] = {}
    order: list[tuple[str, int]] = []
    for row in rows:
        key = (row["dataset"], row["horizon"])
        if key not in order:
            order.append(key)
        if "error" in row:
            errors[(*key, row["model"])] = row["error"]
        else:
            cells.setdefault((*key, row["model"]), []).append((row["mse"], row["mae"]))
    paper_cols = [m for m in PAPER_MODELS if any(paper_result(d, h, m) for d, h in order)]
    header = ["Dataset", "H"]
    for name in [f"{m} (paper)" for m in paper_cols] + list(models):
        header += [f"{name} MSE", "MAE"]
    header.append("skt vs paper MSE")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for dataset, horizon in order:
        line = [dataset, str(horizon)]
        for m in paper_cols:
            ref = paper_result(dataset, horizon, m)
            line.append(f"{ref[0]:.3f} | {ref[1]:.3f}" if ref else "- | -")
        for m in models:
            got = cells.get((dataset, horizon, m))
            if got:
                mse, mae = zip(*got)
                line.append(f"{mean_std(mse, 3)} | {mean_std(mae, 3)}")
            else:
                line.append("failed | -" if (dataset, horizon, m) in errors else "- | -")
        skt = next((cells[(dataset, horizon, m)] for m in models if m.split(":")[0] == "skt"
                    and (dataset, horizon, m) in cells), None)
        ref = paper_result(dataset, horizon)
        if skt and ref:
            mse = sum(v[0] for v in skt) / len(skt)
            line.append(f"{100 * (mse - ref[0]) / ref[0]:+.1f}%")
        else:
            line.append("-")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def difference_table(rows: list[dict[str, Any]], models: list[str], reference: str | None = None) -> str:
    """Each model's test MSE minus the ``reference`` model's (default: the first), paired by seed, with its
    t interval and the mark for differences that are not significant (:mod:`longattn.experiment.stats`)."""
    reference = reference or models[0]
    others = [m for m in models if m != reference]
    if not others:
        return ""
    by_seed: dict[tuple[str, int, str], dict[int, float]] = {}
    for row in rows:
        if "error" not in row:
            by_seed.setdefault((row["dataset"], row["horizon"], row["model"]), {})[row["seed"]] = row["mse"]
    order = list(dict.fromkeys((row["dataset"], row["horizon"]) for row in rows))
    table = [[dataset, horizon, *(format_difference(paired_difference(by_seed.get((dataset, horizon, m), {}),
                                                                      by_seed.get((dataset, horizon, reference), {})),
                                                    digits=3) for m in others)]
             for dataset, horizon in order]
    return (f"Test MSE minus {reference}'s:\n\n" + markdown_table(["Dataset", "H", *others], table)
            + f"\n\n{legend(reference)}")
