"""Singularformer Sec. 5.2 (its Figures 8-10): how alike the attention of two trained models is.

For every test example each model's attention maps are recorded (:func:`longattn.attention.record_attention_maps`,
the mechanisms' own n x n maps, Singularformer's being alpha_U A' alpha_V^T), pooled into A^{*,*} (max over
heads, mean over layers: eqs. 19-20) and compared row by row with the Pearson correlation, averaged over
the real rows (:func:`longattn.analysis.row_pearson`). The models are the folds' best checkpoints of
``longattn crossval`` (``<runs>/<task>/<model>/fold<k>``), all of one fold, so they saw the same data.

Outputs: the distribution of the correlation between Singularformer and each quadratic model per dataset
(Figure 8), the mean correlation among Post-LN, Pre-LN, Realformer and Singularformer as a heat map
(Figure 9), and, on an image task, the examples at the 0, 20, ..., 100 % quantiles of the correlation
with their maps (Figure 10).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from longattn.analysis import pooled_attention, row_pearson
from longattn.attention import record_attention_maps
from longattn.config import ConfigError
from longattn.experiment.config import load_saved
from longattn.experiment.run import build_run_model
from longattn.tasks.base import TaskData, get_task
from longattn.train.checkpoint import load_checkpoint, load_weights

__all__ = ["MAP_MODELS", "FoldModels", "collect_correlations", "load_fold_models", "pooled_maps"]

MAP_MODELS = ("post_ln", "pre_ln", "realformer", "singularformer")
SINGULAR = "singularformer"
QUADRATIC = ("post_ln", "pre_ln", "realformer")
QUANTILES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass
class FoldModels:
    """The best checkpoints of one fold for several models, with the data they were trained on."""

    task_name: str
    fold: int
    models: dict[str, nn.Module]
    data: TaskData
    step: Any
    dirs: dict[str, Path] = field(default_factory=dict)


def load_fold_models(runs: str | Path, task_name: str, models: list[str] | tuple[str, ...], fold: int) -> FoldModels:
    """Rebuild each model's best checkpoint of ``fold`` from ``<runs>/<task>/<model>/fold<k>``; every
    model must have been trained on the same data (same task and data section)."""
    dirs = {m: Path(runs) / task_name / m / f"fold{fold}" for m in models}
    missing = [str(d) for d in dirs.values() if not (d / "config.yaml").is_file() or not (d / "checkpoints" / "best.pt").is_file()]
    if missing:
        raise ConfigError(f"no finished fold (config.yaml and checkpoints/best.pt) in {', '.join(missing)}; "
                          "train them with longattn crossval")
    configs = {m: load_saved(d / "config.yaml") for m, d in dirs.items()}
    first = configs[models[0]]
    for name, config in configs.items():
        if config.task != first.task or config.data != first.data:
            raise ConfigError(f"{name} of fold {fold} was trained on other data than {models[0]} "
                              f"({config.task} {config.data} vs {first.task} {first.data}); maps are compared "
                              "on one test set")
    task = get_task(first.task)
    data = task.build_data(first)
    built = {}
    for name, config in configs.items():
        model = build_run_model(config, task, data)
        best = dirs[name] / "checkpoints" / "best.pt"
        load_weights(model, load_checkpoint(best, map_location="cpu")["model"], best)
        built[name] = model.eval()
    return FoldModels(task_name, fold, built, data, task.step_fn(first, data), dirs)


def pooled_maps(model: nn.Module, step: Any, batch: dict[str, Tensor]) -> Tensor:
    """A^{*,*} [B, N, N] of ``model`` on ``batch`` through the task's own step (whatever its inputs)."""
    with torch.no_grad(), record_attention_maps(model) as maps:
        step(model, batch)
    return pooled_attention([record.weights for record in maps])


def _batches(fold: FoldModels, split: str, batch_size: int, max_examples: int | None):
    dataset = getattr(fold.data, split)
    if dataset is None:
        raise ConfigError(f"task {fold.task_name!r} has no {split} split")
    count = len(dataset) if max_examples is None else min(max_examples, len(dataset))
    for start in range(0, count, batch_size):
        yield start, fold.data.collate([dataset[i] for i in range(start, min(start + batch_size, count))])


def collect_correlations(fold: FoldModels, split: str = "test", batch_size: int = 32,
                         max_examples: int | None = None) -> dict[str, Any]:
    """Per pair of models ``"a|b"``, the attention correlation of every example of ``split`` (NaN where
    no row has a correlation, e.g. one-token documents)."""
    names = list(fold.models)
    pairs = list(combinations(names, 2))
    values: dict[str, list[np.ndarray]] = {f"{a}|{b}": [] for a, b in pairs}
    for _, batch in _batches(fold, split, batch_size, max_examples):
        maps = {name: pooled_maps(model, fold.step, batch) for name, model in fold.models.items()}
        mask = batch["attention_mask"]
        for a, b in pairs:
            values[f"{a}|{b}"].append(row_pearson(maps[a], maps[b], mask).numpy())
    return {pair: np.concatenate(chunks) if chunks else np.zeros(0) for pair, chunks in values.items()}


