"""The transfer-learning experiment (SKTformer / S^3 Table 3): pretrain with MLM, fine-tune on GLUE with a
hyper-parameter search, report the best configuration per task (mean ± std over seeds) beside the papers.

A transfer spec (YAML; shipped: ``configs/transfer/table3_cpu.yaml``, ``table3_paper.yaml``,
``minilm.yaml``) holds::

    title: ...
    mechanisms: [softmax, skeleton, fnet, ponet]
    pretrain: {preset: cpu, set: [...]}          # the mlm runs (table3 only)
    finetune:
      preset: cpu                                # of the glue_<task> tasks
      tasks: [sst2, cola, mrpc, stsb]
      search: {optim.lr: [5.0e-5, 1.0e-4], train.batch_size: [16, 32], train.epochs: [4, 20]}
      seeds: [0, 1]
      set: [...]                                 # every run
      task_set: {sst2: [train.epochs=1]}         # the runs of one task

Every (mechanism, task, search point, seed) is an ordinary run in its own folder
(``finetune/<mechanism>/<task>/<point>/seed<k>``), so any of them can be inspected or resumed. Per
mechanism and task the search point with the best mean dev score over the seeds is reported (the papers
report "the best GLUE results from multiple hyper-parameter configurations"); its mean ± std is the cell.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

from longattn.config import ConfigError, read_yaml
from longattn.data.glue import get_glue_task, read_glue
from longattn.experiment.grid import (Cell, convergence_legend, convergence_mark, markdown_table, registered_or_note,
                                      run_cells)
from longattn.experiment.run import run_status
from longattn.experiment.results import now, write_results
from longattn.tasks.transfer import TRANSFER_CONFIGS, majority_class_scores

__all__ = ["PAPER_TABLE3", "TABLE3_COLUMNS", "collect_finetune_cells", "finetune_grid", "load_spec", "pretrain_grid",
           "select_best", "write_transfer_table"]

#: Table 3's columns (GLUE dev; MNLI matched) in its order, as longattn.data.glue names the tasks.
TABLE3_COLUMNS = ("mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte")
COLUMN_TITLES = {"mnli": "MNLI", "qqp": "QQP", "qnli": "QNLI", "sst2": "SST-2", "cola": "CoLA", "stsb": "STS-B",
                 "mrpc": "MRPC", "rte": "RTE"}
#: SKTformer Table 3 = S^3 Table 3 (identical), with the mechanism each row corresponds to here.
PAPER_TABLE3: dict[str, tuple[str, dict[str, float]]] = {
    "softmax": ("BERT-Base", dict(zip(TABLE3_COLUMNS, (81.98, 89.25, 88.22, 91.07, 48.08, 87.98, 86.43, 69.98)))),
    "fnet": ("FNet-Base", dict(zip(TABLE3_COLUMNS, (73.20, 85.83, 80.57, 88.66, 40.67, 80.64, 80.88, 57.41)))),
    "ponet": ("PoNet-Base", dict(zip(TABLE3_COLUMNS, (77.02, 87.59, 84.37, 89.29, 45.38, 84.66, 81.82, 64.27)))),
    "skeleton": ("SKTformer", dict(zip(TABLE3_COLUMNS, (76.86, 87.67, 84.12, 90.14, 46.72, 84.87, 81.84, 63.87)))),
}
PAPER_AVERAGES = {"softmax": 80.37, "fnet": 73.48, "ponet": 76.80, "skeleton": 77.01}

SPEC_KEYS = {"title", "description", "mechanisms", "pretrain", "finetune"}
PRETRAIN_KEYS = {"preset", "set"}
FINETUNE_KEYS = {"preset", "tasks", "search", "seeds", "set", "task_set"}


def _check(node: Any, valid: set[str], where: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(set(node) - valid)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {', '.join(sorted(valid))}")
    return node


def load_spec(path_or_name: str | Path) -> dict[str, Any]:
    """A transfer spec file, or the name of a shipped one (``table3_cpu``); unknown keys are an error."""
    path = Path(path_or_name)
    if not path.is_file():
        shipped = TRANSFER_CONFIGS / f"{path.stem}.yaml"
        if path.parent != Path(".") or not shipped.is_file():
            found = ", ".join(sorted(p.stem for p in TRANSFER_CONFIGS.glob("*.yaml")))
            raise FileNotFoundError(f"transfer spec {path} does not exist (shipped: {found})")
        path = shipped
    spec = _check(read_yaml(path), SPEC_KEYS, f"transfer spec {path}")
    _check(spec.get("pretrain", {}), PRETRAIN_KEYS, f"`pretrain` of {path}")
    finetune = _check(spec.get("finetune", {}), FINETUNE_KEYS, f"`finetune` of {path}")
    task_set = finetune.get("task_set", {})
    for task in [*finetune.get("tasks", ()), *(task_set if isinstance(task_set, dict) else ())]:
        get_glue_task(task)  # unknown names fail before anything runs
    if not isinstance(task_set, dict) or not all(isinstance(v, list) for v in task_set.values()):
        raise ConfigError(f"`finetune.task_set` of {path} must map GLUE task names to lists of KEY=VALUE overrides")
    if not isinstance(finetune.get("search", {}), dict) or not all(
            isinstance(v, list) and v for v in finetune.get("search", {}).values()):
        raise ConfigError(f"`finetune.search` of {path} must map config keys to non-empty lists of values")
    return spec


def search_points(search: dict[str, list[Any]]) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every point of the search grid, e.g. ``("lr=0.0001,batch_size=32", [...])``."""
    keys = list(search)
    points = []
    for values in itertools.product(*(search[k] for k in keys)):
        label = ",".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values)) or "default"
        points.append((label, [f"{k}={json.dumps(v)}" for k, v in zip(keys, values)]))
    return points


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=," else "_" for c in text)


