import math

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn import metrics as skm

from longattn import metrics
from longattn.registry import Registry

# a small binary problem with every cell of the confusion matrix filled: TP=3, TN=2, FP=1, FN=2
REFS = np.array([1, 1, 1, 1, 1, 0, 0, 0])
PREDS = np.array([1, 1, 1, 0, 0, 0, 0, 1])


def test_binary_metrics_match_sklearn_and_closed_forms():
    assert metrics.compute("accuracy", PREDS, REFS) == skm.accuracy_score(REFS, PREDS) == 5 / 8
    assert metrics.compute("f1", PREDS, REFS) == pytest.approx(skm.f1_score(REFS, PREDS))
    assert metrics.compute("f1", PREDS, REFS) == pytest.approx(2 * 3 / (2 * 3 + 1 + 2))
    tp, tn, fp, fn = 3, 2, 1, 2
    closed_mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert metrics.compute("mcc", PREDS, REFS) == pytest.approx(skm.matthews_corrcoef(REFS, PREDS))
    assert metrics.compute("mcc", PREDS, REFS) == pytest.approx(closed_mcc)
    assert metrics.compute("acc_and_f1", PREDS, REFS) == pytest.approx((5 / 8 + 6 / 9) / 2)
    # F1 scores the positive class 1: swapping the classes changes it
    assert metrics.compute("f1", 1 - PREDS, 1 - REFS) == pytest.approx(2 * 2 / (2 * 2 + 2 + 1))


def test_correlations_and_errors_match_scipy_and_sklearn():
    refs = np.array([0.0, 1.2, 2.5, 3.1, 4.0, 5.0])
    preds = np.array([0.3, 0.9, 2.0, 3.9, 3.8, 4.4])
    assert metrics.compute("pearson", preds, refs) == pytest.approx(stats.pearsonr(preds, refs)[0])
    assert metrics.compute("spearman", preds, refs) == pytest.approx(stats.spearmanr(preds, refs)[0])
    assert metrics.compute("pearson_and_spearman", preds, refs) == pytest.approx(
        (stats.pearsonr(preds, refs)[0] + stats.spearmanr(preds, refs)[0]) / 2)
    assert metrics.compute("mse", preds, refs) == pytest.approx(skm.mean_squared_error(refs, preds))
    assert metrics.compute("mae", preds, refs) == pytest.approx(np.abs(preds - refs).mean())
    # a monotone but non-linear relation: Spearman is exactly 1, Pearson is not
    x = np.arange(1.0, 8.0)
    assert metrics.compute("spearman", x ** 3, x) == pytest.approx(1.0)
    assert metrics.compute("pearson", x ** 3, x) < 0.99
    assert math.isnan(metrics.compute("pearson", np.ones(4), x[:4]))  # undefined, no warning raised


def test_multiclass_and_multilabel():
    refs = np.array([0, 1, 2, 2, 1, 0, 2])
    preds = np.array([0, 2, 2, 2, 1, 1, 2])
    assert metrics.compute("micro_f1", preds, refs) == pytest.approx(skm.f1_score(refs, preds, average="micro"))
    assert metrics.compute("macro_f1", preds, refs) == pytest.approx(skm.f1_score(refs, preds, average="macro"))
    assert metrics.compute("mcc", preds, refs) == pytest.approx(skm.matthews_corrcoef(refs, preds))
    hot_refs = np.array([[1, 0, 1], [0, 1, 0], [1, 1, 0]])
    hot_preds = np.array([[1, 0, 1], [0, 1, 1], [1, 0, 0]])
    assert metrics.compute("accuracy", hot_preds, hot_refs) == pytest.approx(1 / 3)  # subset accuracy
    assert metrics.compute("micro_f1", hot_preds, hot_refs) == pytest.approx(
        skm.f1_score(hot_refs, hot_preds, average="micro"))


def test_inputs_as_lists_and_tensors():
    assert metrics.compute("accuracy", torch.tensor(PREDS), torch.tensor(REFS)) == 5 / 8
    assert metrics.compute("accuracy", PREDS.astype(float).tolist(), REFS.tolist()) == 5 / 8
    values = metrics.compute_all(["accuracy", "f1"], PREDS, REFS)
    assert values == {"accuracy": 5 / 8, "f1": pytest.approx(2 / 3)}


def test_bad_inputs_give_clear_errors():
    with pytest.raises(metrics.MetricError, match="differ in shape"):
        metrics.compute("accuracy", [1, 0], [1, 0, 1])
    with pytest.raises(metrics.MetricError, match="non-empty"):
        metrics.compute("accuracy", [], [])
    with pytest.raises(metrics.MetricError, match="NaN"):
        metrics.compute("mse", [1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(metrics.MetricError, match="argmax"):
        metrics.compute("accuracy", [0.2, 0.9], [0, 1])
    with pytest.raises(metrics.MetricError, match="binary"):
        metrics.compute("f1", [0, 2], [0, 1])
    with pytest.raises(metrics.MetricError, match="did you mean 'accuracy'"):
        metrics.compute("acuracy", [1], [1])
    with pytest.raises(metrics.MetricError, match="at least 2"):
        metrics.compute("pearson", [1.0], [1.0])


def test_registry_directions_and_better():
    assert isinstance(metrics.METRICS, Registry)
    for name in metrics.names():
        assert metrics.direction(name) in ("max", "min")
    assert metrics.direction("mse") == metrics.direction("mae") == "min"
    assert metrics.direction("mcc") == "max"
    assert metrics.better("mse", 0.1, 0.2) and not metrics.better("accuracy", 0.1, 0.2)
    assert metrics.better("accuracy", 0.1, None) and not metrics.better("accuracy", float("nan"), 0.1)
