"""Evaluation metrics by name: GLUE's official metrics, accuracy, F1, MSE/MAE, multi-label scores.

Every metric is computed by scikit-learn or SciPy (the implementations GLUE's own scorer and Hugging
Face's ``glue`` metric use), never by hand; this module only validates the inputs and names them.

>>> from longattn import metrics
>>> metrics.compute("mcc", [1, 0, 1, 1], [1, 0, 0, 1])
0.5773502691896258
>>> metrics.direction("mse")
'min'

Each registered metric has a ``direction``: ``"max"`` when larger is better, ``"min"`` otherwise, so
model selection can pick the best epoch of any metric. Binary F1 scores the positive class 1 (MRPC's
"paraphrase", QQP's "duplicate"), as GLUE does. ``acc_and_f1`` and ``pearson_and_spearman`` are the
means GLUE's leaderboard and the SKTformer / S^3 papers report for MRPC/QQP and STS-B.

Multi-label targets (MIMIC-III 50) are 0/1 indicator matrices [N, C]: ``accuracy`` is then
scikit-learn's subset accuracy (every label of a document right), ``micro_f1`` / ``macro_f1`` the usual
per-label F1 averages. Pearson/Spearman of a constant vector are undefined and come back as NaN
(SciPy's value), without SciPy's warning.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import numpy as np

from .registry import Registry

__all__ = ["METRICS", "MetricError", "compute", "compute_all", "direction", "better", "names"]


class MetricError(ValueError):
    """Predictions and references that a metric cannot score (shapes, NaN, empty, unknown name)."""


METRICS: Registry[Callable[[np.ndarray, np.ndarray], float]] = Registry("metric", error=MetricError)


def _array(values: Any, what: str) -> np.ndarray:
    if hasattr(values, "detach"):  # torch tensors without importing torch here
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise MetricError(f"{what} must be numbers, got dtype {array.dtype}")
    if array.size and np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        raise MetricError(f"{what} contain NaN or infinite values")
    return array


def _pair(predictions: Any, references: Any) -> tuple[np.ndarray, np.ndarray]:
    preds, refs = _array(predictions, "predictions"), _array(references, "references")
    if preds.shape != refs.shape:
        raise MetricError(f"predictions {preds.shape} and references {refs.shape} differ in shape")
    if preds.ndim not in (1, 2) or len(preds) == 0:
        raise MetricError(f"expected non-empty [N] (or multi-label [N, C]) arrays, got shape {preds.shape}")
    return preds, refs


def _labels(preds: np.ndarray, refs: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Class ids for a classification metric: integral values (floats like 1.0 are accepted)."""
    for name, array in (("predictions", preds), ("references", refs)):
        if np.issubdtype(array.dtype, np.floating) and not np.array_equal(array, np.round(array)):
            raise MetricError(f"{metric} needs class ids, but the {name} are not integers "
                              "(take argmax of the logits first)")
    return preds.astype(np.int64), refs.astype(np.int64)


