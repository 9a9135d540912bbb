"""Singularformer's evaluation protocol (Wu et al., IJCAI 2023, section 4.2) and its Table 4.

"We conduct 5-fold cross-validation in all datasets, that is, the training set is randomly divided into 5
parts, and one of them is selected as the validation set at each time to retain the model with the
optimal number of training epochs. Then the retained models make predictions on test set."

:func:`run_crossval` trains every (dataset, model, fold) as an ordinary run of
:func:`longattn.experiment.run.run` (through the grid runner, so a failing model is recorded and the
others go on) into::

    <out>/<dataset>/<model>/fold<k>/config.yaml               the resolved config (load_saved)
    <out>/<dataset>/<model>/fold<k>/checkpoints/best.pt       weights of the fold's best validation epoch
    <out>/<dataset>/<model>/fold<k>/results.json              val (best epoch) and test metrics, history, times
    <out>/results.json                                        every fold's numbers, mean ± std, the paper's
    <out>/table.md                                            Table 4's layout, ours beside the paper's; each
                                                              model minus Post-LN paired by fold; each fold's
                                                              cost (CPU and wall time, best step, memory)
    <out>/table4.png                                          test accuracy per dataset, ours and the paper's

With ``resume=True`` finished folds are reused and an interrupted fold continues from its last checkpoint;
``overwrite=True`` trains them again (without either, folds already in ``out`` are refused).
Folds of one dataset run fold by fold, every model in turn, so each fold's data are built once.
The spread is the sample standard deviation over folds (the paper does not say which).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from longattn.config import ConfigError
from longattn.experiment.grid import (Cell, collect_finished, convergence_legend, convergence_mark, markdown_table,
                                      run_cells)
from longattn.experiment.results import now, write_results
from longattn.experiment.stats import (CONFIDENCE, NOT_SIGNIFICANT, PairedDifference, format_difference,
                                       paired_difference)
from longattn.experiment.stats import summarize as summarize_values
from longattn.models.doc_classifier import TABLE4_MODELS
from longattn.models.registry import model_names
from longattn.tasks.base import get_task
from longattn.train.loop import run_convergence
from longattn.utils import duration

__all__ = ["PAPER_TABLE4", "TABLE4_DATASETS", "cost_markdown", "differences_markdown", "run_crossval",
           "table4_markdown"]

# Columns of Table 4: our task names, the paper's headers.
TABLE4_DATASETS = {"r8": "R8", "bbc": "BBC", "20news": "20NG", "imdb": "IMDb", "mimic3_50": "MIMIC-III 50",
                   "scope95": "SCoPe95", "scope40": "SCoPe40", "cifar100": "CIFAR 100"}
QUADRATIC = ("post_ln", "pre_ln", "realformer")
LABELS = {"post_ln": "Post-LN Transformer", "pre_ln": "Pre-LN Transformer", "realformer": "Realformer",
          "bigbird": "BigBird", "linformer": "Linformer (k = 256)", "flash": "FLASH (g = 256)",
          "singularformer": "Singularformer"}

# Table 4 of the paper: test accuracy, mean and standard deviation over the 5 folds.
_PAPER_ROWS = {
    "post_ln": "0.97963 0.003 0.97545 0.006 0.87374 0.001 0.87750 0.002 0.42655 0.012 0.66923 0.004 0.29350 0.005 0.53128 0.009",
    "pre_ln": "0.97844 0.003 0.97635 0.003 0.86660 0.003 0.87627 0.005 0.40886 0.000 0.68865 0.004 0.31334 0.006 0.52128 0.008",
    "realformer": "0.97899 0.003 0.97635 0.003 0.87642 0.003 0.88538 0.001 0.42376 0.009 0.64721 0.003 0.25889 0.006 0.52070 0.008",
    "bigbird": "0.97917 0.003 0.97665 0.004 0.86155 0.004 0.87618 0.003 0.37672 0.008 0.66864 0.004 0.28802 0.006 0.46790 0.015",
    "linformer": "0.97953 0.001 0.96916 0.005 0.86803 0.002 0.87637 0.005 0.40737 0.006 0.56476 0.003 0.23275 0.003 0.43428 0.007",
    "flash": "0.97798 0.002 0.97814 0.003 0.86880 0.003 0.87731 0.005 0.41524 0.003 0.67562 0.006 0.30809 0.003 0.35194 0.007",
    "singularformer": "0.98145 0.001 0.97754 0.003 0.87756 0.003 0.88665 0.005 0.43942 0.005 0.65674 0.005 0.30886 0.006 0.52230 0.009",
}


def _paper_table() -> dict[str, dict[str, tuple[float, float]]]:
    table = {}
    for model, row in _PAPER_ROWS.items():
        values = [float(v) for v in row.split()]
        table[model] = {dataset: (values[2 * i], values[2 * i + 1]) for i, dataset in enumerate(TABLE4_DATASETS)}
    return table


PAPER_TABLE4: dict[str, dict[str, tuple[float, float]]] = _paper_table()


def fold_dir(out_dir: Path, dataset: str, model: str, fold: int) -> Path:
    return out_dir / dataset / model / f"fold{fold}"


def run_crossval(datasets: list[str], models: list[str], out_dir: str | Path, *, preset: str | None = "cpu",
                 config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                 folds: int = 5, only_folds: list[int] | None = None, seed: int = 0,
                 resume: bool = False, report_only: bool = False, workers: int | None = 1,
                 overwrite: bool = False) -> dict[str, Any]:
    """Cross-validate every model on every dataset (layout in the module docstring); returns the summary.

    ``only_folds`` trains a subset of the ``folds`` folds (e.g. to spread them over machines or commands).
    ``report_only`` trains nothing. Either way the table and summary count every fold finished in ``out_dir``,
    whichever invocation trained it (a missing fold is counted as not done, "k/5 folds"). ``workers`` folds
    train at once.
    """
    started = now()
    out_dir = Path(out_dir)
    for dataset in datasets:
        get_task(dataset)  # unknown names fail before anything trains
    valid = model_names("classifier")
    unknown = [m for m in models if m not in valid]
    if unknown:
        raise ConfigError(f"unknown model(s) {unknown}; valid: {', '.join(valid)}")
    chosen = sorted(set(only_folds)) if only_folds is not None else list(range(folds))
    if not chosen or chosen[0] < 0 or chosen[-1] >= folds:
        raise ConfigError(f"folds to train must lie in [0, {folds}), got {only_folds}")
    cells, folders, to_train = [], {}, []
    for dataset in datasets:
        for fold in range(folds):  # fold-major: the models of one fold share its built data
            for model in models:
                cell = Cell(model, dataset, dataset, preset, config_file,
                            [*overrides, f"data.fold={fold}", f"data.num_folds={folds}"], {"model_name": model})
                cells.append(cell)
                folders[id(cell)] = fold_dir(out_dir, dataset, model, fold)
                if fold in chosen and not report_only:
                    to_train.append(cell)
    if to_train:
        run_cells(to_train, [seed], out_dir, run_dir=lambda cell, _seed: folders[id(cell)], resume=resume,
                  overwrite=overwrite, plots=False, workers=workers)
    trained = {id(cell) for cell in to_train}
    for cell in cells:  # the folds this invocation did not train: those finished earlier count too
        if id(cell) not in trained:
            collect_finished(cell, folders[id(cell)])
    summary = summarize(cells, folders, datasets, models, folds, seed)
    summary.update(preset=str(preset) if preset else None, overrides=list(overrides))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_results(out_dir / "results.json", summary, seeds=[seed], started=started)
    text = "\n".join(part for part in (table4_markdown(summary), differences_markdown(summary),
                                        cost_markdown(summary)) if part)
    (out_dir / "table.md").write_text(text)
    plot_table4(summary, out_dir / "table4.png")
    print(text)
    print(f"wrote {out_dir / 'table.md'}, {out_dir / 'results.json'}, {out_dir / 'table4.png'}")
    return summary


def summarize(cells: list[Cell], folders: dict[int, Path], datasets: list[str], models: list[str], folds: int,
              seed: int) -> dict[str, Any]:
    """Per (dataset, model): each fold's val and test score (the task's selection metric: accuracy, or
    micro-F1 for MIMIC-III 50) and times, and the mean and std of the test score over folds."""
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for cell in cells:
        model = cell.explicit["model_name"]
        metric = get_task(cell.task).select_metric  # accuracy; MIMIC-III 50: micro-F1
        entry = entries.setdefault((cell.task, model), {"dataset": cell.task, "model": model, "metric": metric,
                                                         "folds": [], "errors": []})
        fold = int(folders[id(cell)].name.removeprefix("fold"))
        if cell.error:
            entry["errors"].append({"fold": fold, "error": cell.error})
        for result in cell.results:
            entry["folds"].append({
                "fold": fold, "dir": str(folders[id(cell)]),
                "val": (result.get("val") or {}).get(metric),
                "test": (result.get("test") or {}).get(metric),
                "best_step": result.get("best_step"), "steps": result.get("steps"),
                "train_time_s": result.get("train_time_s"), "cpu_time_s": result.get("cpu_time_s"),
                "parameters": result.get("parameters"),
                "peak_memory_mb": result.get("peak_memory_mb"),
                "convergence": run_convergence(result, metric),
            })
    for entry in entries.values():
        entry["folds"].sort(key=lambda f: f["fold"])
        entry["not_converged"] = [f["fold"] for f in entry["folds"]
                                  if f["convergence"] is not None and not f["convergence"]["converged"]]
        spread = summarize_values([f["test"] for f in entry["folds"] if f["test"] is not None])
        entry["test_mean"] = None if math.isnan(spread.mean) else spread.mean
        entry["test_std"] = None if math.isnan(spread.std) else spread.std
        paper = PAPER_TABLE4.get(entry["model"], {}).get(entry["dataset"])
        entry["paper"] = {"mean": paper[0], "std": paper[1]} if paper else None
    reference = next((m for m in (*QUADRATIC, *models) if m in models), None)
    for entry in entries.values():
        entry["difference"] = _fold_difference(entry, entries.get((entry["dataset"], reference)))
    return {"protocol": f"{folds}-fold cross-validation on the training set (fold seed from data.fold_seed); "
                        "each fold keeps its best validation epoch; test score (entry 'metric') mean ± sample std over folds",
            "num_folds": folds, "seed": seed, "datasets": datasets, "models": models, "reference": reference,
            "entries": list(entries.values())}


def _fold_difference(entry: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any] | None:
    """The test score minus the reference model's, paired by fold (the same training, validation and test
    documents), over the folds both finished; None for the reference itself or with fewer than 2 shared folds."""
    if reference is None or reference is entry:
        return None
    scores = [{f["fold"]: f["test"] for f in e["folds"] if f["test"] is not None} for e in (entry, reference)]
    difference = paired_difference(*scores)
    return difference.as_dict() if difference is not None and difference.n >= 2 else None


def differences_markdown(summary: dict[str, Any]) -> str:
    """Each model's test score minus the reference model's (a quadratic one: Post-LN in Table 4), paired by fold."""
    reference, datasets = summary.get("reference"), summary["datasets"]
    by_key = {(e["dataset"], e["model"]): e for e in summary["entries"]}
    rows = []
    for model in summary["models"]:
        if model == reference:
            continue
        cells = []
        for dataset in datasets:
            found = (by_key.get((dataset, model)) or {}).get("difference")
            cells.append("-" if found is None
                         else f"{format_difference(PairedDifference.from_dict(found), 4)} ({found['n']} folds)")
        rows.append([LABELS.get(model, model), *cells])
    if reference is None or not rows:
        return ""
    label = LABELS.get(reference, reference)
    return (f"### Test score minus {label}'s, paired by fold\n\n"
            + markdown_table(["Methods", *(TABLE4_DATASETS.get(d, d) for d in datasets)], rows)
            + f"\n\nOver the folds both models finished (the same training, validation and test documents), with "
              f"its {100 * CONFIDENCE:g}% Student t interval; {NOT_SIGNIFICANT} = the interval contains 0; - = fewer "
              "than 2 shared folds.\n")


def _format(mean: float | None, std: float | None, count: int, folds: int, not_converged: int = 0) -> str:
    if mean is None:
        return "-"
    text = f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "")
    return text + (f" ({count}/{folds} folds)" if count != folds else "") + convergence_mark(not_converged, count)


def table4_markdown(summary: dict[str, Any]) -> str:
    """Table 4's layout (quadratic, then linear Transformers; one column per dataset): ours, then the paper's."""
    folds = summary["num_folds"]
    by_key = {(e["dataset"], e["model"]): e for e in summary["entries"]}
    datasets = summary["datasets"]
    headers = ["Methods", *(f"{TABLE4_DATASETS.get(d, d)} (ours)" for d in datasets),
               *(f"{TABLE4_DATASETS.get(d, d)} (paper)" for d in datasets)]
    rows = []
    for group, members in (("quadratic Transformers", [m for m in summary["models"] if m in QUADRATIC]),
                           ("linear Transformers", [m for m in summary["models"] if m not in QUADRATIC])):
        if not members:
            continue
        rows.append([f"*{group}*", *([""] * (2 * len(datasets)))])
        for model in members:
            ours, paper = [], []
            for dataset in datasets:
                entry = by_key.get((dataset, model))
                if entry is None or (entry["test_mean"] is None and entry["errors"]):
                    ours.append("failed" if entry else "-")
                else:
                    ours.append(_format(entry["test_mean"], entry["test_std"], len(entry["folds"]), folds,
                                        len(entry["not_converged"])))
                reference = PAPER_TABLE4.get(model, {}).get(dataset)
                paper.append(f"{reference[0]:.5f} ± {reference[1]:.3f}" if reference else "-")
            rows.append([LABELS.get(model, model), *ours, *paper])
    notes = sorted({f"{TABLE4_DATASETS.get(e['dataset'], e['dataset'])}: test {e['metric']}" for e in summary["entries"]
                    if e["metric"] != "accuracy"})
    legend = convergence_legend(any(e["not_converged"] for e in summary["entries"]), "folds")
    return (f"### Test accuracy, mean ± std over {folds}-fold cross-validation (Singularformer Table 4 layout)\n\n"
            + markdown_table(headers, rows) + "\n" + legend + "".join(f"\n{note} (not accuracy)\n" for note in notes))


def _spread(values: list[float]) -> str:
    """``27 min 10 s`` for one value, else the median and the range: ``27 min 10 s (26 min 37 s-32 min 32 s)``."""
    ordered = sorted(values)
    middle = statistics.median(ordered)
    if len(ordered) == 1:
        return duration(middle)
    return f"{duration(middle)} ({duration(ordered[0])}-{duration(ordered[-1])})"


def cost_markdown(summary: dict[str, Any]) -> str:
    """What each finished fold cost: process CPU time (all threads) of training and validation, the training's
    wall time, where its best validation fell among its steps, and the peak memory; one row per (model, dataset)."""
    rows = []
    for entry in summary["entries"]:
        folds = entry["folds"]
        if not folds:
            continue
        cpu = [f["cpu_time_s"] for f in folds if f.get("cpu_time_s") is not None]
        wall = [f["train_time_s"] for f in folds if f.get("train_time_s") is not None]
        memory = [f["peak_memory_mb"] for f in folds if f.get("peak_memory_mb") is not None]
        best = ", ".join(f"{f['best_step']}/{f['steps']}" for f in folds)
        dataset = TABLE4_DATASETS.get(entry["dataset"], entry["dataset"])
        rows.append([LABELS.get(entry["model"], entry["model"]), dataset, ", ".join(str(f["fold"]) for f in folds),
                     _spread(cpu) if cpu else "-",
                     _spread(wall) if wall else "-", best, f"{max(memory):,.0f} MB" if memory else "-"])
    headers = ["Methods", "dataset", "folds done", "CPU time per fold", "training wall time per fold",
               "best step / steps", "peak memory"]
    return ("### Cost per fold (median and range over the folds done)\n\n" + markdown_table(headers, rows) +
            "\n\nCPU time: the process's (all threads) for training and validation, not the test split; wall time: "
            "training alone, which grows when the core is shared.\n")


def plot_table4(summary: dict[str, Any], path: Path) -> None:
    """One panel per dataset: our mean ± std test accuracy per model (bars) and the paper's (black marks)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    datasets, models = summary["datasets"], summary["models"]
    by_key = {(e["dataset"], e["model"]): e for e in summary["entries"]}
    fig, axes = plt.subplots(1, len(datasets), figsize=(1.2 + 0.9 * len(models) * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        positions = range(len(models))
        means = [(by_key.get((dataset, m)) or {}).get("test_mean") or 0.0 for m in models]
        stds = [(by_key.get((dataset, m)) or {}).get("test_std") or 0.0 for m in models]
        ax.bar(positions, means, yerr=stds, color=[f"C{i}" for i in positions], capsize=3, label="ours")
        paper = [PAPER_TABLE4.get(m, {}).get(dataset) for m in models]
        ax.errorbar([i for i, p in zip(positions, paper) if p], [p[0] for p in paper if p],
                    yerr=[p[1] for p in paper if p], fmt="_", color="black", markersize=14, label="paper")
        shown = [v for v in means if v > 0] + [p[0] for p in paper if p]
        if shown:
            ax.set_ylim(max(0.0, min(shown) - 0.05), min(1.0, max(shown) + 0.02))
        ax.set_xticks(list(positions), [LABELS.get(m, m) for m in models], rotation=45, ha="right", fontsize="small")
        ax.set(title=TABLE4_DATASETS.get(dataset, dataset), ylabel="test accuracy")
        ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table4_models() -> list[str]:
    """The seven models of Table 4, in the paper's row order."""
    return list(TABLE4_MODELS)
