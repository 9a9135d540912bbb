"""The one grid runner: cells (task x model x attention x options) x seeds, each an ordinary run.

``compare`` (rows = mechanisms), ``sweep`` / ``noise`` (rows = variants or grid points, columns = tasks or
the values of one key) and ``forecast-table`` (rows = dataset x horizon, columns = models) are specs of
it. Each (cell, seed) trains in its own folder through :func:`longattn.experiment.run.run`, so any cell of
a table can be inspected, re-evaluated or resumed. A grid started on folders that already hold runs is
refused unless told what to do with them (:func:`plan_runs`): ``resume=True`` reuses every finished run
(its finished marker, with a saved config equal to the cell's) and continues the interrupted ones,
``overwrite=True`` trains them again. A failing cell is recorded, and the grid goes on.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from longattn import attention as attention_registry
from longattn.config import ConfigError, read_yaml
from longattn.registry import nearest
from longattn.experiment.config import RunConfig, resolve_config
from longattn.experiment.results import markdown_table, now, write_results
from longattn.experiment.progress import GridProgress, score
from longattn.experiment.run import RunStatus, run, run_status
from longattn.experiment.threads import ThreadPlan, plan_threads
from longattn.experiment.workers import RUN_ERRORS, Job, Outcome, run_jobs
from longattn.train.outputs import OutputFolderError, check_not_in_use
from longattn.experiment.curves import curve_groups, write_learning_curves
from longattn.experiment.stats import (PairedDifference, format_difference, legend, mean_with_sem, paired_difference,
                                       summarize)
from longattn.tasks.base import get_task, task_names
from longattn.train.loop import run_convergence

__all__ = ["Cell", "convergence_legend", "convergence_mark", "default_seeds", "difference_record", "load_sweep",
           "markdown_table", "paired_against", "plan_runs", "run_cells", "shipped_sweeps", "sweep_cells",
           "write_sweep_table"]


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
        return list(self.by_seed(metric, split).values())

    def by_seed(self, metric: str | None = None, split: str = "test") -> dict[int, float]:
        """{seed: ``metric`` on ``split``}, scaled for tables (the runs that have it)."""
        task = get_task(self.task)
        metric = metric or task.select_metric
        return {r["seed"]: task.table_scale * r[split][metric] for r in self.results
                if r.get(split) and r[split].get(metric) is not None}

    def not_converged(self) -> list[int]:
        """The seeds whose run ended still improving: best point at its last validation, validation loss still
        falling (:func:`longattn.train.loop.convergence`)."""
        metric = get_task(self.task).select_metric
        return [r["seed"] for r in self.results if not (run_convergence(r, metric) or {"converged": True})["converged"]]

    def convergence_mark(self) -> str:
        """`` (2/3 not converged)`` after a table cell whose runs did not all converge, else nothing."""
        return convergence_mark(len(self.not_converged()), len(self.results))

    def summary(self, metric: str | None = None, split: str = "test") -> dict[str, Any]:
        """Mean, std and standard error of ``metric`` on ``split`` over the seeds (for results files)."""
        return summarize(self.values(metric, split)).as_dict()


def convergence_mark(not_converged: int, runs: int) -> str:
    """What a table adds to a cell of ``runs`` runs of which ``not_converged`` ended still improving."""
    return f" ({not_converged}/{runs} not converged)" if not_converged else ""


def paired_against(cell: Cell, reference: Cell, metric: str | None = None,
                   split: str = "test") -> PairedDifference | None:
    """``cell`` - ``reference`` paired by seed, over the seeds whose runs saw the same data order."""
    ours, theirs = cell.by_seed(metric, split), reference.by_seed(metric, split)
    order = {r["seed"]: r.get("data_order") for r in reference.results}
    # results written before runs recorded their data order carry none: those are taken as paired
    unpaired = sorted(r["seed"] for r in cell.results if r["seed"] in theirs and r.get("data_order")
                      and order.get(r["seed"]) and r["data_order"] != order[r["seed"]])
    if unpaired:
        print(f"note: {cell.row} / {cell.column} and {reference.row} / {reference.column} saw different data "
              f"orders for seed(s) {unpaired}; those seeds are left out of their paired difference")
    return paired_difference({s: v for s, v in ours.items() if s not in unpaired}, theirs)


# Seeds per grid cell, decided here only: 3 for the demo scale (the README's `compare` stays a few minutes on
# 2 cores), 5 for the papers' presets (the papers report 5 runs: S^3 Table 12, SKTformer's forecasting tables,
# Singularformer's 5 folds). An explicit --seeds or a sweep file's `seeds` wins.
DEMO_SEEDS = 3
PAPER_SEEDS = 5


def default_seeds(preset: str | Path | None) -> list[int]:
    """Seeds 0..k-1: k = DEMO_SEEDS for the demo preset or a config file of one's own, else PAPER_SEEDS."""
    return list(range(DEMO_SEEDS if preset is None or str(preset) == "demo" else PAPER_SEEDS))


