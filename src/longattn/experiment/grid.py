"""The one grid runner: cells (task x model x attention x options) x seeds, each an ordinary run.

``compare`` (rows = mechanisms), ``sweep`` / ``noise`` (rows = variants or grid points, columns = tasks or
the values of one key) and ``forecast-table`` (rows = dataset x horizon, columns = models) are specs of
it. Each (cell, seed) trains in its own folder through :func:`longattn.experiment.run.run`, so any cell of
a table can be inspected, re-evaluated or resumed; a finished run (one with a ``results.json``) is reused
when a grid is started again with ``resume=True``. A failing cell is recorded, and the grid goes on.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from longattn import attention as attention_registry
from longattn.config import ConfigError, read_yaml
from longattn.experiment.config import resolve_config
from longattn.experiment.results import now, write_results
from longattn.experiment.run import run
from longattn.tasks.base import get_task, task_names

__all__ = ["Cell", "load_sweep", "markdown_table", "mean_std", "run_cells", "sweep_cells", "write_sweep_table"]


@dataclass
class Cell:
    """One (row, column) entry of a table: a task, its settings, and a result per seed."""

    row: str
    column: str
    task: str
    preset: str | Path | None = None
    config_file: str | Path | None = None
    overrides: list[str] = field(default_factory=list)
    explicit: dict[str, Any] = field(default_factory=dict)  # command-line-level settings (attention, model_name...)
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def attention(self) -> str | None:
        return self.explicit.get("attention")

    def values(self, metric: str | None = None, split: str = "test") -> list[float]:
        """``metric`` (default: the task's selection metric) on ``split`` for every seed, scaled for tables."""
        task = get_task(self.task)
        metric = metric or task.select_metric
        return [task.table_scale * r[split][metric] for r in self.results
                if r.get(split) and r[split].get(metric) is not None]


def run_cells(cells: list[Cell], seeds: list[int], out_dir: str | Path, *,
              run_dir: Callable[[Cell, int], Path] | None = None, resume: bool = False,
              log: Callable[[str], Any] | None = None, plots: bool = True) -> list[Cell]:
    """Train every cell for every seed; runs that share data (same task, seed and data settings) build it once."""
    out_dir = Path(out_dir)
    run_dir = run_dir or (lambda cell, seed: out_dir / _slug(cell.row) / _slug(cell.column) / f"seed{seed}")
    cache: dict[Any, Any] = {}
    for cell in cells:
        print(f"== {cell.row} / {cell.column}", flush=True)
        for seed in seeds:
            folder = run_dir(cell, seed)
            finished = folder / "results.json"
            if resume and finished.is_file():
                cell.results.append(json.loads(finished.read_text()))
                continue
            try:
                config = resolve_config(cell.task, cell.preset, cell.config_file, cell.overrides,
                                        **{**cell.explicit, "seed": seed})
                cell.results.append(run(config, folder, resume=resume, data_cache=cache, log=log, plots=plots))
            except (ValueError, RuntimeError, FileNotFoundError, KeyError) as err:
                # One broken mechanism or option must not lose the other cells of the table.
                cell.error = f"{type(err).__name__}: {err}"
                print(f"  failed: {cell.row} / {cell.column}: {cell.error}", flush=True)
                break
    return cells


def registered_or_note(names: list[str]) -> list[str]:
    """The registered mechanisms among ``names``; a note for each one that is not (yet) registered."""
    available = set(attention_registry.available())
    kept = []
    for name in names:
        if name in available:
            kept.append(name)
        else:
            print(f"note: attention {name!r} is not registered here; skipping it "
                  f"(registered: {', '.join(sorted(available))})")
    return kept


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    text = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in text]
    return "\n".join(lines)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in text)


# ----------------------------------------------------------------------------- sweep files

SWEEP_KEYS = {"title", "description", "tasks", "preset", "attention", "set", "seeds", "grid", "variants",
              "columns", "paper", "average"}
VARIANT_KEYS = {"name", "attention", "set"}
COLUMN_KEYS = {"key", "values"}


def sweep_path(path_or_name: str | Path) -> Path:
    """A sweep file, or the name of one shipped in ``configs/lra/sweeps`` (e.g. ``skt_table7_r``)."""
    from longattn.tasks.lra import LRA_CONFIGS

    path = Path(path_or_name)
    if path.is_file():
        return path
    shipped = LRA_CONFIGS / "sweeps" / f"{path.stem}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    found = ", ".join(sorted(p.stem for p in (LRA_CONFIGS / "sweeps").glob("*.yaml")))
    raise FileNotFoundError(f"sweep file {path} does not exist (shipped sweeps: {found})")