def pretrain_grid(spec: dict[str, Any], out_dir: Path, data_overrides: list[str], resume: bool = False,
                  workers: int | None = 1, overwrite: bool = False) -> dict[str, Path]:
    """MLM-pretrain every mechanism of ``spec`` into ``out_dir/pretrain/<mechanism>`` (``workers`` at once);
    their folders."""
    part = spec.get("pretrain", {})
    mechanisms = registered_or_note(list(spec["mechanisms"]))
    cells = [Cell(name, "pretrain", "mlm", part.get("preset"), overrides=[*part.get("set", []), *data_overrides],
                  explicit={"attention": name}) for name in mechanisms]
    folders = {name: out_dir / "pretrain" / name for name in mechanisms}
    run_cells(cells, [0], out_dir, run_dir=lambda cell, seed: folders[cell.row], resume=resume, overwrite=overwrite,
              workers=workers)
    failed = {c.row: c.error for c in cells if c.error}
    return {name: folder for name, folder in folders.items() if name not in failed}


def finetune_grid(spec: dict[str, Any], out_dir: Path, starts: dict[str, str], data_overrides: list[str],
                  resume: bool = False, extra_overrides: list[str] = (), workers: int | None = 1,
                  overwrite: bool = False) -> list[Cell]:
    """Fine-tune each mechanism (from ``starts[mechanism]``: a pretraining folder or ``minilm``) on every
    task and search point of ``spec`` for every seed (``workers`` runs at once); one :class:`Cell` per
    (mechanism, task, point)."""
    part = spec.get("finetune", {})
    seeds = list(part.get("seeds", [0]))
    cells = []
    for task in part.get("tasks", ["sst2"]):
        for name, start in starts.items():
            for label, overrides in search_points(part.get("search", {})):
                cells.append(Cell(name, f"{task}/{label}", f"glue_{task}", part.get("preset"),
                                  overrides=[*part.get("set", []), *part.get("task_set", {}).get(task, []),
                                             *overrides, f"model.pretrained={start}",
                                             *data_overrides, *extra_overrides],
                                  explicit={"attention": name}))
    folder = lambda cell, seed: out_dir / "finetune" / cell.row / _slug(cell.column) / f"seed{seed}"  # noqa: E731
    return run_cells(cells, seeds, out_dir, run_dir=folder, resume=resume, overwrite=overwrite, plots=False,
                     workers=workers)