@dataclass
class _PlannedRun:
    """One (cell, seed) of a grid: its folder and config (or the error that resolving it gave) and what to do
    with the folder: reuse its finished run, or train (``resume`` / ``overwrite`` passed to the run)."""

    cell_index: int
    seed: int
    folder: Path
    config: RunConfig | None = None
    error: str | None = None
    reuse: dict[str, Any] | None = None
    resume: bool = False
    overwrite: bool = False


def plan_runs(cells: list[Cell], seeds: list[int], run_dir: Callable[[Cell, int], Path], *, resume: bool = False,
              overwrite: bool = False) -> list[_PlannedRun]:
    """Each (cell, seed) with what to do with its folder, decided before anything trains, for the whole grid
    at once (:func:`longattn.experiment.run.run_status`): a finished run is reused with ``resume``, an
    interrupted one continued; ``overwrite`` trains every run again. Without either, a grid whose folders
    already hold runs is refused (:class:`OutputFolderError`); so is a folder that holds a run of another
    configuration unless ``overwrite``, or one another run is using."""
    if resume and overwrite:
        raise OutputFolderError("--resume and --overwrite exclude each other: continue the grid's runs, or "
                                "replace them")
    planned, held = [], {"finished": [], "interrupted": [], "another": []}
    for index, cell in enumerate(cells):
        for seed in seeds:
            entry = _PlannedRun(index, seed, run_dir(cell, seed))
            planned.append(entry)
            try:
                entry.config = _cell_config(cell, seed)
            except RUN_ERRORS as err:  # a bad option fails before anything trains; the cell is recorded as failed
                entry.error = f"{type(err).__name__}: {err}"
                continue
            check_not_in_use(entry.folder)
            status = run_status(entry.folder, entry.config)
            if status.state == "empty":
                continue
            held[status.state].append((entry.folder, status))
            if overwrite:
                entry.overwrite = True
            elif status.state == "finished" and resume:
                entry.reuse = status.results
            elif status.state == "interrupted" and resume:
                entry.resume = True
    _refuse_held_runs(held, resume, overwrite)
    return planned


def _refuse_held_runs(held: dict[str, list[tuple[Path, RunStatus]]], resume: bool, overwrite: bool) -> None:
    def some(entries: list[tuple[Path, RunStatus]], with_sections: bool = False) -> str:
        shown = [f"{folder}" + (f" (sections {list(status.differences)})" if with_sections else "")
                 for folder, status in entries[:3]]
        return ", ".join(shown) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")

    if overwrite:
        return
    if held["another"]:
        raise OutputFolderError(
            f"{len(held['another'])} run folder(s) of this grid hold a run of another configuration: "
            f"{some(held['another'], True)}; pass --overwrite to train them again with these settings, or choose "
            "another --out")
    if resume or not (held["finished"] or held["interrupted"]):
        return
    counts = ", ".join(f"{len(held[state])} {state}" for state in ("finished", "interrupted") if held[state])
    raise OutputFolderError(
        f"the output folders of this grid already hold runs ({counts}: {some(held['finished'] + held['interrupted'])}); "
        "pass --resume to reuse the finished runs and continue the interrupted ones, --overwrite to train them "
        "all again, or choose another --out")


