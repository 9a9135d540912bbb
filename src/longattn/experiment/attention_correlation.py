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
from longattn.train.checkpoint import load_checkpoint

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
        model.load_state_dict(load_checkpoint(dirs[name] / "checkpoints" / "best.pt", map_location="cpu")["model"])
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
