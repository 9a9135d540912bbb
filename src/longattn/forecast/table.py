"""SKTformer Table 2 as a grid: datasets x horizons (rows) x models (columns) x seeds, each cell a run.

``run_table`` builds the cells and hands them to the one grid runner (:mod:`longattn.experiment.grid`);
each (cell, seed) trains in ``<out>/<dataset>/<model>/h<horizon>_s<seed>`` and a finished cell (its run's
finished marker, with the same config) is never trained again unless ``overwrite``. ``format_table`` prints the layout of the papers' Table 2 with
the paper's numbers beside ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from longattn.experiment.config import resolve_config
from longattn.experiment.grid import PAPER_SEEDS, Cell, collect_finished, run_cells
from longattn.experiment.results import markdown_table
from longattn.experiment.stats import format_difference, legend, paired_difference, summarize
from longattn.data.timeseries import resolve_series
from longattn.forecast.paper import is_misprint, paper_for_model
from longattn.tasks.forecasting import find_preset

__all__ = ["cell_dir", "difference_table", "format_table", "forecast_cells", "run_table", "split_model_spec",
           "summarise"]


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
        base = {"dataset": dataset, "horizon": int(horizon), "model": cell.column,
                "seq_len": cell.results[0]["seq_len"] if cell.results else None}
        for seed, result in zip(seeds, cell.results):
            rows.append({**base, "seed": seed, "mse": result["test"]["mse"], "mae": result["test"]["mae"],
                         "mae_denorm": result["test"]["mae_denorm"], "seconds": result["time_seconds"]})
        if cell.error:
            rows.append({**base, "seed": seeds[len(cell.results)] if len(cell.results) < len(seeds) else None,
                         "error": cell.error})
    return rows


def run_table(data_dir: str | Path | None, datasets: list[str], models: list[str], out: str | Path,
              horizons: list[int] | None = None, overrides: list[str] = (), seeds: list[int] | None = None,
              device: str | None = None, log: Any = print, collect_only: bool = False,
              workers: int | None = 1, overwrite: bool = False) -> list[dict[str, Any]]:
    """Run every (dataset, horizon, model, seed) cell not already finished (its finished run is reused, an
    interrupted one continued; ``overwrite`` trains them all again), ``workers`` at once; the rows.

    ``collect_only`` trains nothing: a (cell, seed) without a finished run gives a row marked ``missing``.
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
                cell.results = []
                if collect_finished(cell, run_dir(cell, seed)):
                    rows += _rows([cell], [seed])
                else:
                    dataset, horizon = cell.row.rsplit("/", 1)
                    rows.append({"dataset": dataset, "horizon": int(horizon), "model": cell.column, "seed": seed,
                                 "missing": True})
        return rows
    run_cells(cells, seeds, out, run_dir=run_dir, resume=not overwrite, overwrite=overwrite, log=log, workers=workers)
    return _rows(cells, seeds)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (dataset, horizon, model): test MSE/MAE mean, sample std and standard error over the seeds
    (as the paper's "repeated 5 times"), the published numbers for that model, and whether ours is worse than
    the paper beyond two standard deviations (mean - paper > 2 std; undecided with fewer than two seeds)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["dataset"], row["horizon"], row["model"]), []).append(row)
    summary = []
    for (dataset, horizon, model), group in groups.items():
        done = [r for r in group if "error" not in r and not r.get("missing")]
        entry: dict[str, Any] = {"dataset": dataset, "horizon": horizon, "model": model, "seeds": len(done),
                                 "missing_seeds": [r["seed"] for r in group if r.get("missing")],
                                 "failed": any("error" in r for r in group),
                                 "train_seconds": sum(r.get("seconds") or 0.0 for r in done)}
        for metric in ("mse", "mae"):
            values = summarize([r[metric] for r in done])
            entry[f"{metric}_mean"] = values.mean if values.n else None
            entry[f"{metric}_std"] = values.std if values.n > 1 else None
            entry[f"{metric}_sem"] = values.sem if values.n > 1 else None
        paper = paper_for_model(model, dataset, horizon, done[0].get("seq_len") if done else None)
        entry["paper_mse"], entry["paper_mae"] = paper or (None, None)
        entry["paper_misprint"] = paper is not None and is_misprint(paper)
        entry["worse_beyond_2std"] = (None if paper is None or entry["paper_misprint"] or entry["mse_std"] is None
                                      else entry["mse_mean"] - paper[0] > 2 * entry["mse_std"])
        summary.append(entry)
    return summary


