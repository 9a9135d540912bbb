"""Zoology's Figure 2 for every mechanism: MQAR accuracy against model width, one panel per sequence length.

A sweep file (``configs/mqar/sweeps/zoology_fig2.yaml``; see docs/mqar.md) names the rows (mechanisms, or a
mechanism with settings, e.g. softmax run bidirectionally), the (sequence length, pairs) of the main arm and of
the long-context arm (with its own rows: the sub-quadratic mechanisms), the widths, the seeds, and per preset
the learning rates to search, the batch per sequence length and, optionally, a training mixture. The task preset
(``configs/mqar/<preset>.yaml``) holds the rest: data sizes, epochs, optimiser.

An *arm* is what one model is trained for: either one (sequence length, pairs), as Zoology's Figure 2 trains
them, or, when the preset names a ``train_mix``, every length of the main arm at once: one model per (row,
width, rate, seed) trained on the mixture and tested at each length (Zoology's later MQAR configurations). The
long-context arm always trains one model per length. Every (row, arm, width) is one grid cell of
:mod:`longattn.experiment.grid`, trained in two phases, each resumable per cell and seed (a finished run has a
``results.json`` and is reused with ``resume``):

1. the learning-rate search: the first seed at every candidate rate, in ``<row>/<length>/d<width>/lr<rate>/``;
   the rate with the best *validation* accuracy wins (ties: the lower validation loss; test is never read);
2. the other seeds at the chosen rate, beside the first seed's run, which is reused as it is (its rate was
   chosen on its validation split only, and its test split was held out throughout).

Tables and plots come from the finished runs: accuracy mean ± std (standard error) over seeds per cell, and the
paired difference from the reference row over the same seeds with its t interval
(:mod:`longattn.experiment.stats`); ``results.json``, ``table.md`` and ``zoology_fig2.png``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from longattn import attention as attention_registry
from longattn.config import ConfigError, read_yaml
from longattn.data.mqar import MQARDataset, collate, multiquery_ar
from longattn.experiment.config import resolve_config
from longattn.experiment.grid import Cell, _check_keys, _slug, difference_record, paired_against, run_cells
from longattn.experiment.results import markdown_table, now, write_results
from longattn.experiment.run import build_run_model
from longattn.experiment.stats import format_difference, legend, mean_with_sem, summarize
from longattn.tasks.base import TaskData, get_task
from longattn.tasks.mqar import MQAR_CONFIGS, eval_lengths, length_metric, recall_step, train_segments
from longattn.train.distributed import resolve_device
from longattn.train.loop import precision_autocast, to_device
from longattn.utils import optional_import

__all__ = ["Arm", "RecallRow", "SweepPlan", "cost_estimate_text", "estimate_sweep_cost", "load_recall_sweep",
           "plan_sweep", "recall_sweep_path", "run_recall_sweep", "write_cost_estimate", "write_recall_outputs"]

SWEEPS = MQAR_CONFIGS / "sweeps"
_SPEC_KEYS = {"title", "description", "reference", "rows", "lengths", "long_context", "length_settings", "widths",
              "seeds", "presets"}
_LONG_KEYS = {"lengths", "rows"}
_PRESET_KEYS = {"lrs", "batch_size", "train_mix", "mix_set"}
_ROW_KEYS = {"name", "attention", "set"}
# train.length_window of a mixture: one window for the whole epoch, so that every batch holds one sequence length
# (as Zoology's batches hold one configuration each), but the ones where two lengths meet
_ONE_WINDOW = 1_000_000


@dataclass(frozen=True)
class RecallRow:
    """A row of the figure: a label, a mechanism and its extra settings (``--set`` strings)."""

    name: str
    attention: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Arm:
    """What one model is trained for: the (sequence length, pairs) it is tested at, its rows, and the mixture
    of (sequence length, pairs, sequences) it trains on (empty: its one length, at the preset's data sizes)."""

    lengths: tuple[tuple[int, int], ...]
    rows: tuple[RecallRow, ...]
    train_mix: tuple[tuple[int, int, int], ...] = ()

    @property
    def max_len(self) -> int:
        return max([n for n, _ in self.lengths] + [n for n, _, _ in self.train_mix])

    @property
    def folder(self) -> str:
        """The arm's folder in a sweep: ``N256_K16`` for one length, ``mix`` for a mixture."""
        return "mix" if self.train_mix else "_".join(f"N{n}_K{k}" for n, k in self.lengths)

    def metric(self, seq_len: int, pairs: int) -> str | None:
        """The results' metric of one tested length (None: the selection metric, for a one-length arm)."""
        return length_metric(seq_len, pairs) if len(self.lengths) > 1 else None


@dataclass
class SweepPlan:
    """What one invocation trains: its arms, widths, seeds, candidate rates and batches."""

    title: str
    preset: str
    reference: str
    arms: list[Arm]  # in figure order
    widths: list[int]
    seeds: list[int]
    lrs: list[float]
    batch_size: dict[int, int]
    extra_overrides: list[str] = field(default_factory=list)
    length_settings: dict[int, dict[str, Any]] = field(default_factory=dict)  # every row's {dotted key: value}
    mix_set: dict[str, Any] = field(default_factory=dict)  # {dotted key: value} of the runs on a mixture

    def runs(self) -> int:
        """Runs this plan trains when nothing is finished yet."""
        cells = sum(len(arm.rows) for arm in self.arms) * len(self.widths)
        return cells * (len(self.lrs) + len(self.seeds) - 1)

    def tested(self) -> list[tuple[Arm, int, int]]:
        """(arm, sequence length, pairs) of every tested length, in figure order."""
        return [(arm, n, k) for arm in self.arms for n, k in arm.lengths]

    def cell(self, row: RecallRow, arm: Arm, width: int, lr: float, search: bool = False) -> Cell:
        """The grid cell of one (row, arm, width) at rate ``lr``; a search cell names its rate in its label.

        A mixture's model is built for its longest sequence, and the mechanisms' length-dependent budgets are
        that length's (a budget set for the shorter lengths would be too small at the longest)."""
        if arm.train_mix:
            mix = [{"seq_len": n, "num_kv_pairs": k, "examples": c} for n, k, c in arm.train_mix]
            data = [f"data.train_mix={json.dumps(mix)}",
                    f"data.eval_lengths={json.dumps([list(e) for e in arm.lengths])}",
                    "train.group_by_length=true", f"train.length_window={_ONE_WINDOW}",
                    *(f"{key}={json.dumps(value)}" for key, value in self.mix_set.items())]
        else:
            (seq_len, pairs), = arm.lengths
            data = [f"data.seq_len={seq_len}", f"data.num_kv_pairs={pairs}"]
        overrides = [*data, f"model.dim={width}", f"train.batch_size={self.batch_size[arm.max_len]}",
                     f"optim.lr={lr!r}", *_length_overrides(self.length_settings.get(arm.max_len, {}), row.attention),
                     *row.overrides, *self.extra_overrides]
        column = _column(arm, width) + (f" lr={lr:.3g}" if search else "")
        return Cell(row.name, column, "mqar", self.preset, overrides=overrides, explicit={"attention": row.attention})


def recall_sweep_path(path_or_name: str | Path) -> Path:
    """A sweep file, or the name of one shipped in ``configs/mqar/sweeps`` (e.g. ``zoology_fig2``); an explicit
    path is never swapped for a shipped file."""
    path = Path(path_or_name)
    shipped = {p.stem: p for p in SWEEPS.glob("*.yaml")}
    if not path.is_file() and path.parent == Path(".") and path.stem in shipped:
        path = shipped[path.stem]
    if not path.is_file():
        raise FileNotFoundError(f"recall sweep file {path} does not exist (shipped: {', '.join(sorted(shipped))})")
    return path


def _rows(entries: Any, where: str) -> list[RecallRow]:
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where} must be a non-empty list of mechanisms or {{name, attention, set}} mappings")
    rows = []
    for entry in entries:
        if isinstance(entry, str):
            rows.append(RecallRow(entry, entry))
            continue
        _check_keys(entry, _ROW_KEYS, f"a row of {where}")
        if "name" not in entry or "attention" not in entry:
            raise ConfigError(f"every mapping row of {where} needs a name and an attention")
        settings = entry.get("set") or {}
        if not isinstance(settings, dict):
            raise ConfigError(f"`set` of row {entry['name']!r} in {where} must map config keys to values")
        rows.append(RecallRow(str(entry["name"]), str(entry["attention"]),
                              tuple(f"{k}={json.dumps(v)}" for k, v in settings.items())))
    names = [row.name for row in rows]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where} names a row twice: {names}")
    return rows