def _vectors(preds: np.ndarray, refs: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    if preds.ndim != 1:
        raise MetricError(f"{metric} needs 1-D arrays, got shape {preds.shape}")
    return preds.astype(np.float64), refs.astype(np.float64)


@METRICS.register("accuracy", direction="max")
def accuracy(predictions: Any, references: Any) -> float:
    """Fraction of exact matches (subset accuracy for multi-label indicator matrices)."""
    from sklearn.metrics import accuracy_score

    preds, refs = _labels(*_pair(predictions, references), "accuracy")
    return float(accuracy_score(refs, preds))


@METRICS.register("f1", direction="max")
def f1(predictions: Any, references: Any) -> float:
    """Binary F1 of the positive class 1 (GLUE's MRPC / QQP F1)."""
    from sklearn.metrics import f1_score

    preds, refs = _labels(*_pair(predictions, references), "f1")
    if preds.ndim != 1 or not set(np.unique(np.concatenate([preds, refs]))) <= {0, 1}:
        raise MetricError("f1 is binary: predictions and references must be 0/1 vectors "
                          "(use micro_f1 or macro_f1 for more classes or multi-label)")
    return float(f1_score(refs, preds, pos_label=1, average="binary", zero_division=0.0))


def _averaged_f1(predictions: Any, references: Any, average: str) -> float:
    from sklearn.metrics import f1_score

    preds, refs = _labels(*_pair(predictions, references), f"{average}_f1")
    return float(f1_score(refs, preds, average=average, zero_division=0.0))


@METRICS.register("micro_f1", direction="max")
def micro_f1(predictions: Any, references: Any) -> float:
    """F1 over all (example, label) decisions pooled: multi-class or multi-label indicator matrices."""
    return _averaged_f1(predictions, references, "micro")


@METRICS.register("macro_f1", direction="max")
def macro_f1(predictions: Any, references: Any) -> float:
    """Unweighted mean of the per-class (or per-label) F1."""
    return _averaged_f1(predictions, references, "macro")


@METRICS.register("acc_and_f1", direction="max")
def acc_and_f1(predictions: Any, references: Any) -> float:
    """(accuracy + F1) / 2: the score SKTformer / S^3 Table 3 reports for MRPC and QQP."""
    return (accuracy(predictions, references) + f1(predictions, references)) / 2.0


@METRICS.register("mcc", direction="max")
def mcc(predictions: Any, references: Any) -> float:
    """Matthews correlation coefficient (CoLA)."""
    from sklearn.metrics import matthews_corrcoef

    preds, refs = _labels(*_pair(predictions, references), "mcc")
    if preds.ndim != 1:
        raise MetricError(f"mcc needs 1-D class ids, got shape {preds.shape}")
    return float(matthews_corrcoef(refs, preds))


def _correlation(kind: str, predictions: Any, references: Any) -> float:
    from scipy import stats

    preds, refs = _vectors(*_pair(predictions, references), kind)
    if len(preds) < 2:
        raise MetricError(f"{kind} needs at least 2 examples, got {len(preds)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)  # constant input: NaN, documented
        result = stats.pearsonr(preds, refs) if kind == "pearson" else stats.spearmanr(preds, refs)
    return float(result[0])


@METRICS.register("pearson", direction="max")
def pearson(predictions: Any, references: Any) -> float:
    """Pearson correlation (STS-B)."""
    return _correlation("pearson", predictions, references)


@METRICS.register("spearman", direction="max")
def spearman(predictions: Any, references: Any) -> float:
    """Spearman rank correlation (STS-B; the score SKTformer / S^3 Table 3 reports)."""
    return _correlation("spearman", predictions, references)


@METRICS.register("pearson_and_spearman", direction="max")
def pearson_and_spearman(predictions: Any, references: Any) -> float:
    """(Pearson + Spearman) / 2: GLUE's combined STS-B score."""
    return (pearson(predictions, references) + spearman(predictions, references)) / 2.0


@METRICS.register("mse", direction="min")
def mse(predictions: Any, references: Any) -> float:
    """Mean squared error."""
    from sklearn.metrics import mean_squared_error

    preds, refs = _vectors(*_pair(predictions, references), "mse")
    return float(mean_squared_error(refs, preds))


@METRICS.register("mae", direction="min")
def mae(predictions: Any, references: Any) -> float:
    """Mean absolute error."""
    from sklearn.metrics import mean_absolute_error

    preds, refs = _vectors(*_pair(predictions, references), "mae")
    return float(mean_absolute_error(refs, preds))


def names() -> list[str]:
    """Every registered metric name."""
    return METRICS.names()


def direction(name: str) -> str:
    """``"max"`` if larger values of metric `name` are better, ``"min"`` otherwise."""
    return METRICS.metadata(name)["direction"]


def better(name: str, new: float, old: float | None) -> bool:
    """Whether score `new` improves on `old` (None: nothing yet) for metric `name`; NaN never does."""
    if new != new:  # NaN
        return False
    if old is None or old != old:
        return True
    return new > old if direction(name) == "max" else new < old


def compute(name: str, predictions: Any, references: Any) -> float:
    """Metric `name` of predictions against references (arrays, lists or tensors)."""
    return METRICS.get(name)(predictions, references)


def compute_all(metric_names: Sequence[str], predictions: Any, references: Any) -> dict[str, float]:
    """``{name: value}`` for several metrics of the same predictions."""
    return {name: compute(name, predictions, references) for name in metric_names}