def collect_finetune_cells(folders: list[str | Path], glue_dir: str | Path | None = None) -> list[Cell]:
    """One :class:`Cell` per (mechanism, task, search point) from the runs finished under each folder's
    ``finetune/<mechanism>/<task>_<point>/seed<k>`` (what :func:`finetune_grid` writes), merged over the folders
    in their order; unfinished runs are left out. The same (mechanism, task, point, seed) in two folders is an
    error naming both: which one counts is the user's choice. With ``glue_dir`` (the glue_data/ folder), runs
    that do not record their task's majority class (finished before runs did) get it from the labels there."""
    cells: dict[tuple[str, str], Cell] = {}
    seen: dict[tuple[str, str, int], Path] = {}
    for folder in map(Path, folders):
        root = folder / "finetune"
        if not root.is_dir():
            raise FileNotFoundError(f"{folder}: no finetune/ folder there (give the --out of `longattn finetune` or "
                                    "`longattn paper sktformer-table3`)")
        for run_dir in sorted(root.glob("*/*/seed*")):
            status = run_status(run_dir, None)
            if status.state != "finished":
                continue
            results = status.results
            task = str(results.get("task", "")).removeprefix("glue_")
            if not run_dir.parent.name.startswith(f"{task}_"):
                raise ConfigError(f"{run_dir}: its results.json names task {results.get('task')!r}, which is not "
                                  f"the task of its folder {run_dir.parent.name!r}")
            column = f"{task}/{run_dir.parent.name[len(task) + 1:]}"
            mechanism = run_dir.parent.parent.name
            key = (mechanism, column, int(results["seed"]))
            if key in seen:
                raise ConfigError(f"{mechanism} / {column} seed {key[2]} is finished in both {seen[key]} and "
                                  f"{run_dir}: report them separately, or move one away")
            seen[key] = run_dir
            cells.setdefault((mechanism, column), Cell(mechanism, column, f"glue_{task}",
                                                       explicit={"attention": mechanism})).results.append(results)
    for cell in cells.values():
        cell.results.sort(key=lambda r: r["seed"])
    if glue_dir is not None:
        _add_majority_class(list(cells.values()), Path(glue_dir))
    return list(cells.values())


def _add_majority_class(cells: list[Cell], glue_dir: Path) -> None:
    """The majority class's dev scores for the runs without them, from each task's full training labels (a run
    trained on a subset recorded its subset's; the most frequent label is the same on these tasks)."""
    floors: dict[str, dict[str, float] | None] = {}
    for cell in cells:
        task = cell.task.removeprefix("glue_")
        for results in cell.results:
            if "majority_class" in results:
                continue
            if task not in floors:
                floors[task] = majority_class_scores(get_glue_task(task), read_glue(task, "train", glue_dir).labels,
                                                     read_glue(task, "dev", glue_dir).labels)
            results["majority_class"] = floors[task]


