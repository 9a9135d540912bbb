"""Singularformer's Figure 6 (accuracy against inference speed, memory as circle size) and Figure 7 (accuracy
against r), on the models and results of ``longattn crossval`` (:mod:`longattn.experiment.crossval`).

Figure 6 reads each model's mean test accuracy from the cross-validation's ``results.json`` and measures
the same model (its fold-0 config: sizes, attention, vocabulary) at the dataset's length with the speed
benchmark (:mod:`longattn.bench.speed`, kind ``registered``): inference in eval mode, median process CPU
time on one thread of ``batch`` examples, and the peak memory of one inference forward, each in a fresh
process. Figure 7 cross-validates Singularformer once per r (``attention_options.singular.rank``) on chosen folds.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from longattn.bench.speed import SpeedConfig, run_in_subprocess
from longattn.config import ConfigError
from longattn.experiment.config import load_saved
from longattn.experiment.crossval import LABELS, fold_dir, run_crossval
from longattn.experiment.results import write_results
from longattn.tasks.base import get_task

__all__ = ["measure_models", "plot_accuracy_cost", "plot_rank_sweep", "run_accuracy_cost", "run_rank_sweep"]

SINGULAR_MODEL = "singularformer"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def model_options(run_dir: Path) -> tuple[dict[str, Any], int]:
    """The builder keywords of a trained fold (task inputs, model section, attention) and its max length."""
    config = load_saved(run_dir / "config.yaml")
    task = get_task(config.task)
    data = task.build_data(config)
    kwargs: dict[str, Any] = {**task.model_inputs(config, data), **config.model}
    if config.attention is not None:
        kwargs.update(attention=config.attention, attention_options=config.chosen_attention_options())
    return {k: v for k, v in kwargs.items() if k != "max_len"}, task.model_max_len(config)


def measure_models(runs: Path, dataset: str, models: list[str], batch: int, repeats: int,
                   timeout_s: float) -> list[dict[str, Any]]:
    """Inference speed and peak memory of every model of ``dataset`` at its length (fold 0's config)."""
    rows = []
    for model in models:
        options, length = model_options(fold_dir(runs, dataset, model, 0))
        config = SpeedConfig(target=model, length=length, batch=batch, repeats=repeats, kind="registered",
                             model=options, inference_only=True, reference=False)
        row = run_in_subprocess(config, timeout_s, None)
        rows.append({"dataset": dataset, "model": model, "length": length, "batch": batch, "status": row["status"],
                     "error": row.get("error"), "forward_s": row.get("forward_s"),
                     "forward_wall_s": row.get("forward_wall_s"), "peak_memory_bytes": row.get("peak_memory_bytes"),
                     "parameters": row.get("parameters"),
                     "examples_per_s": batch / row["forward_s"] if row.get("forward_s") else None})
    return rows


def run_accuracy_cost(runs: str | Path, out_dir: str | Path, datasets: list[str] | None = None,
                      models: list[str] | None = None, batch: int = 16, repeats: int = 5,
                      timeout_s: float = 900.0) -> dict[str, Any]:
    """Figure 6 from the cross-validation in ``runs`` (its models, or ``models``): ``figure6.{json,md,png}``
    in ``out_dir``."""
    runs, out = Path(runs), Path(out_dir)
    summary_path = runs / "results.json"
    if not summary_path.is_file():
        raise ConfigError(f"no cross-validation summary {summary_path}; run longattn crossval --out {runs} first")
    try:
        summary = json.loads(summary_path.read_text())
        entries = {(e["dataset"], e["model"]): e for e in summary["entries"] if e.get("test_mean") is not None}
        summary["datasets"], summary["models"]
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{summary_path} is not a cross-validation summary ({type(err).__name__}: {err}); "
                          f"run longattn crossval --out {runs} again to rewrite it") from None
    datasets = datasets or summary["datasets"]
    rows = []
    for dataset in datasets:
        chosen = [m for m in (models or summary["models"]) if (dataset, m) in entries]
        if not chosen:
            raise ConfigError(f"{summary_path} has no finished model on {dataset!r}")
        for row in measure_models(runs, dataset, chosen, batch, repeats, timeout_s):
            entry = entries[dataset, row["model"]]
            row.update(test_mean=entry["test_mean"], test_std=entry["test_std"], folds=len(entry["folds"]))
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    report = {"runs": str(runs), "batch": batch, "repeats": repeats, "clock": "median process CPU time, 1 thread",
              "rows": rows}
    write_results(out / "figure6.json", report)
    (out / "figure6.md").write_text(accuracy_cost_table(rows) + "\n")
    plot_accuracy_cost(rows, out / "figure6.png")
    print(accuracy_cost_table(rows))
    return report