def _lengths(entries: Any, where: str) -> list[tuple[int, int]]:
    if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) == 2 and all(isinstance(v, int)
                                                                                         for v in e)
                                                for e in entries):
        raise ConfigError(f"{where} must be a list of [sequence length, key-value pairs], e.g. [[64, 4], [128, 8]]")
    return [(int(a), int(b)) for a, b in entries]


def load_recall_sweep(path_or_name: str | Path) -> dict[str, Any]:
    """Read and check a recall sweep file; rows and lengths come back parsed (unknown keys are an error)."""
    path = recall_sweep_path(path_or_name)
    spec = read_yaml(path)
    _check_keys(spec, _SPEC_KEYS, f"recall sweep file {path}")
    for key in ("rows", "lengths", "widths", "presets"):
        if key not in spec:
            raise ConfigError(f"recall sweep file {path} needs `{key}`")
    parsed: dict[str, Any] = {"path": str(path), "title": spec.get("title", path.stem),
                              "rows": _rows(spec["rows"], f"{path}: rows"),
                              "lengths": _lengths(spec["lengths"], f"{path}: lengths"),
                              "widths": [int(w) for w in spec["widths"]],
                              "seeds": [int(s) for s in spec.get("seeds", [0, 1, 2])]}
    long = spec.get("long_context") or {}
    _check_keys(long, _LONG_KEYS, f"long_context of {path}")
    parsed["long_lengths"] = _lengths(long.get("lengths", []), f"{path}: long_context.lengths")
    parsed["long_rows"] = _rows(long["rows"], f"{path}: long_context.rows") if long.get("rows") else parsed["rows"]
    parsed["reference"] = spec.get("reference", parsed["rows"][0].name)
    if parsed["reference"] not in [row.name for row in parsed["rows"]]:
        raise ConfigError(f"{path}: reference {parsed['reference']!r} is not a row")
    presets = spec["presets"]
    _check_keys(presets, set(presets) if isinstance(presets, dict) else set(), f"presets of {path}")
    for name, entry in presets.items():
        _check_keys(entry, _PRESET_KEYS, f"presets.{name} of {path}")
        if not entry.get("lrs") or not isinstance(entry.get("batch_size"), dict):
            raise ConfigError(f"presets.{name} of {path} needs `lrs` (a list) and `batch_size` (sequence length: "
                              "batch)")
        mix = entry.get("train_mix") or []
        if not isinstance(mix, list) or not all(isinstance(e, list) and len(e) == 3 and all(isinstance(v, int)
                                                                                          for v in e) for e in mix):
            raise ConfigError(f"presets.{name}.train_mix of {path} must be a list of [sequence length, key-value "
                              "pairs, training sequences]")
        if not isinstance(entry.get("mix_set") or {}, dict):
            raise ConfigError(f"presets.{name}.mix_set of {path} must map config keys to values (the settings of "
                              "the runs on the mixture)")
    settings = spec.get("length_settings") or {}
    _check_keys(settings, set(settings) if isinstance(settings, dict) else set(), f"length_settings of {path}")
    parsed["length_settings"] = {}
    for length, entry in settings.items():
        if not isinstance(length, int) or not isinstance(entry, dict):
            raise ConfigError(f"length_settings of {path} must map a sequence length to {{config key: value}}, got "
                              f"{length!r}: {entry!r}")
        parsed["length_settings"][length] = dict(_flatten(entry))
    parsed["presets"] = {name: {"lrs": [float(v) for v in entry["lrs"]],
                                "batch_size": {int(k): int(v) for k, v in entry["batch_size"].items()},
                                "train_mix": [tuple(int(v) for v in e) for e in entry.get("train_mix") or []],
                                "mix_set": dict(_flatten(entry.get("mix_set") or {}))}
                         for name, entry in presets.items()}
    return parsed


