"""Evaluation is per window: a forecaster's eval-mode prediction for a window does not depend on the other windows
of its batch, so ``train.eval_batch_size`` is a speed setting only (on one CPU thread, batches of 64 evaluate the
ETTm2 models up to 1.8x faster than 256; docs/forecasting.md). Catches any op that mixes samples in evaluation.

Informer and Reformer are the exceptions, by their papers: ProbSparse attention samples the keys that score each
query, and Reformer's LSH draws its random rotations, afresh at every forward (eval included), so a window's
prediction depends on that draw (the same seed gives the same prediction), and the draw on the batch's shape.
"""

from __future__ import annotations

import pytest
import torch

from longattn.models.registry import model_names
from forecaster_checks import SMALL_OPTIONS, tiny

# sampled keys (Zhou et al. 2021, Sec. 3.1, Eq. 4), random rotations (Kitaev et al. 2020, Sec. 2): drawn per forward
DRAWS_PER_BATCH = {"informer", "reformer"}
SEQ_LEN, PRED_LEN, CHANNELS = 48, 12, 3


def test_every_forecaster_is_covered():
    assert sorted(SMALL_OPTIONS) == sorted(model_names(family="forecaster"))


def predict_in_chunks(model: torch.nn.Module, x: torch.Tensor, sizes: list[int], seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return torch.cat([model(part) for part in x.split(sizes)])


@pytest.mark.parametrize("name", sorted(set(SMALL_OPTIONS) - DRAWS_PER_BATCH))
def test_eval_prediction_does_not_depend_on_the_batch(name):
    torch.manual_seed(0)
    model = tiny(name, CHANNELS, SEQ_LEN, PRED_LEN, **SMALL_OPTIONS[name]).eval()
    x = torch.randn(10, SEQ_LEN, CHANNELS)
    whole = predict_in_chunks(model, x, [10])
    assert whole.shape == (10, PRED_LEN, CHANNELS)
    torch.testing.assert_close(predict_in_chunks(model, x, [3, 3, 4]), whole)
    torch.testing.assert_close(predict_in_chunks(model, x.flip(0), [4, 6]), whole.flip(0))


@pytest.mark.parametrize("name", sorted(DRAWS_PER_BATCH))
def test_eval_prediction_depends_on_the_draw(name):
    torch.manual_seed(0)
    model = tiny(name, CHANNELS, SEQ_LEN, PRED_LEN, **SMALL_OPTIONS[name]).eval()
    x = torch.randn(10, SEQ_LEN, CHANNELS)
    torch.testing.assert_close(predict_in_chunks(model, x, [10], seed=1), predict_in_chunks(model, x, [10], seed=1))
    assert not torch.allclose(predict_in_chunks(model, x, [10], seed=1), predict_in_chunks(model, x, [10], seed=2))
