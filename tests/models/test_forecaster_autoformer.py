"""Autoformer: auto-correlation by FFT against direct lag sums, time delay aggregation against torch.roll,
decomposition and decoder initialisation, shapes, gradients, overfit."""

from __future__ import annotations

import math

import pytest
import torch

from forecaster_checks import SMALL_OPTIONS, check_forward_and_gradients, check_rejects_bad_input, overfit_ratio, tiny
from longattn.models.autoformer import (
    AutoCorrelation,
    autocorrelation,
    time_delay_aggregation,
    time_delay_aggregation_rows,
)
from longattn.models.forecast_blocks import SeriesDecomposition
from longattn.models.forecasters import moving_average


def direct_correlation(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """R(tau) = sum_t q_t k_{(t - tau) mod L}, [B, L, H, E] -> [B, H, E, L], by explicit lags."""
    n = q.shape[1]
    lags = [(q * torch.roll(k, shifts=tau, dims=1)).sum(1) for tau in range(n)]  # roll(k, tau)_t = k_{t - tau}
    return torch.stack(lags, dim=-1)


def plain_auto_correlation(q, k, v, factor):
    n = q.shape[1]
    if k.shape[1] < n:
        pad = torch.zeros(k.shape[0], n - k.shape[1], *k.shape[2:], dtype=k.dtype)
        k, v = torch.cat([k, pad], 1), torch.cat([v, pad], 1)
    k, v = k[:, :n], v[:, :n]
    mean = direct_correlation(q, k).mean(dim=(1, 2))  # [B, L]
    top = max(1, int(factor * math.log(n)))
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        scores, delays = mean[b].topk(top)
        weights = torch.softmax(scores, 0)
        for w, tau in zip(weights, delays.tolist()):
            out[b] += w * torch.roll(v[b], shifts=-tau, dims=0)  # Roll(V, tau)_t = V_{t + tau}
    return out


@pytest.mark.parametrize("n", [7, 12])
def test_fft_correlation_matches_direct_lags(n):
    q, k = torch.randn(2, n, 2, 3, dtype=torch.float64), torch.randn(2, n, 2, 3, dtype=torch.float64)
    torch.testing.assert_close(autocorrelation(q, k), direct_correlation(q, k))


@pytest.mark.parametrize("n, s", [(23, 23), (17, 11), (9, 14)])
def test_auto_correlation_matches_plain_topk_and_roll(n, s):
    mechanism = AutoCorrelation(factor=2.0).eval()
    q = torch.randn(3, n, 2, 4, dtype=torch.float64)
    k, v = torch.randn(3, s, 2, 4, dtype=torch.float64), torch.randn(3, s, 2, 4, dtype=torch.float64)
    torch.testing.assert_close(mechanism(q, k, v), plain_auto_correlation(q, k, v, 2.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n, top", [(13, 3), (24, 5), (1, 1)])
def test_row_aggregation_matches_plain_gather(n, top, dtype):
    """The token-major aggregation (rows per delay) against the element gather: the same output bit for bit
    (delays 0 and L - 1 included), the same gradients of values and weights (float64)."""
    values = torch.randn(3, n, 2, 5, dtype=dtype, requires_grad=True)
    delays = torch.stack([torch.randperm(n)[:top] for _ in range(3)])
    delays[0, 0], delays[1, -1] = 0, n - 1
    weights = torch.softmax(torch.randn(3, top, dtype=dtype), -1).requires_grad_()
    fast = time_delay_aggregation_rows(values, delays, weights)
    plain = time_delay_aggregation(values.permute(0, 2, 3, 1), delays, weights).permute(0, 3, 1, 2)
    assert torch.equal(fast, plain)
    if dtype == torch.float64:
        cotangent = torch.randn_like(fast)
        torch.testing.assert_close(torch.autograd.grad(fast, (values, weights), cotangent),
                                   torch.autograd.grad(plain, (values, weights), cotangent))


def test_batch_shared_delays_only_in_training():
    q, k, v = (torch.randn(4, 19, 2, 3, dtype=torch.float64) for _ in range(3))
    shared = AutoCorrelation(delay_selection="batch_shared_in_training")
    per_sample = AutoCorrelation()
    torch.testing.assert_close(shared.eval()(q, k, v), per_sample.eval()(q, k, v))
    assert not torch.allclose(shared.train()(q, k, v), per_sample.train()(q, k, v))


def test_series_decomposition():
    x = torch.randn(2, 30, 3, dtype=torch.float64)
    seasonal, trend = SeriesDecomposition(25)(x)
    torch.testing.assert_close(trend, moving_average(x, 25))
    torch.testing.assert_close(seasonal + trend, x)


def test_decoder_starts_from_the_seasonal_part_of_the_last_label_len_steps():
    """eq. 2: X_des = Concat(seasonal of the last label_len steps, zeros)."""
    model = tiny("autoformer", 3, 20, 6, label_len=8, d_model=8, heads=2, d_ff=8, moving_avg=5).double().eval()
    seen = {}

    def record(module, args, out):
        seen["x"] = args[0]

    model.decoder_embedding.register_forward_hook(record)
    x = torch.randn(2, 20, 3, dtype=torch.float64)
    model(x)
    seasonal = x - moving_average(x, 5)
    torch.testing.assert_close(seen["x"], torch.cat([seasonal[:, -8:], torch.zeros(2, 6, 3, dtype=torch.float64)], 1))


SMALL = SMALL_OPTIONS["autoformer"]


@pytest.mark.parametrize("seq_len, pred_len, label_len", [(23, 5, None), (24, 7, 2), (13, 17, 13)])
def test_shapes_and_gradients(seq_len, pred_len, label_len):
    model = tiny("autoformer", 3, seq_len, pred_len, label_len=label_len, **SMALL)
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_label_len_is_checked():
    with pytest.raises(ValueError, match="label_len"):
        tiny("autoformer", 3, 10, 5, label_len=11, **SMALL)


def test_overfits_a_synthetic_series():
    assert overfit_ratio(tiny("autoformer", 2, 24, 6, **SMALL), 24, 6, 2) < 0.5