def run_cells(cells: list[Cell], seeds: list[int], out_dir: str | Path, *,
              run_dir: Callable[[Cell, int], Path] | None = None, resume: bool = False, overwrite: bool = False,
              log: Callable[[str], Any] | None = None, plots: bool = True, workers: int | None = 1,
              plan: ThreadPlan | None = None) -> list[Cell]:
    """Train every cell for every seed; runs that share data (same task, seed and data settings) build it once.

    What happens to runs already in the folders is decided first, for the whole grid (:func:`plan_runs`):
    ``resume`` reuses finished runs and continues interrupted ones, ``overwrite`` trains them again, and
    without either a grid whose folders hold runs is refused before anything trains.
    ``workers`` > 1 trains that many runs at once, each in its own process with an even share of the threads
    (:mod:`longattn.experiment.workers`); the runs and their results are the same as with one worker. None:
    the thread policy chooses (:func:`longattn.experiment.threads.plan_threads`), unless ``plan`` is that choice
    already made; the choice is the first line printed.
    """
    out_dir = Path(out_dir)
    run_dir = run_dir or (lambda cell, seed: out_dir / _slug(cell.row) / _slug(cell.column) / f"seed{seed}")
    planned = plan_runs(cells, seeds, run_dir, resume=resume, overwrite=overwrite)
    plan = plan or plan_threads(sum(1 for entry in planned if entry.reuse is None), workers=workers)
    print(plan.describe(), flush=True)
    if plan.workers > 1:
        return _run_cells_in_workers(cells, planned, log, plots, plan)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    try:
        return _run_cells_in_turn(cells, planned, log, plots)
    finally:  # a caller's own thread setting is back once the grid is done
        torch.set_num_threads(threads_before)


def _run_cells_in_turn(cells: list[Cell], planned: list[_PlannedRun], log: Callable[[str], Any] | None,
                       plots: bool) -> list[Cell]:
    """:func:`run_cells` in this process, one run after the other."""
    cache: dict[Any, Any] = {}
    by_cell: dict[int, list[_PlannedRun]] = {}
    for entry in planned:
        by_cell.setdefault(entry.cell_index, []).append(entry)
    progress = GridProgress(sum(1 for entry in planned if entry.reuse is None))
    for index, cell in enumerate(cells):
        print(f"== {cell.row} / {cell.column}", flush=True)
        entries = by_cell.get(index, [])
        for position, entry in enumerate(entries):
            if entry.reuse is not None:
                cell.results.append(entry.reuse)
                continue
            label, started = f"{cell.row} / {cell.column} seed {entry.seed}", time.perf_counter()
            try:
                if entry.error is not None:
                    raise _PlannedFailure(entry.error)
                cell.results.append(run(entry.config, entry.folder, resume=entry.resume, overwrite=entry.overwrite,
                                        data_cache=cache, log=log, plots=plots))
            except (*RUN_ERRORS, _PlannedFailure) as err:
                # One broken mechanism or option must not lose the other cells of the table.
                cell.error = str(err) if isinstance(err, _PlannedFailure) else f"{type(err).__name__}: {err}"
                progress.failed(label, cell.error, time.perf_counter() - started)
                for later in entries[position + 1:]:  # a cell stops at its first failed seed
                    if later.reuse is None:
                        progress.skipped(f"{cell.row} / {cell.column} seed {later.seed}", "an earlier seed of its "
                                         "cell failed")
                break
            progress.done(label, time.perf_counter() - started, score(cell.task, cell.results[-1]))
    return cells


class _PlannedFailure(Exception):
    """A (cell, seed) whose config could not be resolved: recorded as the cell's error."""


def collect_finished(cell: Cell, folder: Path) -> bool:
    """Add the results of the run in ``folder`` to ``cell`` if that run finished (whatever its settings):
    what a report of the finished runs in a folder (crossval --report, forecast-table --collect-only) reads."""
    status = run_status(folder, None)
    if status.state == "finished":
        cell.results.append(status.results)
    return status.state == "finished"