def accuracy_cost_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| dataset | model | N | test accuracy (mean ± std) | inference examples/s | forward ms (batch) | peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['dataset']} | {LABELS.get(r['model'], r['model'])} | {r['length']} | "
                         f"{r['test_mean']:.4f} | {r['status']} | | |")
            continue
        std = "" if r["test_std"] is None else f" ± {r['test_std']:.4f}"
        lines.append(f"| {r['dataset']} | {LABELS.get(r['model'], r['model'])} | {r['length']} | {r['test_mean']:.4f}{std} | "
                     f"{r['examples_per_s']:.0f} | {1000 * r['forward_s']:.1f} ({r['batch']}) | "
                     f"{r['peak_memory_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def plot_accuracy_cost(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Figure 6: per dataset, test accuracy (vertical) against inference speed (horizontal), circle area
    proportional to the peak inference memory."""
    plt = _pyplot()
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.6), squeeze=False)
    ok = [r for r in rows if r["status"] == "ok"]
    largest = max((r["peak_memory_bytes"] for r in ok), default=1) or 1
    for ax, dataset in zip(axes[0], datasets):
        for i, r in enumerate(r for r in ok if r["dataset"] == dataset):
            area = 2500 * r["peak_memory_bytes"] / largest
            ax.scatter(r["examples_per_s"], r["test_mean"], s=max(area, 15), alpha=0.5, color=f"C{i}",
                       edgecolors="k", label=f"{LABELS.get(r['model'], r['model'])} ({r['peak_memory_bytes'] / 2**20:.0f} MiB)")
            ax.annotate(LABELS.get(r["model"], r["model"]), (r["examples_per_s"], r["test_mean"]), fontsize=7,
                        ha="center", va="bottom")
        ax.set_xscale("log")
        ax.set_xlabel("inference speed (examples/s, CPU, 1 thread)")
        ax.set_ylabel("test accuracy (mean over folds)")
        ax.set_title(f"{dataset}: circle area = peak inference memory")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower left", markerscale=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- Figure 7


def run_rank_sweep(dataset: str, ranks: list[int], out_dir: str | Path, *, data_dir: str | None = None,
                   preset: str | None = "cpu", overrides: list[str] | tuple[str, ...] = (), folds: int = 5,
                   only_folds: list[int] | None = None, seed: int = 0, resume: bool = False,
                   overwrite: bool = False) -> dict[str, Any]:
    """Cross-validate Singularformer on ``dataset`` once per r in ``ranks`` (``<out>/r<r>/``, the crossval
    layout) and write ``figure7.{json,md,png}``: test accuracy (mean ± std over the folds run) against r."""
    if not ranks or any(r < 1 for r in ranks):
        raise ConfigError(f"ranks must be positive integers, got {ranks}")
    out = Path(out_dir)
    extra = [f"data.data_dir={data_dir}"] if data_dir else []
    rows = []
    for rank in ranks:
        summary = run_crossval([dataset], [SINGULAR_MODEL], out / f"r{rank}", preset=preset,
                               overrides=[*overrides, *extra, "attention=singular",
                                          f"attention_options.singular.rank={rank}"], folds=folds,
                               only_folds=only_folds, seed=seed, resume=resume, overwrite=overwrite)
        entry = summary["entries"][0]
        rows.append({"rank": rank, "folds": [f["fold"] for f in entry["folds"]],
                     "test_accuracy": [f["test"] for f in entry["folds"]], "test_mean": entry["test_mean"],
                     "test_std": entry["test_std"], "errors": entry["errors"]})
    config = load_saved(fold_dir(out / f"r{ranks[0]}", dataset, SINGULAR_MODEL, rows[0]["folds"][0]) / "config.yaml") \
        if rows[0]["folds"] else None
    head_dim = None if config is None else config.model.get("dim", 384) // config.model.get("heads", 6)
    report = {"dataset": dataset, "preset": preset, "overrides": list(overrides), "folds": folds,
              "only_folds": only_folds, "head_dim": head_dim, "rows": rows,
              "config": None if config is None else asdict(config)}
    write_results(out / "figure7.json", report)
    table = rank_table(report)
    (out / "figure7.md").write_text(table + "\n")
    plot_rank_sweep(report, out / "figure7.png")
    print(table)
    return report


def rank_table(report: dict[str, Any]) -> str:
    lines = [f"{report['dataset']}: Singularformer test accuracy against r (d/m = {report['head_dim']})", "",
             "| r | folds | test accuracy (mean ± std) |", "|---|---|---|"]
    for r in report["rows"]:
        value = "failed" if r["test_mean"] is None else (
            f"{r['test_mean']:.4f}" + ("" if r["test_std"] is None else f" ± {r['test_std']:.4f}"))
        lines.append(f"| {r['rank']} | {','.join(map(str, r['folds']))} | {value} |")
    return "\n".join(lines)


def plot_rank_sweep(report: dict[str, Any], path: str | Path) -> None:
    """Figure 7: test accuracy against r (log scale), the head dim d/m marked."""
    plt = _pyplot()
    done = [r for r in report["rows"] if r["test_mean"] is not None]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.errorbar([r["rank"] for r in done], [r["test_mean"] for r in done],
                yerr=[r["test_std"] or 0.0 for r in done], marker="o", capsize=3)
    if report["head_dim"]:
        ax.axvline(report["head_dim"], color="k", ls="--", lw=1, label=f"r = d/m = {report['head_dim']}")
        ax.legend(fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("r (pseudo tokens)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{report['dataset']}: Singularformer, accuracy against r")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