def select_best(cells: list[Cell]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (mechanism, task): the search point with the best mean dev score, its seeds' scores and label."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for cell in cells:
        task, point = cell.column.split("/", 1)
        values = cell.values(split="val")  # the paper's metric, in %
        if not values:
            continue
        key = (cell.row, task)
        mean = statistics.mean(values)
        if key not in best or mean > best[key]["mean"]:
            metric = get_glue_task(task).paper_metric
            best[key] = {"mean": mean, "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "values": values, "point": point, "metric": metric,
                         "not_converged": cell.not_converged(), "majority_class": _majority_score(cell, metric)}
    return best


def _majority_score(cell: Cell, metric: str) -> float | None:
    """The paper metric (in %) of always answering the most frequent training label, as the runs recorded it
    (0 for a correlation, STS-B); None for runs from before it was recorded."""
    recorded = [r["majority_class"] for r in cell.results if "majority_class" in r]
    if not recorded:
        return None
    return 0.0 if recorded[0] is None else 100 * statistics.mean(scores[metric] for scores in recorded)


def _shares_above_majority(best: dict[tuple[str, str], dict[str, Any]], name: str, reference: str,
                           measured: list[str]) -> dict[str, float]:
    """Per task: (score - majority) / (reference - majority) in %, where both scores and the majority class's
    are known and the reference beats the majority class."""
    shares = {}
    for task in measured:
        mine, ref = best.get((name, task)), best.get((reference, task))
        if mine is None or ref is None or ref["majority_class"] is None or ref["mean"] <= ref["majority_class"]:
            continue
        shares[task] = 100 * (mine["mean"] - ref["majority_class"]) / (ref["mean"] - ref["majority_class"])
    return shares


def _cell_text(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    text = f"{entry['mean']:.2f} ± {entry['std']:.2f}" if len(entry["values"]) > 1 else f"{entry['mean']:.2f}"
    return text + convergence_mark(len(entry["not_converged"]), len(entry["values"]))


def write_transfer_table(spec: dict[str, Any], cells: list[Cell], out_dir: Path, *, label: str,
                         reference: str | None = None, started: str | None = None) -> dict[str, Any]:
    """``table.md`` in the layout of Table 3 (the papers' rows, then ours), ``results.json`` and ``table3.png``.

    ``reference`` (MiniLM transfer: ``softmax``) adds a table of the share of its score each mechanism keeps.
    """
    best = select_best(cells)
    mechanisms = list(dict.fromkeys(c.row for c in cells))
    measured = [t for t in TABLE3_COLUMNS if any(task == t for _, task in best)]
    headers = ["Model", *(COLUMN_TITLES[t] for t in TABLE3_COLUMNS), "Average", f"Average ({len(measured)} measured)"]
    rows = []
    for name, (title, scores) in PAPER_TABLE3.items():
        paper_measured = statistics.mean(scores[t] for t in measured) if measured else math.nan
        rows.append([f"{title} (paper)", *(f"{scores[t]:.2f}" for t in TABLE3_COLUMNS), f"{PAPER_AVERAGES[name]:.2f}",
                     f"{paper_measured:.2f}"])
    for name in mechanisms:
        entries = [best.get((name, t)) for t in TABLE3_COLUMNS]
        means = [best[(name, t)]["mean"] for t in measured if (name, t) in best]
        average = f"{statistics.mean(means):.2f}" if len(means) == len(measured) and means else "-"
        full = f"{statistics.mean(means):.2f}" if len(means) == len(TABLE3_COLUMNS) else "-"
        rows.append([f"{name} ({label})", *(_cell_text(e) for e in entries), full, average])
    failed = [f"{c.row} / {c.column}: {c.error}" for c in cells if c.error]
    title = spec.get("title", "GLUE fine-tuning")
    text = (f"### {title}\n\nGLUE dev: mean of accuracy and F1 for QQP and MRPC, Matthews correlation for CoLA, "
            "Spearman correlation for STS-B, accuracy elsewhere (MNLI matched); ours: the best search point per "
            "task, mean ± std over seeds.\n\n" + markdown_table(headers, rows) + "\n"
            + convergence_legend(any(entry["not_converged"] for entry in best.values())))
    kept: dict[str, dict[str, float]] = {}
    above: dict[str, dict[str, float]] = {}
    if reference is not None:
        kept = {name: {t: 100 * best[(name, t)]["mean"] / best[(reference, t)]["mean"] for t in measured
                       if (name, t) in best and (reference, t) in best and best[(reference, t)]["mean"] > 0}
                for name in mechanisms}
        above = {name: _shares_above_majority(best, name, reference, measured) for name in mechanisms}
        titles = ["mechanism", *(COLUMN_TITLES[t] for t in measured)]

        def share_rows(shares: dict[str, dict[str, float]]) -> list[list[str]]:
            return [[name, *(f"{shares[name][t]:.1f}%" if t in shares[name] else "-" for t in measured)]
                    for name in mechanisms]

        text += (f"\nShare of the `{reference}` score each mechanism keeps:\n\n"
                 + markdown_table(titles, share_rows(kept)) + "\n")
        if any(above.values()):
            baselines = [f"{COLUMN_TITLES[t]} {best[(reference, t)]['majority_class']:.2f}" for t in measured
                         if best[(reference, t)]["majority_class"] is not None]
            text += (f"\nShare of the `{reference}` score's gain over the majority class, (score - majority) / "
                     f"({reference} - majority): 0% is a model that learned nothing from the text. Always "
                     f"answering the most frequent training label scores {', '.join(baselines)} on dev.\n\n"
                     + markdown_table(titles, share_rows(above)) + "\n")
    text += "\nSearch points chosen:\n\n" + markdown_table(
        ["mechanism", *(COLUMN_TITLES[t] for t in measured)],
        [[name, *(best[(name, t)]["point"] if (name, t) in best else "-" for t in measured)] for name in mechanisms])
    text += "\n" + ("\nFailed runs:\n\n" + "\n".join(f"* {line}" for line in failed) + "\n" if failed else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text)
    summary = {
        "title": title, "columns": list(TABLE3_COLUMNS), "measured": measured,
        "best": [{"mechanism": m, "task": t, **entry} for (m, t), entry in best.items()],
        "kept_percent": kept or None,
        "kept_above_majority_percent": above or None,
        "paper": {PAPER_TABLE3[m][0]: {**PAPER_TABLE3[m][1], "average": PAPER_AVERAGES[m]} for m in PAPER_TABLE3},
        "runs": [{"mechanism": c.row, "task_point": c.column, "val": c.values(split="val"), "error": c.error}
                 for c in cells],
    }
    write_results(out_dir / "results.json", summary, seeds=list(spec.get("finetune", {}).get("seeds", [0])),
                  started=started)
    _plot(best, mechanisms, measured, out_dir / "table3.png", label, with_paper=reference is None)
    print(text)
    return summary


def _plot(best: dict[tuple[str, str], dict[str, Any]], mechanisms: list[str], measured: list[str], path: Path,
          label: str, with_paper: bool) -> None:
    """Grouped bars per task (ours, with the std over seeds), the papers' scores as markers."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    if not measured or not mechanisms:
        return
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(measured), 3.6))
    width = 0.8 / len(mechanisms)
    for i, name in enumerate(mechanisms):
        xs = [j + (i - (len(mechanisms) - 1) / 2) * width for j in range(len(measured))]
        means = [best[(name, t)]["mean"] if (name, t) in best else math.nan for t in measured]
        stds = [best[(name, t)]["std"] if (name, t) in best else 0.0 for t in measured]
        ax.bar(xs, means, width, yerr=stds, capsize=2, label=f"{name} ({label})")
        if with_paper and name in PAPER_TABLE3:
            ax.scatter(xs, [PAPER_TABLE3[name][1][t] for t in measured], marker="_", s=200, color="black",
                       zorder=3, label="paper (Table 3)" if i == 0 else None)
    ax.set_xticks(range(len(measured)), [COLUMN_TITLES[t] for t in measured])
    ax.set_ylabel("GLUE dev score (%)")
    ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_table3(spec: dict[str, Any], out_dir: str | Path, corpus_overrides: list[str], glue_overrides: list[str],
               resume: bool = False, workers: int | None = 1, overwrite: bool = False) -> dict[str, Any]:
    """The whole Table 3 grid: pretrain every mechanism, fine-tune each with the search (``workers`` runs at
    once), write the table."""
    started = now()
    out_dir = Path(out_dir)
    starts = pretrain_grid(spec, out_dir, corpus_overrides, resume, workers, overwrite=overwrite)
    cells = finetune_grid(spec, out_dir, {name: str(folder.resolve()) for name, folder in starts.items()},
                          glue_overrides, resume, workers=workers, overwrite=overwrite)
    return write_transfer_table(spec, cells, out_dir, label=out_dir.name, started=started)