def mean_matrix(correlations: dict[str, np.ndarray], names: list[str]) -> list[list[float | None]]:
    """The heat map of Figure 9: mean correlation (NaN examples left out) of every pair, 1 on the diagonal."""
    matrix: list[list[float | None]] = []
    for a in names:
        row: list[float | None] = []
        for b in names:
            if a == b:
                row.append(1.0)
                continue
            v = correlations.get(f"{a}|{b}", correlations.get(f"{b}|{a}"))
            row.append(None if v is None or np.isnan(v).all() else float(np.nanmean(v)))
        matrix.append(row)
    return matrix


def summary(values: np.ndarray) -> dict[str, float | int | None]:
    finite = values[np.isfinite(values)]
    if not finite.size:
        return {"examples": int(values.size), "with_value": 0, "mean": None, "median": None, "q25": None, "q75": None}
    return {"examples": int(values.size), "with_value": int(finite.size), "mean": float(finite.mean()),
            "median": float(np.median(finite)), "q25": float(np.quantile(finite, 0.25)),
            "q75": float(np.quantile(finite, 0.75))}


def quantile_examples(values: np.ndarray, quantiles: tuple[float, ...] = QUANTILES) -> list[tuple[float, int]]:
    """(quantile, index of the example whose correlation is at it) for Figure 10's panels."""
    order = np.argsort(np.where(np.isfinite(values), values, np.inf))
    finite = int(np.isfinite(values).sum())
    if not finite:
        raise ValueError("no example has an attention correlation to rank")
    return [(q, int(order[round(q * (finite - 1))])) for q in quantiles]