def plan_sweep(spec: dict[str, Any], preset: str = "cpu", *, attentions: list[str] | None = None,
               lengths: list[int] | None = None, widths: list[int] | None = None, seeds: list[int] | None = None,
               lrs: list[float] | None = None, extra_overrides: list[str] = (), per_length: bool = False) -> SweepPlan:
    """The runs of ``spec`` at ``preset``, narrowed to the given row names, sequence lengths, widths, seeds or
    rates (None: the spec's). Rows whose mechanism is not registered here are left out with a note.

    With the preset's ``train_mix`` (and not ``per_length``), the main arm is one arm trained on the mixture and
    tested at every main length (``lengths`` then keeps it when it names any of them); otherwise every length is
    its own arm."""
    if preset not in spec["presets"]:
        raise ConfigError(f"the recall sweep has no preset {preset!r}; its presets: {', '.join(spec['presets'])}")
    settings = spec["presets"][preset]
    available = set(attention_registry.available())
    known_lengths = sorted({n for n, _ in [*spec["lengths"], *spec["long_lengths"]]})
    if lengths is not None:
        unknown = sorted(set(lengths) - set(known_lengths))
        if unknown:
            raise ConfigError(f"sequence length(s) {unknown} are not in the sweep; its lengths: {known_lengths}")
    names = {row.name for row in [*spec["rows"], *spec["long_rows"]]}
    if attentions is not None:
        unknown = [a for a in attentions if a not in names]
        if unknown:
            raise ConfigError(f"row(s) {unknown} are not in the sweep; its rows: {', '.join(sorted(names))}")
    mix = tuple(settings["train_mix"]) if not per_length else ()
    candidates = [Arm(tuple(spec["lengths"]), tuple(spec["rows"]), mix)] if mix else \
        [Arm(((n, k),), tuple(spec["rows"])) for n, k in spec["lengths"]]
    candidates += [Arm(((n, k),), tuple(spec["long_rows"])) for n, k in spec["long_lengths"]]
    arms = []
    for arm in candidates:
        if lengths is not None and not any(n in lengths for n, _ in arm.lengths):
            continue
        if arm.max_len not in settings["batch_size"]:
            raise ConfigError(f"presets.{preset}.batch_size of the sweep gives no batch for sequence length "
                              f"{arm.max_len}")
        kept = []
        for row in arm.rows:
            if attentions is not None and row.name not in attentions:
                continue
            if row.attention not in available:
                print(f"note: attention {row.attention!r} is not registered here; leaving out row {row.name!r}")
                continue
            kept.append(row)
        if kept:
            arms.append(Arm(arm.lengths, tuple(kept), arm.train_mix))
    if not arms:
        raise ConfigError("nothing to train: no row of the sweep is left at the chosen lengths")
    return SweepPlan(spec["title"], preset, spec["reference"], arms, list(widths or spec["widths"]),
                     list(seeds if seeds is not None else spec["seeds"]), list(lrs or settings["lrs"]),
                     settings["batch_size"], list(extra_overrides), spec["length_settings"], settings["mix_set"])


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """{"a": {"b": 1}} -> [("a.b", 1)]."""
    items = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        items.extend(_flatten(value, f"{name}.") if isinstance(value, dict) else [(name, value)])
    return items


