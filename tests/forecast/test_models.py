"""Forecasters: Fourier extrapolation (fast vs reference), window normalisation, SKT / encoder / DLinear."""

from __future__ import annotations

import math

import pytest
import torch

from longattn import attention
from longattn.models.forecasters import (
    DLinear,
    FourierExtrapolation,
    build_forecaster,
    lowest_frequency_indices,
    moving_average,
    window_normalise,
)


def test_lowest_frequency_order():
    # fftfreq(8) = [0, 1, 2, 3, -4, -3, -2, -1] / 8: sorted by |f| with ties in FFT order.
    assert lowest_frequency_indices(8, 2).tolist() == [0, 1, 7, 2, 6]
    assert lowest_frequency_indices(7, 10).tolist() == [0, 1, 6, 2, 5, 3, 4]


@pytest.mark.parametrize("n, pred, harmonics", [(7, 3, 1), (12, 5, None), (36, 24, 4), (1, 2, 0)])
def test_fourier_fast_matches_reference(n, pred, harmonics):
    head = FourierExtrapolation(n, pred, harmonics).double()
    x = torch.randn(2, n, 3, dtype=torch.float64, requires_grad=True)
    fast, ref = head(x), head.reference(x)
    assert fast.shape == (2, n + pred, 3)
    torch.testing.assert_close(fast, ref)
    weights = torch.randn_like(fast)
    (grad_fast,) = torch.autograd.grad((fast * weights).sum(), x)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), x)
    torch.testing.assert_close(grad_fast, grad_ref)


def test_fourier_all_bins_is_periodic_continuation():
    x = torch.randn(1, 10, 2, dtype=torch.float64)
    out = FourierExtrapolation(10, 15).double()(x)  # 1 + 2*15 >= 10: every bin kept
    torch.testing.assert_close(out[:, :10], x)
    torch.testing.assert_close(out[:, 10:20], x)
    torch.testing.assert_close(out[:, 20:], x[:, :5])


def test_fourier_low_pass_extrapolates_a_low_frequency_wave():
    n, pred = 32, 16
    t = torch.arange(n + pred, dtype=torch.float64)
    wave = 0.5 + torch.cos(2 * math.pi * 2 * t / n + 0.3)  # DC + bin 2: kept by harmonics=2
    noise_free = FourierExtrapolation(n, pred, harmonics=2).double()(wave[:n].reshape(1, n, 1))
    torch.testing.assert_close(noise_free[0, :, 0], wave)
    dropped = FourierExtrapolation(n, pred, harmonics=1).double()(wave[:n].reshape(1, n, 1))
    torch.testing.assert_close(dropped[0, :, 0], torch.full_like(wave, 0.5))  # bin 2 filtered out


def test_window_normalise_formula():
    x = torch.randn(3, 20, 4, dtype=torch.float64) * 5 + 2
    normed, mean, std = window_normalise(x)
    torch.testing.assert_close(mean, x.mean(1, keepdim=True))
    torch.testing.assert_close(std, (x.var(1, unbiased=True, keepdim=True) + 1).sqrt())
    torch.testing.assert_close(normed * std + mean, x)


def _tiny(name: str, **options):
    defaults = {"skt": dict(d_model=16, heads=2, attention="softmax"),
                "encoder": dict(d_model=16, heads=2, d_ff=32, layers=2, attention="softmax"),
                "dlinear": {}}[name]
    return build_forecaster(name, channels=3, seq_len=24, pred_len=7, **{**defaults, **options})


@pytest.mark.parametrize("name, options", [
    ("skt", {}), ("skt", {"head": "linear"}), ("skt", {"layers": 2}),
    ("encoder", {}), ("encoder", {"head": "fourier"}),
])
def test_transformer_forecasters_shift_equivariant(name, options):
    """Window normalisation makes the forecast of x + c equal forecast(x) + c for a per-channel constant c."""
    torch.manual_seed(0)
    model = _tiny(name, **options).double().eval()
    x = torch.randn(4, 24, 3, dtype=torch.float64)
    shift = torch.tensor([10.0, -3.0, 0.5], dtype=torch.float64)
    out = model(x)
    assert out.shape == (4, 7, 3)
    torch.testing.assert_close(model(x + shift), out + shift)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_calendar_marks_are_used():
    torch.manual_seed(0)
    model = _tiny("skt", calendar_dim=2).eval()
    x, marks = torch.randn(2, 24, 3), torch.rand(2, 24, 2) - 0.5
    assert not torch.allclose(model(x, marks), model(x, marks * 0))
    with pytest.raises(ValueError, match="calendar features"):
        model(x)