def _cell_config(cell: Cell, seed: int) -> RunConfig:
    return resolve_config(cell.task, cell.preset, cell.config_file, cell.overrides, **{**cell.explicit, "seed": seed})


def _run_cells_in_workers(cells: list[Cell], planned: list[_PlannedRun], log: Callable[[str], Any] | None,
                          plots: bool, plan: ThreadPlan) -> list[Cell]:
    """:func:`run_cells` with the runs spread over worker processes; each cell's results in seed order, up to
    its first failed seed (as the sequential runner, which stops a cell there: its seeds not started by then
    are skipped; those already training finish)."""
    outcomes: dict[tuple[int, int], Outcome] = {}
    jobs = []
    for entry in planned:
        key, cell = (entry.cell_index, entry.seed), cells[entry.cell_index]
        if entry.reuse is not None:
            outcomes[key] = Outcome(results=entry.reuse)
        elif entry.error is not None:
            outcomes[key] = Outcome(error=entry.error)
            print(f"  failed: {cell.row} / {cell.column}: {entry.error}", flush=True)
        else:
            jobs.append(Job(key, f"{cell.row} / {cell.column} seed {entry.seed}", entry.config, entry.folder,
                            group=entry.cell_index, resume=entry.resume, overwrite=entry.overwrite))
    outcomes.update(run_jobs(jobs, plan.workers, log=log is not None, plots=plots, threads=plan.threads))
    for entry in planned:
        cell, outcome = cells[entry.cell_index], outcomes[(entry.cell_index, entry.seed)]
        if cell.error is not None:
            continue  # the cell stopped at an earlier seed
        if outcome.error is not None:
            cell.error = outcome.error
        else:
            cell.results.append(outcome.results)
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


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in text)


# ----------------------------------------------------------------------------- sweep files

SWEEP_KEYS = {"title", "description", "tasks", "preset", "attention", "set", "seeds", "grid", "variants",
              "columns", "paper", "average", "reference"}
VARIANT_KEYS = {"name", "attention", "set"}
COLUMN_KEYS = {"key", "values"}


def shipped_sweeps() -> list[str]:
    """The names of the sweep files shipped in ``configs/lra/sweeps``."""
    from longattn.tasks.lra import LRA_CONFIGS

    return sorted(p.stem for p in (LRA_CONFIGS / "sweeps").glob("*.yaml"))


def sweep_path(path_or_name: str | Path) -> Path:
    """A sweep file, or the name of one shipped in ``configs/lra/sweeps`` (e.g. ``skt_table7_r``)."""
    from longattn.tasks.lra import LRA_CONFIGS

    path = Path(path_or_name)
    if path.is_file():
        return path
    shipped = LRA_CONFIGS / "sweeps" / f"{path.stem}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    found = shipped_sweeps()
    raise FileNotFoundError(f"sweep file {path} does not exist{nearest(path.stem, found)} (shipped sweeps: "
                            f"{', '.join(found)})")


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
                      started: str | None = None, reference: str | None = None) -> dict[str, Any]:
    """``table.md`` (rows x columns: mean ± std (standard error) of the task's metric over seeds, then each
    row's paired difference from the ``reference`` row, default the sweep's or the first) and ``results.json``."""
    rows = list(dict.fromkeys(c.row for c in cells))
    columns = list(dict.fromkeys(c.column for c in cells))
    by_key = {(c.row, c.column): c for c in cells}
    reference = sweep_reference(spec, rows, reference)
    average = spec.get("average", "columns" not in spec)
    headers = ["", *columns] + (["average"] if average else [])
    table_rows, difference_rows = [], []
    for row in rows:
        means = []
        line, differences = [row], [row]
        for column in columns:
            cell = by_key.get((row, column))
            values = cell.values() if cell else []
            means.append(summarize(values).mean)
            mark = cell.convergence_mark() if cell else ""
            line.append("failed" if cell and cell.error else mean_with_sem(values) + mark)
            base = by_key.get((reference, column))
            differences.append("reference" if row == reference else
                               format_difference(paired_against(cell, base)) if cell and base else "-")
        if average:
            line.append(f"{statistics.mean(means):.2f}" if not any(math.isnan(m) for m in means) else "-")
        table_rows.append(line)
        difference_rows.append(differences)
    title = spec.get("title", "sweep")
    metric = _metric_label(cells)
    text = (f"### {title} — {metric}, mean ± std (standard error) over seeds {seeds}\n\n"
            + markdown_table(headers, table_rows) + "\n"
            + convergence_legend(any(cell.not_converged() for cell in cells)))
    if len(rows) > 1:
        text += (f"\nPaired difference from {reference}:\n\n" + markdown_table(["", *columns], difference_rows)
                 + f"\n\n{legend(reference)}\n")
    paper = spec.get("paper")
    if paper:
        paper_rows = [[row, *(paper.get(row, {}).get(c, "-") for c in columns)] for row in rows if row in paper]
        text += "\nPaper:\n\n" + markdown_table(["", *columns], paper_rows) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text)
    summary = {
        "title": title,
        "metric": metric,
        "reference": reference,
        "cells": [{"row": c.row, "column": c.column, "task": c.task, "attention": c.attention,
                   "overrides": c.overrides, "test": c.values(), "val": c.values(split="val"),
                   "test_summary": c.summary(), "difference": difference_record(c, by_key.get((reference, c.column))),
                   "not_converged": c.not_converged(), "error": c.error} for c in cells],
        "paper": paper,
    }
    write_results(out_dir / "results.json", summary, seeds=seeds, started=started)
    print(text)
    return summary