def _length_overrides(settings: dict[str, Any], attention: str) -> list[str]:
    """A length's settings as ``--set`` strings, other mechanisms' ``attention_options`` left out (a run's
    config.yaml then holds only its own mechanism's)."""
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()
            if not key.startswith("attention_options.") or key.split(".")[1] == attention]


def _column(arm: Arm, width: int) -> str:
    lengths = "mix" if arm.train_mix else " ".join(f"N={n} K={k}" for n, k in arm.lengths)
    return f"{lengths} d={width}"


def _lr_label(lr: float) -> str:
    return f"lr{lr:.3g}"


@dataclass
class _Entry:
    """One (row, arm, width) of the figure: its search cells (one per rate) and its result cell."""

    row: RecallRow
    arm: Arm
    width: int
    search: dict[float, Cell]
    chosen: float | None = None
    result: Cell | None = None


def _choose(search: dict[float, Cell]) -> float | None:
    """The rate with the best validation accuracy of the first seed (ties: lower validation loss)."""
    scored = [(cell.results[0]["val"]["accuracy"], -cell.results[0]["val"]["loss"], -lr, lr)
              for lr, cell in search.items() if cell.results and cell.results[0].get("val")]
    return max(scored)[-1] if scored else None


def run_recall_sweep(plan: SweepPlan, out_dir: str | Path, *, resume: bool = False, workers: int | None = 1,
                     log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Train ``plan`` into ``out_dir`` (see the module docstring) and write its table, results and plot."""
    started = now()
    out_dir = Path(out_dir)
    if not plan.seeds:
        raise ConfigError("the recall sweep needs at least one seed")
    first, others = plan.seeds[0], plan.seeds[1:]
    folder = lambda entry, lr, seed: (out_dir / _slug(entry.row.name) / entry.arm.folder  # noqa: E731
                                      / f"d{entry.width}" / _lr_label(lr) / f"seed{seed}")
    entries = [_Entry(row, arm, width, {lr: plan.cell(row, arm, width, lr, search=True) for lr in plan.lrs})
               for arm in plan.arms for width in plan.widths for row in arm.rows]
    print(f"{plan.title}: {len(entries)} cells, up to {plan.runs()} runs ({len(plan.lrs)} rate(s) searched on seed "
          f"{first}, then seeds {others or 'none'} at the chosen rate)", flush=True)
    search_cells, where = [], {}
    for entry in entries:
        for lr, cell in entry.search.items():
            search_cells.append(cell)
            where[id(cell)] = folder(entry, lr, first)
    run_cells(search_cells, [first], out_dir, run_dir=lambda cell, seed: where[id(cell)], resume=resume,
              log=log, plots=False, workers=workers)
    final_cells, final_where = [], {}
    for entry in entries:
        entry.chosen = _choose(entry.search)
        if entry.chosen is None:
            errors = "; ".join(sorted({c.error for c in entry.search.values() if c.error})) or "no result"
            entry.result = Cell(entry.row.name, _column(entry.arm, entry.width), "mqar",
                                error=f"every rate failed: {errors}", explicit={"attention": entry.row.attention})
            continue
        entry.result = plan.cell(entry.row, entry.arm, entry.width, entry.chosen)
        if others:
            final_cells.append(entry.result)
            final_where[id(entry.result)] = entry
    run_cells(final_cells, others, out_dir, run_dir=lambda cell, seed: folder(final_where[id(cell)],
                                                                                final_where[id(cell)].chosen, seed),
              resume=resume, log=log, plots=False, workers=workers)
    for entry in entries:
        if entry.chosen is not None:
            entry.result.results.insert(0, entry.search[entry.chosen].results[0])
    return write_recall_outputs(plan, entries, out_dir, started)


# ----------------------------------------------------------------------------- outputs


def _by_key(entries: list[_Entry]) -> dict[tuple[str, int, int, int], _Entry]:
    """{(row, sequence length, pairs, width): the entry whose model is tested there}."""
    return {(e.row.name, n, k, e.width): e for e in entries for n, k in e.arm.lengths}


def _cost(entry: _Entry) -> dict[str, Any]:
    """Training time (s) of every run of an entry: the search runs and the other seeds'."""
    search = {str(lr): cell.results[0]["train_time_s"] for lr, cell in entry.search.items() if cell.results}
    seeds = [r["train_time_s"] for r in (entry.result.results[1:] if entry.result else [])]
    return {"search_s": search, "seeds_s": seeds, "total_s": round(sum(search.values()) + sum(seeds), 1)}


def _record(entry: _Entry, seq_len: int, pairs: int, reference: _Entry | None) -> dict[str, Any]:
    """One tested length of an entry for results.json (a mixture's entry has one record per length)."""
    cell, metric = entry.result, entry.arm.metric(seq_len, pairs)
    difference = None
    if reference is not None and reference is not entry and reference.result is not None:
        paired = paired_against(cell, reference.result, metric)
        difference = paired.as_dict() if paired else None
    return {"row": entry.row.name, "attention": entry.row.attention, "overrides": list(entry.row.overrides),
            "form": next((r.get("form") for r in cell.results), None), "seq_len": seq_len,
            "num_kv_pairs": pairs, "width": entry.width,
            "train_mix": [list(s) for s in entry.arm.train_mix] or [[seq_len, pairs]], "lr": entry.chosen,
            "lr_search": {str(lr): (c.results[0]["val"]["accuracy"] if c.results and c.results[0].get("val") else None)
                          for lr, c in entry.search.items()},
            "lr_errors": {str(lr): c.error for lr, c in entry.search.items() if c.error},
            "seeds": [r["seed"] for r in cell.results], "test": cell.values(metric), "val": cell.values(metric, "val"),
            "test_summary": cell.summary(metric), "difference": difference,
            "steps": [r["steps"] for r in cell.results], "stopped_early": [r["stopped_early"] for r in cell.results],
            "cost": _cost(entry), "error": cell.error}


def _accuracy_text(cell: Cell | None, seeds: int, metric: str | None = None) -> str:
    """'mean ± std (s.e.)' of a cell; 'failed' without results; the count when some seeds are missing."""
    if cell is None:
        return "-"
    values = cell.values(metric)
    if not values:
        return "failed" if cell.error else "-"
    text = mean_with_sem(values)
    return text if len(values) == seeds else f"{text} [{len(values)} of {seeds} seeds]"


def write_recall_outputs(plan: SweepPlan, entries: list[_Entry], out_dir: Path,
                         started: str | None = None) -> dict[str, Any]:
    """``table.md`` (per sequence length: accuracy per row and width, paired differences from the reference, the
    chosen rates, the training time), ``results.json`` and ``zoology_fig2.png``; the summary."""
    by_key = _by_key(entries)
    blocks = []
    for arm, seq_len, pairs in plan.tested():
        def cell_of(row: RecallRow, width: int) -> _Entry | None:
            return by_key.get((row.name, seq_len, pairs, width))

        metric = arm.metric(seq_len, pairs)
        headers = ["", *(f"d={w}" for w in plan.widths)]
        accuracy, differences, rates, times = [], [], [], []
        reference = next((r for r in arm.rows if r.name == plan.reference), None)
        for row in arm.rows:
            line, delta, lr_line, time_line = [row.name], [row.name], [row.name], [row.name]
            for width in plan.widths:
                entry = cell_of(row, width)
                cell = entry.result if entry else None
                line.append(_accuracy_text(cell, len(plan.seeds), metric))
                base = cell_of(reference, width) if reference else None
                delta.append("reference" if row is reference else "-" if not (cell and base and base.result)
                             else format_difference(paired_against(cell, base.result, metric)))
                lr_line.append("-" if entry is None or entry.chosen is None else f"{entry.chosen:.3g}")
                time_line.append("-" if entry is None else f"{_cost(entry)['total_s'] / 60:.1f}")
            accuracy.append(line), differences.append(delta), rates.append(lr_line), times.append(time_line)
        trained = (f"the model trained on the mixture {_mix_text(arm.train_mix)}" if arm.train_mix
                   else "a model trained at this length")
        text = [f"### N = {seq_len}, K = {pairs}: test accuracy (%) of {trained}, mean ± std (standard error) over "
                f"seeds {plan.seeds}\n", markdown_table(headers, accuracy)]
        if reference is not None and len(arm.rows) > 1:
            text += [f"\nPaired difference from {reference.name} (points):\n", markdown_table(headers, differences),
                     f"\n{legend(reference.name)}"]
        text += ["\nLearning rate chosen on validation accuracy (first seed):\n", markdown_table(headers, rates),
                 "\nTraining time of the cell, all its runs (wall-clock minutes, validation excluded"
                 f"{'; one model for every length of the mixture' if arm.train_mix else ''}):\n",
                 markdown_table(headers, times)]
        blocks.append("\n".join(text) + "\n")
    title = (f"## {plan.title}\n\nPreset `{plan.preset}`; learning rates searched: "
             f"{', '.join(f'{lr:.3g}' for lr in plan.lrs)}; batch: "
             f"{', '.join(f'{_arm_text(arm)}: {plan.batch_size[arm.max_len]}' for arm in plan.arms)}.\n\n")
    text = title + "\n".join(blocks)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text)
    records = [_record(entry, n, k, by_key.get((plan.reference, n, k, entry.width)))
               for entry in entries for n, k in entry.arm.lengths]
    summary = {"title": plan.title, "preset": plan.preset, "reference": plan.reference, "widths": plan.widths,
               "lrs": plan.lrs, "lengths": [[n, k] for _, n, k in plan.tested()],
               "arms": [{"lengths": [list(e) for e in arm.lengths], "train_mix": [list(m) for m in arm.train_mix],
                         "batch_size": plan.batch_size[arm.max_len],
                         "length_settings": plan.length_settings.get(arm.max_len, {}),
                         "settings": plan.mix_set if arm.train_mix else {}} for arm in plan.arms],
               "extra_overrides": plan.extra_overrides, "metric": "test accuracy (%)", "cells": records,
               "train_time_s": round(sum(_cost(entry)["total_s"] for entry in entries), 1)}
    write_results(out_dir / "results.json", summary, seeds=plan.seeds, started=started)
    plot_recall(plan, entries, out_dir / "zoology_fig2.png")
    print(text)
    print(f"wrote {out_dir / 'table.md'}, {out_dir / 'results.json'}, {out_dir / 'zoology_fig2.png'}")
    return summary