def example_maps(fold: FoldModels, split: str, index: int, names: list[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One example of ``split`` as a batch of one and each named model's A^{*,*} [N, N] on it."""
    dataset = getattr(fold.data, split)
    batch = fold.data.collate([dataset[index]])
    return batch, {name: pooled_maps(fold.models[name], fold.step, batch)[0].numpy() for name in names}


# ----------------------------------------------------------------------------- figures

_LABELS = {"post_ln": "Post-LN", "pre_ln": "Pre-LN", "realformer": "Realformer", "singularformer": "Singularformer"}


def _label(name: str) -> str:
    return _LABELS.get(name, name)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_distributions(per_task: dict[str, dict[str, np.ndarray]], path: str | Path, against: str = SINGULAR) -> None:
    """Figure 8: per dataset, the distribution of the attention correlation of ``against`` with each other
    model (violins; NaN examples left out)."""
    plt = _pyplot()
    tasks = list(per_task)
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        labels, data = [], []
        for pair, values in per_task[task].items():
            a, b = pair.split("|")
            if against in (a, b):
                finite = values[np.isfinite(values)]
                if finite.size:
                    labels.append(_label(b if a == against else a))
                    data.append(finite)
        if data:
            ax.violinplot(data, showmedians=True)
            ax.set_xticks(range(1, len(labels) + 1), labels)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_ylim(-1, 1)
        ax.set_title(f"{task}: {_label(against)} vs")
        ax.set_ylabel("attention correlation (row-wise Pearson)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heatmap(matrix: list[list[float | None]], names: list[str], path: str | Path, title: str) -> None:
    """Figure 9: the mean attention correlation among the models."""
    plt = _pyplot()
    values = np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    image = ax.imshow(values, vmin=-1, vmax=1, cmap="RdBu_r")
    labels = [_label(n) for n in names]
    ax.set_xticks(range(len(names)), labels, rotation=30, ha="right")
    ax.set_yticks(range(len(names)), labels)
    for i in range(len(names)):
        for j in range(len(names)):
            if np.isfinite(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.3f}", ha="center", va="center", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def patches_to_image(patches: np.ndarray, patch: int = 2) -> np.ndarray:
    """[T, patch*patch*3] patch vectors, row-major patches of (dy, dx, channel) values, -> [H, W, 3] image
    (the inverse of :func:`longattn.data.image.to_patches`)."""
    grid = int(round(np.sqrt(patches.shape[0])))
    if grid * grid != patches.shape[0] or patches.shape[1] != patch * patch * 3:
        raise ValueError(f"expected [{grid}^2, {patch * patch * 3}] patch vectors, got {list(patches.shape)}")
    blocks = patches.reshape(grid, grid, patch, patch, 3)  # row, col, dy, dx, channel
    return blocks.transpose(0, 2, 1, 3, 4).reshape(grid * patch, grid * patch, 3)


def plot_image_examples(examples: list[dict[str, Any]], names: list[str], path: str | Path) -> None:
    """Figure 10: per example (sorted by correlation), the image, each model's A^{*,*} and the attention each
    patch receives (column mean of A^{*,*}) laid out on the image grid."""
    plt = _pyplot()
    columns = 1 + 2 * len(names)
    fig, axes = plt.subplots(len(examples), columns, figsize=(2.1 * columns, 2.2 * len(examples)), squeeze=False)
    for row, example in zip(axes, examples):
        row[0].imshow(np.clip(example["image"], 0, 1))
        row[0].set_title(f"q={example['quantile']:.0%}  r={example['correlation']:.2f}", fontsize=8)
        for k, name in enumerate(names):
            full = example["maps"][name]
            row[1 + k].imshow(full, cmap="viridis")
            row[1 + k].set_title(f"{_label(name)} A**", fontsize=8)
            grid = int(round(np.sqrt(full.shape[0])))
            row[1 + len(names) + k].imshow(full.mean(0).reshape(grid, grid), cmap="magma")
            row[1 + len(names) + k].set_title(f"{_label(name)}: received", fontsize=8)
        for ax in row:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the analysis


def run_attention_correlation(runs: str | Path, tasks: list[str], out_dir: str | Path, *,
                              models: list[str] | tuple[str, ...] = MAP_MODELS, fold: int = 0, split: str = "test",
                              batch_size: int = 32, max_examples: int | None = None,
                              image_pair: tuple[str, str] = ("post_ln", SINGULAR)) -> dict[str, Any]:
    """Figures 8-10 for ``tasks`` from the fold's best checkpoints under ``runs``; writes
    ``attention_correlation.{json,md}``, ``figure8.png``, ``figure9_<task>.png`` and, for image tasks,
    ``figure10_<task>.png`` into ``out_dir``."""
    from longattn.experiment.results import write_results

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models = list(models)
    report: dict[str, Any] = {"runs": str(runs), "fold": fold, "split": split, "models": models, "tasks": {}}
    per_task: dict[str, dict[str, np.ndarray]] = {}
    lines = []
    for task_name in tasks:
        fold_models = load_fold_models(runs, task_name, models, fold)
        correlations = collect_correlations(fold_models, split, batch_size, max_examples)
        per_task[task_name] = correlations
        matrix = mean_matrix(correlations, models)
        entry: dict[str, Any] = {"pairs": {pair: summary(v) for pair, v in correlations.items()},
                                 "mean_matrix": matrix,
                                 "per_example": {pair: [None if not np.isfinite(x) else float(x) for x in v]
                                                 for pair, v in correlations.items()}}
        plot_heatmap(matrix, models, out / f"figure9_{task_name}.png",
                     f"{task_name}: mean attention correlation ({split}, fold {fold})")
        first = getattr(fold_models.data, split)[0]
        pair = f"{image_pair[0]}|{image_pair[1]}"
        if "patches" in first and pair in correlations:
            examples = []
            for quantile, index in quantile_examples(correlations[pair]):
                batch, maps = example_maps(fold_models, split, index, list(image_pair))
                examples.append({"quantile": quantile, "index": index, "correlation": float(correlations[pair][index]),
                                 "image": patches_to_image(batch["patches"][0].numpy()), "maps": maps})
            plot_image_examples(examples, list(image_pair), out / f"figure10_{task_name}.png")
            entry["figure10_examples"] = [{k: e[k] for k in ("quantile", "index", "correlation")} for e in examples]
        report["tasks"][task_name] = entry
        lines += [f"### {task_name} ({split} set, fold {fold}): attention correlation per example", "",
                  "| pair | examples | with a value | mean | median | 25 % | 75 % |", "|---|---|---|---|---|---|---|"]
        for pair_name, s in entry["pairs"].items():
            a, b = pair_name.split("|")
            cells = ["-" if s[k] is None else f"{s[k]:.3f}" for k in ("mean", "median", "q25", "q75")]
            lines.append(f"| {_label(a)} / {_label(b)} | {s['examples']} | {s['with_value']} | " + " | ".join(cells) + " |")
        lines += ["", "Mean correlation (Figure 9):", "", "| | " + " | ".join(_label(m) for m in models) + " |",
                  "|---|" + "---|" * len(models)]
        lines += [f"| {_label(a)} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in row) + " |"
                  for a, row in zip(models, matrix)]
        lines.append("")
    plot_distributions(per_task, out / "figure8.png")
    write_results(out / "attention_correlation.json", report)
    (out / "attention_correlation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report