def _check_keys(node: Any, valid: set[str], where: str) -> None:
    if not isinstance(node, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(set(node) - valid)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {', '.join(sorted(valid))}")


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and check a sweep file (see docs/lra.md), or a shipped one by name; unknown keys are an error."""
    path = sweep_path(path)
    spec = read_yaml(path)
    _check_keys(spec, SWEEP_KEYS, f"sweep file {path}")
    if "attention" not in spec and not spec.get("variants"):
        raise ConfigError(f"sweep file {path} needs `attention` (or an attention in every variant)")
    if bool(spec.get("grid")) == bool(spec.get("variants")) and not spec.get("columns"):
        raise ConfigError(f"sweep file {path} needs exactly one of `grid` or `variants` (or `columns`)")
    for variant in spec.get("variants", []) or []:
        _check_keys(variant, VARIANT_KEYS, f"a variant of {path}")
        if "name" not in variant:
            raise ConfigError(f"every variant of {path} needs a name")
    if "columns" in spec:
        _check_keys(spec["columns"], COLUMN_KEYS, f"`columns` of {path}")
        if len(spec.get("tasks", [])) != 1:
            raise ConfigError(f"sweep file {path}: `columns` replaces the task axis, so give exactly one task")
    valid_tasks = task_names()
    for task in spec.get("tasks", task_names("lra")):
        if task not in valid_tasks:
            raise ConfigError(f"unknown task {task!r} in {path}; valid: {', '.join(valid_tasks)}")
    return spec


def _as_overrides(value: Any) -> list[str]:
    """A variant's ``set`` as override strings: a list of "k=v" or a mapping {k: v}."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{k}={json.dumps(v)}" for k, v in value.items()]
    return [str(v) for v in value]


def sweep_rows(spec: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(row label, attention, overrides) for every row of the sweep."""
    base = _as_overrides(spec.get("set"))
    if spec.get("variants"):
        return [(v["name"], v.get("attention", spec.get("attention")), base + _as_overrides(v.get("set")))
                for v in spec["variants"]]
    grid = spec.get("grid") or {}
    if not grid:
        return [(spec["attention"], spec["attention"], base)]
    keys = list(grid)
    rows = []
    for values in itertools.product(*(grid[k] for k in keys)):
        label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values))
        rows.append((label, spec["attention"], base + [f"{k}={json.dumps(v)}" for k, v in zip(keys, values)]))
    return rows


def sweep_cells(spec: dict[str, Any], preset: str | None = None, tasks: list[str] | None = None,
                extra_overrides: list[str] = ()) -> list[Cell]:
    """The cells of a sweep spec, column by column (consecutive runs then share the task's data)."""
    preset = preset or spec.get("preset", "standard")
    tasks = tasks or list(spec.get("tasks", task_names("lra")))
    cells: list[Cell] = []
    for row, attention, overrides in sweep_rows(spec):
        if not registered_or_note([attention]):
            continue
        if "columns" in spec:
            key = spec["columns"]["key"]
            for value in spec["columns"]["values"]:
                cells.append(Cell(row, f"{key.split('.')[-1]}={value}", tasks[0], preset,
                                  overrides=[*overrides, f"{key}={json.dumps(value)}", *extra_overrides],
                                  explicit={"attention": attention}))
        else:
            cells.extend(Cell(row, task, task, preset, overrides=[*overrides, *extra_overrides],
                              explicit={"attention": attention}) for task in tasks)
    columns = list(dict.fromkeys(c.column for c in cells))
    return sorted(cells, key=lambda c: columns.index(c.column))


def write_sweep_table(spec: dict[str, Any], cells: list[Cell], out_dir: Path, seeds: list[int],
                      started: str | None = None) -> dict[str, Any]:
    """``table.md`` (rows x columns, mean ± std of the task's metric) and ``results.json``."""
    rows = list(dict.fromkeys(c.row for c in cells))
    columns = list(dict.fromkeys(c.column for c in cells))
    by_key = {(c.row, c.column): c for c in cells}
    average = spec.get("average", "columns" not in spec)
    headers = ["", *columns] + (["average"] if average else [])
    table_rows = []
    for row in rows:
        means = []
        line = [row]
        for column in columns:
            cell = by_key.get((row, column))
            values = cell.values() if cell else []
            means.append(statistics.mean(values) if values else math.nan)
            line.append("failed" if cell and cell.error else mean_std(values))
        if average:
            line.append(f"{statistics.mean(means):.2f}" if not any(math.isnan(m) for m in means) else "-")
        table_rows.append(line)
    title = spec.get("title", "sweep")
    metric = _metric_label(cells)
    text = f"### {title} — {metric}\n\n" + markdown_table(headers, table_rows) + "\n"
    paper = spec.get("paper")
    if paper:
        paper_rows = [[row, *(paper.get(row, {}).get(c, "-") for c in columns)] for row in rows if row in paper]
        text += "\nPaper:\n\n" + markdown_table(["", *columns], paper_rows) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text)
    summary = {
        "title": title,
        "metric": metric,
        "cells": [{"row": c.row, "column": c.column, "task": c.task, "attention": c.attention,
                   "overrides": c.overrides, "test": c.values(), "val": c.values(split="val"),
                   "error": c.error} for c in cells],
        "paper": paper,
    }
    write_results(out_dir / "results.json", summary, seeds=seeds, started=started)
    print(text)
    return summary


def _metric_label(cells: list[Cell]) -> str:
    if not cells:
        return "test metric"
    task = get_task(cells[0].task)
    unit = " (%)" if task.table_scale == 100 else ""
    return f"test {task.select_metric}{unit}"


def run_sweep(spec: dict[str, Any], out_dir: str | Path, preset: str | None = None, tasks: list[str] | None = None,
              extra_overrides: list[str] = (), seeds: list[int] | None = None, resume: bool = False) -> dict[str, Any]:
    """Train every (row, column) cell of a sweep spec and write ``table.md`` and ``results.json``."""
    started = now()
    seeds = seeds or list(spec.get("seeds", [0]))
    cells = run_cells(sweep_cells(spec, preset, tasks, extra_overrides), seeds, out_dir, resume=resume)
    return write_sweep_table(spec, cells, Path(out_dir), seeds, started)
