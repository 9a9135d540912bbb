"""Experiments over many LRA runs: compare mechanisms, sweep a config grid, noise robustness.

Each run is an ordinary :func:`~longattn.train.lra.run_lra` run in its own folder, so any
single cell of a table can be inspected, re-evaluated or resumed; a finished run (one with a
``results.json``) is reused when an experiment is started again with ``resume=True``.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longattn import attention as attention_registry
from longattn.train.config import ConfigError, configs_root, load_config, read_yaml
from longattn.train.lra import LRA_TASK_NAMES, run_lra
from longattn.utils import dumps_strict

SWEEP_KEYS = {"title", "description", "tasks", "preset", "attention", "set", "seeds", "grid", "variants",
              "columns", "paper", "average"}
VARIANT_KEYS = {"name", "attention", "set"}
COLUMN_KEYS = {"key", "values"}


@dataclass
class Cell:
    """One (row, column) entry of an experiment table, trained once per seed."""

    row: str
    column: str
    task: str
    attention: str
    overrides: list[str]
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def accuracies(self, split: str = "test") -> list[float]:
        return [100.0 * r[split]["accuracy"] for r in self.results if r.get(split)]


def run_cell(cell: Cell, preset: str | None, config_file: str | None, seeds: list[int], out_dir: Path,
             resume: bool = False, data_api: Any = None, dataset_cache: dict[str, Any] | None = None) -> None:
    """Train ``cell`` for every seed into ``out_dir/seed<k>``; a failure is recorded, not raised."""
    for seed in seeds:
        run_dir = out_dir / f"seed{seed}"
        finished = run_dir / "results.json"
        if resume and finished.is_file():
            cell.results.append(json.loads(finished.read_text()))
            continue
        try:
            config = load_config(task=cell.task, attention=cell.attention, preset=preset, config_file=config_file,
                                 overrides=[*cell.overrides, f"seed={seed}"])
            cell.results.append(run_lra(config, run_dir, resume=resume, data_api=data_api,
                                        dataset_cache=dataset_cache))
        except (ValueError, RuntimeError, FileNotFoundError) as err:
            # One broken mechanism or option must not lose the other cells of the table.
            cell.error = f"{type(err).__name__}: {err}"
            print(f"  failed: {cell.row} / {cell.column}: {cell.error}")
            return


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


def registered_or_note(names: list[str]) -> list[str]:
    """The registered names among ``names``; prints a note for each one that is not (yet) registered."""
    available = set(attention_registry.available())
    kept = []
    for name in names:
        if name in available:
            kept.append(name)
        else:
            print(f"note: attention {name!r} is not registered here; skipping it "
                  f"(registered: {', '.join(sorted(available))})")
    return kept


# ----------------------------------------------------------------------------- sweeps


def sweep_path(path_or_name: str | Path) -> Path:
    """A sweep file, or the name of one shipped in ``configs/lra/sweeps`` (e.g. ``skt_table7_r``)."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    shipped = configs_root() / "sweeps" / f"{path.stem}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    found = ", ".join(sorted(p.stem for p in (configs_root() / "sweeps").glob("*.yaml")))
    raise FileNotFoundError(f"sweep file {path} does not exist (shipped sweeps: {found})")


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
    for task in spec.get("tasks", LRA_TASK_NAMES):
        if task not in LRA_TASK_NAMES:
            raise ConfigError(f"unknown task {task!r} in {path}; valid: {', '.join(LRA_TASK_NAMES)}")
    return spec


def _check_keys(node: Any, valid: set[str], where: str) -> None:
    if not isinstance(node, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(set(node) - valid)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {', '.join(sorted(valid))}")


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


def run_sweep(spec: dict[str, Any], out_dir: str | Path, preset: str | None = None, tasks: list[str] | None = None,
              extra_overrides: list[str] = (), seeds: list[int] | None = None, resume: bool = False,
              data_api: Any = None) -> dict[str, Any]:
    """Train every (row, column) cell and write ``table.md`` and ``results.json`` to ``out_dir``."""
    out_dir = Path(out_dir)
    preset = preset or spec.get("preset", "standard")
    seeds = seeds or list(spec.get("seeds", [0]))
    tasks = tasks or list(spec.get("tasks", LRA_TASK_NAMES))
    cells: list[Cell] = []
    for row, attention, overrides in sweep_rows(spec):
        if not registered_or_note([attention]):
            continue
        if "columns" in spec:
            key = spec["columns"]["key"]
            for value in spec["columns"]["values"]:
                cells.append(Cell(row, f"{key.split('.')[-1]}={value}", tasks[0], attention,
                                  [*overrides, f"{key}={json.dumps(value)}", *extra_overrides]))
        else:
            cells.extend(Cell(row, task, task, attention, [*overrides, *extra_overrides]) for task in tasks)
    cache: dict[str, Any] = {}  # rows that change only model/optimiser options share their datasets
    columns = list(dict.fromkeys(c.column for c in cells))
    # Column by column, so consecutive runs share the task's datasets through the cache.
    for cell in sorted(cells, key=lambda c: columns.index(c.column)):
        print(f"== {cell.row} / {cell.column} ({cell.attention})", flush=True)
        run_cell(cell, preset, None, seeds, out_dir / _slug(cell.row) / _slug(cell.column), resume, data_api,
                 cache)
    return write_table(spec, cells, out_dir)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in text)


def write_table(spec: dict[str, Any], cells: list[Cell], out_dir: Path) -> dict[str, Any]:
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
            accs = cell.accuracies() if cell else []
            means.append(statistics.mean(accs) if accs else math.nan)
            line.append("failed" if cell and cell.error else mean_std(accs))
        if average:
            line.append(f"{statistics.mean(means):.2f}" if not any(math.isnan(m) for m in means) else "-")
        table_rows.append(line)
    title = spec.get("title", "sweep")
    text = f"### {title} — test accuracy (%)\n\n" + markdown_table(headers, table_rows) + "\n"
    paper = spec.get("paper")
    if paper:
        paper_rows = [[row, *(paper.get(row, {}).get(c, "-") for c in columns)] for row in rows if row in paper]
        text += "\nPaper:\n\n" + markdown_table(["", *columns], paper_rows) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text)
    summary = {
        "title": title,
        "cells": [{"row": c.row, "column": c.column, "task": c.task, "attention": c.attention,
                   "overrides": c.overrides, "test_accuracy": c.accuracies(), "val_accuracy": c.accuracies("val"),
                   "error": c.error} for c in cells],
        "paper": paper,
    }
    (out_dir / "results.json").write_text(dumps_strict(summary, indent=2))
    print(text)
    return summary