@pytest.mark.parametrize("k, front, back", [(5, 2, 2), (4, 2, 1), (1, 0, 0)])
def test_moving_average_matches_loop(k, front, back):
    x = torch.randn(2, 11, 3, dtype=torch.float64)
    padded = torch.cat([x[:, :1].repeat(1, front, 1), x, x[:, -1:].repeat(1, back, 1)], dim=1)
    expected = torch.stack([padded[:, i : i + k].mean(1) for i in range(11)], dim=1)
    torch.testing.assert_close(moving_average(x, k), expected)
    with pytest.raises(ValueError, match="positive"):
        moving_average(x, 0)


@pytest.mark.parametrize("k", [1, 4, 5, 25])
@pytest.mark.parametrize("length", [1, 11, 30])
def test_moving_average_gradient_matches_autograd_of_the_window_means(k, length):
    """The written-out backward (a sliding mean of the zero-padded gradient) against autograd of the plain
    window means of the edge-padded series, float64, kernels longer than the series; time-major and
    channel-major output gradients (the layouts the forecasters pass back)."""
    back = (k - 1) // 2
    x = torch.randn(2, length, 3, dtype=torch.float64, requires_grad=True)
    padded = torch.cat([x[:, :1].repeat(1, k - 1 - back, 1), x, x[:, -1:].repeat(1, back, 1)], dim=1)
    plain = torch.stack([padded[:, i : i + k].mean(1) for i in range(length)], dim=1)
    for cotangent in (torch.randn(2, length, 3, dtype=torch.float64),
                      torch.randn(2, 3, length, dtype=torch.float64).transpose(1, 2)):
        torch.testing.assert_close(torch.autograd.grad(moving_average(x, k), x, cotangent),
                                   torch.autograd.grad(plain, x, cotangent))


@pytest.mark.parametrize("individual", [False, True])
def test_dlinear_is_two_linear_maps_over_time(individual):
    torch.manual_seed(0)
    model = DLinear(channels=3, seq_len=24, pred_len=7, kernel_size=25, individual=individual).double()
    x = torch.randn(2, 24, 3, dtype=torch.float64)
    trend = moving_average(x, 25)
    out = model(x)
    for c in range(3):
        s, t = (model.seasonal[c], model.trend[c]) if individual else (model.seasonal[0], model.trend[0])
        torch.testing.assert_close(out[:, :, c], s(x[:, :, c] - trend[:, :, c]) + t(trend[:, :, c]))


def test_build_forecaster_errors():
    with pytest.raises(ValueError, match="unknown forecaster"):
        build_forecaster("lstm", 3, 24, 7)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['depth'\]"):
        build_forecaster("skt", 3, 24, 7, depth=2)
    with pytest.raises(ValueError, match="head"):
        _tiny("skt", head="mlp")
    with pytest.raises(attention.AttentionError, match="unknown attention"):
        _tiny("encoder", attention="no-such-attention")


@pytest.mark.skipif("skeleton" not in attention.available(), reason="skeleton attention not registered yet")
def test_skt_with_skeleton_and_smoother():
    torch.manual_seed(0)
    model = _tiny("skt", attention="skeleton", attention_options=dict(
        smoother=True, smoother_segments=8, smoother_kernel_size=3, smoother_activation="elu",
        smoother_segment_average=True, smoother_fft_norm="ortho"))
    x = torch.randn(2, 24, 3)
    out = model(x)
    assert out.shape == (2, 7, 3) and torch.isfinite(out).all()
    out.sum().backward()


def test_encoder_forecaster_leaves_out_its_ffn_around_a_gated_attention_unit():
    torch.manual_seed(0)
    model = _tiny("encoder", attention="flash", attention_options=dict(chunk_size=8, query_key_dim=8))
    assert len(model.ffs) == 0 and len(model.ff_norms) == 0 and len(model.attns) == 2
    out = model(torch.randn(2, 24, 3))
    assert out.shape == (2, 7, 3) and torch.isfinite(out).all()