def _mix_text(mix: tuple[tuple[int, int, int], ...]) -> str:
    return " + ".join(f"{c:,} x ({n}, {k})" for n, k, c in mix)


def _arm_text(arm: Arm) -> str:
    return "mixture" if arm.train_mix else f"N={arm.max_len}"


def plot_recall(plan: SweepPlan, entries: list[_Entry], path: Path) -> None:
    """Zoology's Figure 2: accuracy against width (log scale), one panel per sequence length, one line per row
    (mean over seeds, bars: ± std; dashed: bidirectional form)."""
    matplotlib = optional_import("matplotlib")
    matplotlib.use("Agg")  # files only; no display needed
    plt = optional_import("matplotlib.pyplot")
    by_key = _by_key(entries)
    names = list(dict.fromkeys(row.name for arm in plan.arms for row in arm.rows))
    panels = plan.tested()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 1.6, 3.6), sharey=True, squeeze=False)
    for axis, (arm, seq_len, pairs) in zip(axes[0], panels):
        for row in arm.rows:
            points = []
            for width in plan.widths:
                entry = by_key.get((row.name, seq_len, pairs, width))
                values = entry.result.values(arm.metric(seq_len, pairs)) if entry and entry.result else []
                if values:
                    s = summarize(values)
                    points.append((width, s.mean, 0.0 if math.isnan(s.std) else s.std))
            if not points:
                continue
            index = names.index(row.name)
            bidirectional = not attention_registry.capabilities(row.attention).causal or "model.causal=false" in \
                row.overrides
            axis.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                          marker="o", markersize=3, capsize=2, color=f"C{index % 10}",
                          linestyle="--" if bidirectional else "-", label=row.name)
        axis.set_xscale("log", base=2)
        axis.set_xticks(plan.widths, [str(w) for w in plan.widths])
        axis.set(title=f"sequence length {seq_len}, {pairs} pairs", xlabel="model width", ylim=(-2, 102))
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR test accuracy (%)")
    handles = {}
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="center right", fontsize="small")
    fig.suptitle(f"{plan.title} (preset {plan.preset}; mean ± std over {len(plan.seeds)} seeds; "
                 "dashed: bidirectional)", fontsize="medium")
    fig.tight_layout(rect=(0, 0, 1 - 1.5 / (3.6 * len(panels) + 1.6), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- cost


class _CostClock:
    """Seconds of a call where the runs would train: process CPU time on a CPU (a core's cost, whatever else
    runs beside it), synchronised wall time on a GPU (what a run occupies the device for)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.description = ("wall time on the GPU, synchronised" if device.type == "cuda"
                            else "process CPU time of one thread")

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()


def measure_cell_cost(cell: Cell, steps: int = 2) -> dict[str, float]:
    """Seconds of one training step (forward, backward, AdamW) and of evaluating one example, for the model,
    batch, device (``train.device``) and precision of ``cell``, measured on generated data after one warm-up step
    per sequence length; and the run's budget. A mixture's step is the mean over its segments, weighted by their
    batches per epoch."""
    config = resolve_config(cell.task, cell.preset, cell.config_file, cell.overrides, **cell.explicit)
    d = config.data
    size = config.train.batch_size
    device = resolve_device(config.train.device)
    clock = _CostClock(device)
    torch.manual_seed(0)
    model = build_run_model(config, get_task(cell.task), TaskData(None, None, None, collate)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)

    def batch_of(seq_len: int, pairs: int) -> dict[str, Any]:
        examples = multiquery_ar(size, seq_len, pairs, vocab_size=d.vocab_size, power_a=d.power_a, seed=0)
        return to_device(collate([MQARDataset(examples)[i] for i in range(size)]), device)

    def train_step(batch: dict[str, Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision_autocast(device, config.train.precision):
            loss = recall_step(model, batch).loss
        loss.backward()
        optimizer.step()

    def step_s(seq_len: int, pairs: int) -> float:
        batch = batch_of(seq_len, pairs)
        train_step(batch)  # warm-up: first-call costs (allocations, lazily built buffers, kernels) are not a step's
        started = clock.now()
        for _ in range(steps):
            train_step(batch)
        return (clock.now() - started) / steps

    @torch.no_grad()
    def example_s(seq_len: int, pairs: int) -> float:
        batch = batch_of(seq_len, pairs)
        model.eval()
        with precision_autocast(device, config.train.precision):
            recall_step(model, batch)  # warm-up (eval-mode paths)
            started = clock.now()
            recall_step(model, batch)
            elapsed = clock.now() - started
        model.train()
        return elapsed / size

    batches = [(n, k, math.ceil(count / size)) for n, k, count in train_segments(d)]
    epoch_steps = sum(b for _, _, b in batches)
    mean_step_s = sum(b * step_s(n, k) for n, k, b in batches) / epoch_steps
    total_steps = math.ceil(config.train.epochs * epoch_steps) if config.train.epochs else config.train.max_steps
    every = epoch_steps if config.train.eval_every_epoch else config.train.eval_every
    validations = math.ceil(total_steps / every)
    evaluated = sum((validations * d.val_examples + d.test_examples) * example_s(n, k) for n, k in eval_lengths(d))
    return {"step_s": mean_step_s, "steps": total_steps, "validations": validations,
            "run_s": total_steps * mean_step_s + evaluated, "device": str(device), "clock": clock.description}


def estimate_sweep_cost(plan: SweepPlan, steps: int = 2, log: Callable[[str], Any] = print,
                        budget_s: float | None = None) -> dict[str, Any]:
    """The measured cost of every cell's run at its full budget (no early stop) and the sweep's total, in seconds
    of the device the runs would train on (``train.device``: process CPU time of one thread on a CPU, synchronised
    wall time on a GPU): a step and an evaluated example are timed for each (row, length, width) at the first
    candidate rate; a cell costs (rates + seeds - 1) runs. Early stops (Zoology's 99%) only shorten it. With
    ``budget_s``, the cells not reached within that many seconds of measuring are listed as not measured."""
    cells, unmeasured = [], []
    begin = time.monotonic()
    for arm in plan.arms:
        for width in plan.widths:
            for row in arm.rows:
                if budget_s is not None and time.monotonic() - begin > budget_s:
                    unmeasured.append({"row": row.name, "arm": _arm_text(arm), "width": width})
                    continue
                cost = measure_cell_cost(plan.cell(row, arm, width, plan.lrs[0]), steps)
                runs = len(plan.lrs) + len(plan.seeds) - 1
                cells.append({"row": row.name, "arm": _arm_text(arm), "lengths": [list(e) for e in arm.lengths],
                              "width": width, **cost, "runs": runs, "cell_s": runs * cost["run_s"]})
                log(f"  {row.name:24s} {_arm_text(arm):8s} d={width:<4d} step {cost['step_s']:.3f} s x "
                    f"{cost['steps']} steps: {cost['run_s'] / 60:.1f} min a run, {runs * cost['run_s'] / 3600:.2f} h "
                    "the cell")
    total = sum(c["cell_s"] for c in cells)
    by_arm = {_arm_text(arm): sum(c["cell_s"] for c in cells if c["arm"] == _arm_text(arm)) for arm in plan.arms}
    clocks = sorted({(c["device"], c["clock"]) for c in cells})
    return {"preset": plan.preset, "cells": cells, "total_s": total, "by_arm_s": by_arm, "unmeasured": unmeasured,
            "device": ", ".join(device for device, _ in clocks), "clock": ", ".join(clock for _, clock in clocks)}


def cost_estimate_text(cost: dict[str, Any]) -> str:
    """The estimate as markdown: a table (minutes per run at the full budget, per row and (length, width)) and
    the totals."""
    cells = cost["cells"]
    columns = list(dict.fromkeys((c["arm"], c["width"]) for c in cells))
    rows = list(dict.fromkeys(c["row"] for c in cells))
    by_key = {(c["row"], c["arm"], c["width"]): c for c in cells}
    table = markdown_table(["", *(f"{a} d={w}" for a, w in columns)],
                           [[row, *("-" if (row, a, w) not in by_key else f"{by_key[(row, a, w)]['run_s'] / 60:.1f}"
                                    for a, w in columns)] for row in rows])
    lengths = ", ".join(f"{arm}: {seconds / 3600:.1f} h" for arm, seconds in cost["by_arm_s"].items())
    missing = cost.get("unmeasured") or []
    skipped = ", ".join(f"{c['row']} {c['arm']} d={c['width']}" for c in missing)
    not_measured = (f" Not measured (the time for measuring ran out; the total leaves them out): {skipped}."
                    if missing else "")
    text = (f"### Cost of the recall sweep, preset `{cost['preset']}` ({cost['clock']}; {cost['device']})\n\n"
            f"Minutes per run at the full budget (no early stop), measured per cell:\n\n{table}\n\n"
            f"A cell trains (rates + seeds - 1) runs. Total: {cost['total_s'] / 3600:.1f} h ({lengths}); "
            f"runs that reach 99% validation accuracy stop early and cost less.{not_measured}\n")
    return text


def write_cost_estimate(cost: dict[str, Any], out_dir: str | Path | None = None) -> str:
    """:func:`cost_estimate_text`, printed, and written to ``cost.md`` and ``cost.json`` in ``out_dir`` when
    given."""
    text = cost_estimate_text(cost)
    print(text)
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cost.md").write_text(text)
        write_results(out_dir / "cost.json", cost)
    return text
