"""Learning curves of a grid: validation loss and metric against optimiser step and against training time.

Every run's ``results.json`` holds its validation ``history`` (one record per validation: step, loss, the
task's metrics and ``train_time_s``, the training time so far with validation excluded). The runs of one
row (the same settings, different seeds) are averaged: at each validated step the mean over the seeds that
reached it, with a band of ± one standard deviation, and on the time axis the seeds' mean training time at
that step. One figure per task (``curves_<task>.png``: loss and metric against step, top, and against time,
bottom), ``curves.md`` (one line per row) and ``curves.json``. ``compare`` and ``sweep`` write them after
training; ``longattn curves DIR`` writes them for an existing output folder.

Results written before the history recorded ``train_time_s`` are still read: their time axis is estimated
as step x the run's mean step time (``time_estimated`` in ``curves.json``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from longattn.experiment.results import markdown_table, write_results
from longattn.experiment.stats import mean_std, summarize
from longattn.tasks.base import get_task
from longattn.utils import optional_import

__all__ = ["CurveGroup", "curve_groups", "groups_from_folder", "learning_curves", "write_learning_curves"]


@dataclass
class CurveGroup:
    """The runs (one per seed) of one row of a grid, on one task."""

    task: str
    label: str
    runs: list[dict[str, Any]] = field(default_factory=list)


def curve_groups(cells: Iterable[Any]) -> list[CurveGroup]:
    """One group per grid cell (:class:`longattn.experiment.grid.Cell`) that has results."""
    return [CurveGroup(cell.task, cell.row if cell.column == cell.task else f"{cell.row} / {cell.column}",
                       list(cell.results))
            for cell in cells if cell.results]


_SEED_FOLDER = re.compile(r"^seed\d+$")  # compare / sweep: <row>/[<column>/]seed<k>
_SEED_SUFFIX = re.compile(r"_s\d+$")  # forecast-table: <dataset>/<model>/h<horizon>_s<k>


def groups_from_folder(folder: str | Path) -> list[CurveGroup]:
    """The runs under ``folder`` (every ``results.json`` with a validation history), grouped by run folder
    with its seed part removed (``softmax/seed0`` and ``softmax/seed1`` are one group, ``softmax``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of runs")
    groups: dict[tuple[str, str], CurveGroup] = {}
    for path in sorted(folder.rglob("results.json")):
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a readable results file: {err}") from None
        if not isinstance(results, dict) or "history" not in results or "task" not in results:
            continue  # a grid's own summary, or not a run
        parts = [part for part in path.parent.relative_to(folder).parts if not _SEED_FOLDER.match(part)]
        if parts:
            parts[-1] = _SEED_SUFFIX.sub("", parts[-1])
        label = "/".join(parts) or results.get("attention") or results["task"]
        groups.setdefault((results["task"], label), CurveGroup(results["task"], label)).runs.append(results)
    if not groups:
        raise FileNotFoundError(f"no run results (results.json with a validation history) under {folder}")
    return list(groups.values())


def _points(run: dict[str, Any], metric: str, scale: float) -> tuple[list[dict[str, float]], bool]:
    """(step, time, loss, metric) of each validation of one run, and whether the time is estimated."""
    history = [h for h in run.get("history") or [] if h.get("split", "val") == "val"]
    step_time = run["train_time_s"] / run["steps"] if run.get("steps") else math.nan
    estimated = any("train_time_s" not in h for h in history)
    points = [{"step": h["step"], "time": h.get("train_time_s", h["step"] * step_time),
               "loss": h.get("loss", math.nan),
               "metric": scale * h[metric] if h.get(metric) is not None else math.nan} for h in history]
    return points, estimated


def learning_curves(group: CurveGroup) -> dict[str, Any]:
    """Mean and standard deviation over seeds at each validated step, for loss, metric and time."""
    task = get_task(group.task)
    metric = task.select_metric
    per_run = [_points(run, metric, task.table_scale) for run in group.runs]
    steps = sorted({p["step"] for points, _ in per_run for p in points})
    points = []
    for step in steps:
        at_step = [p for run_points, _ in per_run for p in run_points if p["step"] == step]
        entry: dict[str, float] = {"step": step, "seeds": len(at_step)}
        for key in ("time", "loss", "metric"):
            summary = summarize([p[key] for p in at_step])
            entry[key], entry[f"{key}_std"] = summary.mean, summary.std
        points.append(entry)
    finals = [points_[-1] for points_, _ in per_run if points_]
    best = [max(p["metric"] for p in points_) if task.select_mode == "max" else min(p["metric"] for p in points_)
            for points_, _ in per_run if points_]
    return {"task": group.task, "label": group.label, "metric": metric, "select_mode": task.select_mode,
            "seeds": [run.get("seed") for run in group.runs], "time_estimated": any(e for _, e in per_run),
            "points": points, "final_loss": [p["loss"] for p in finals], "best_metric": best,
            "train_time_s": [p["time"] for p in finals]}


def _unit(task: str) -> str:
    return " (%)" if get_task(task).table_scale == 100 else ""


def curves_table(curves: list[dict[str, Any]]) -> str:
    """One line per row: seeds, validations, final validation loss and best validation metric over seeds."""
    lines = []
    for task in dict.fromkeys(c["task"] for c in curves):
        rows = [[c["label"], len(c["seeds"]), len(c["points"]), c["points"][-1]["step"] if c["points"] else "-",
                 mean_std(c["train_time_s"], 1), mean_std(c["final_loss"], 3), mean_std(c["best_metric"])]
                for c in curves if c["task"] == task]
        metric = next(c["metric"] for c in curves if c["task"] == task)
        headers = ["run", "seeds", "validations", "last step", "train time (s)", "final val loss",
                   f"best val {metric}{_unit(task)}"]
        lines.append(f"### {task}: learning curves (mean ± std over seeds)\n\n{markdown_table(headers, rows)}\n")
    return "\n".join(lines)


def plot_task_curves(curves: list[dict[str, Any]], path: Path) -> None:
    """Loss and metric against step (top) and training time (bottom) for every row of one task."""
    matplotlib = optional_import("matplotlib")
    matplotlib.use("Agg")  # files only; no display needed
    plt = optional_import("matplotlib.pyplot")

    task, metric = curves[0]["task"], curves[0]["metric"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharey="col")
    for index, curve in enumerate(curves):
        points = curve["points"]
        colour = f"C{index % 10}"
        for row, x_key in enumerate(("step", "time")):
            for column, y_key in enumerate(("loss", "metric")):
                axis = axes[row][column]
                x = [p[x_key] for p in points]
                y = [p[y_key] for p in points]
                spread = [0.0 if math.isnan(p[f"{y_key}_std"]) else p[f"{y_key}_std"] for p in points]
                axis.plot(x, y, marker=".", color=colour, label=curve["label"])
                axis.fill_between(x, [a - b for a, b in zip(y, spread)], [a + b for a, b in zip(y, spread)],
                                  color=colour, alpha=0.15, linewidth=0)
    estimated = any(c["time_estimated"] for c in curves)
    for row, xlabel in enumerate(("optimiser step", "training time (s)" + (", partly estimated" if estimated else ""))):
        axes[row][0].set(xlabel=xlabel, ylabel="validation loss")
        axes[row][1].set(xlabel=xlabel, ylabel=f"validation {metric}{_unit(task)}")
    seeds = max(len(c["seeds"]) for c in curves)
    fig.suptitle(f"{task}: learning curves, mean ± std over {seeds} seed{'s' if seeds > 1 else ''}")
    axes[0][1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_learning_curves(groups: list[CurveGroup], out_dir: str | Path) -> list[Path]:
    """``curves.json``, ``curves.md`` and one ``curves_<task>.png`` per task in ``out_dir``; the paths."""
    out_dir = Path(out_dir)
    curves = [learning_curves(group) for group in groups if any(run.get("history") for run in group.runs)]
    if not curves:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_results(out_dir / "curves.json", {"curves": curves}), out_dir / "curves.md"]
    (out_dir / "curves.md").write_text(curves_table(curves))
    for task in dict.fromkeys(c["task"] for c in curves):
        path = out_dir / f"curves_{task}.png"
        plot_task_curves([c for c in curves if c["task"] == task], path)
        written.append(path)
    return written