def convergence_legend(marked: bool, runs: str = "runs") -> str:
    """The note under a table where some cell is marked "not converged" (``marked``); nothing otherwise."""
    if not marked:
        return ""
    return (f"\n(k/n not converged): k of the cell's n {runs} had their best point at their last validation with "
            "the validation loss still falling; a longer run would probably change the figure (each run's "
            "results.json, `convergence`, has the numbers).\n")


def sweep_reference(spec: dict[str, Any], rows: list[str], reference: str | None = None) -> str | None:
    """The row the others are compared with: ``reference``, else the sweep's ``reference``, else the first row."""
    reference = reference or spec.get("reference") or (rows[0] if rows else None)
    if rows and reference not in rows:
        raise ConfigError(f"reference row {reference!r} is not a row of this sweep; rows: {', '.join(rows)}")
    return reference


def difference_record(cell: Cell, reference: Cell | None) -> dict[str, Any] | None:
    """The paired difference of ``cell`` from ``reference`` for results files (None for the reference)."""
    if reference is None or reference is cell:
        return None
    difference = paired_against(cell, reference)
    return difference.as_dict() if difference else None


def _metric_label(cells: list[Cell]) -> str:
    if not cells:
        return "test metric"
    task = get_task(cells[0].task)
    unit = " (%)" if task.table_scale == 100 else ""
    return f"test {task.select_metric}{unit}"


def run_sweep(spec: dict[str, Any], out_dir: str | Path, preset: str | None = None, tasks: list[str] | None = None,
              extra_overrides: list[str] = (), seeds: list[int] | None = None, resume: bool = False,
              reference: str | None = None, workers: int | None = 1, overwrite: bool = False) -> dict[str, Any]:
    """Train every (row, column) cell of a sweep spec (``workers`` runs at once; None: the thread policy's
    choice); write ``table.md``,
    ``results.json`` and learning curves."""
    started = now()
    seeds = seeds or list(spec.get("seeds") or default_seeds(preset or spec.get("preset", "standard")))
    cells = sweep_cells(spec, preset, tasks, extra_overrides)
    sweep_reference(spec, list(dict.fromkeys(c.row for c in cells)), reference)  # a bad name fails before training
    run_cells(cells, seeds, out_dir, resume=resume, overwrite=overwrite, workers=workers)
    summary = write_sweep_table(spec, cells, Path(out_dir), seeds, started, reference)
    write_learning_curves(curve_groups(cells), Path(out_dir))
    return summary