MISPRINT_NOTE = ("† = the published MSE is below the square of its published MAE, which no forecast can give "
                 "(a misprint): shown as printed, compared with nothing.")


def _cell(mean: float | None, std: float | None, paper: float | None, flag: bool | None,
          misprint: bool = False) -> str:
    if mean is None:
        return "-"
    text = f"{mean:.3f}" + (f" ± {std:.3f}" if std is not None else "")
    if paper is not None:
        text += f" ({paper:.3f}{' †' if misprint else ''})"
    return text + (" **!**" if flag else "")


def format_table(rows: list[dict[str, Any]], models: list[str]) -> str:
    """Markdown table in the layout of the papers' Table 2: rows dataset x horizon, an MSE and an MAE column per
    model, each cell "mean ± std over seeds (paper)"; **!** marks an MSE worse than the paper's beyond two
    standard deviations of ours."""
    summary = {(e["dataset"], e["horizon"], e["model"]): e for e in summarise(rows)}
    order = list(dict.fromkeys((row["dataset"], row["horizon"]) for row in rows))
    header = ["Dataset", "H"]
    for model in models:
        header += [f"{model} MSE", f"{model} MAE"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for dataset, horizon in order:
        line = [dataset, str(horizon)]
        for model in models:
            entry = summary.get((dataset, horizon, model))
            if entry is None or entry["mse_mean"] is None:
                line += ["failed" if entry and entry["failed"] else "-", "-"]
                continue
            line.append(_cell(entry["mse_mean"], entry["mse_std"], entry["paper_mse"], entry["worse_beyond_2std"],
                              entry["paper_misprint"]))
            line.append(_cell(entry["mae_mean"], entry["mae_std"], entry["paper_mae"], None))
        lines.append("| " + " | ".join(line) + " |")
    seeds = sorted({e["seeds"] for e in summary.values() if e["mse_mean"] is not None})
    lines.append("")
    hours = sum(e["train_seconds"] for e in summary.values()) / 3600
    lines.append(f"Test MSE / MAE (scaled units), mean ± sample std over {'/'.join(map(str, seeds)) or 0} seed(s); "
                 "(paper) = the published number for that model; **!** = ours worse than the paper by more than "
                 f"2 std. Training time of these runs: {hours:.2f} h.")
    if any(e["paper_misprint"] and e["mse_mean"] is not None for e in summary.values()):
        lines[-1] += " " + MISPRINT_NOTE
    incomplete = [e for e in summary.values() if e["missing_seeds"]]
    if incomplete:
        lines.append("")
        lines.append("Not run yet (dataset H model: missing seeds): " + "; ".join(
            f"{e['dataset']} {e['horizon']} {e['model']}: {' '.join(map(str, e['missing_seeds']))}"
            for e in incomplete) + ".")
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
        if "error" not in row and not row.get("missing"):
            by_seed.setdefault((row["dataset"], row["horizon"], row["model"]), {})[row["seed"]] = row["mse"]
    order = list(dict.fromkeys((row["dataset"], row["horizon"]) for row in rows))
    table = [[dataset, horizon, *(format_difference(paired_difference(by_seed.get((dataset, horizon, m), {}),
                                                                      by_seed.get((dataset, horizon, reference), {})),
                                                    digits=3) for m in others)]
             for dataset, horizon in order]
    return (f"Test MSE minus {reference}'s:\n\n" + markdown_table(["Dataset", "H", *others], table)
            + f"\n\n{legend(reference)}")
