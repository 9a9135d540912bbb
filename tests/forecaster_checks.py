"""Checks every comparison forecaster's tests run: shapes, gradients reaching every parameter, odd lengths,
bad input, and a short overfit on a synthetic series."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from longattn.models.forecasters import build_forecaster


_ATTENTION_BLOCK = dict(d_model=16, heads=2, d_ff=16)
# The small options every forecaster is built with in the tests (one table: a new forecaster is added here).
SMALL_OPTIONS = {
    "skt": dict(d_model=16, heads=2),
    "encoder": dict(d_model=16, heads=2),
    "dlinear": dict(kernel_size=5),
    "fedformer": dict(_ATTENTION_BLOCK, modes=4, moving_avg=[5, 4], wavelet_c=2, wavelet_cross_c=2, wavelet_modes=3,
                      wavelet_skipped_levels=1),
    "autoformer": dict(_ATTENTION_BLOCK, moving_avg=5, factor=2.0),
    "informer": dict(_ATTENTION_BLOCK),
    "logtrans": dict(_ATTENTION_BLOCK),
    "transformer": dict(_ATTENTION_BLOCK),
    "performer": dict(_ATTENTION_BLOCK, nb_features=8),
    "nystromformer": dict(_ATTENTION_BLOCK, num_landmarks=4, conv_kernel=3),
    "reformer": dict(_ATTENTION_BLOCK, bucket_size=2, n_hashes=2),
    "s4": dict(d_model=16, layers=2, state_size=8),
    "patchtst": dict(d_model=16, heads=2, layers=2, d_ff=32, patch_len=6, stride=3),
    "itransformer": dict(d_model=16, heads=2, layers=2, d_ff=16),
}


def synthetic_batch(batch: int, seq_len: int, pred_len: int, channels: int, seed: int = 0) -> tuple:
    """Noisy sines with channel-specific periods and a trend: (x [B, seq_len, C], y [B, pred_len, C])."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(seq_len + pred_len, dtype=torch.float32)[None, :, None] + torch.randint(0, 50, (batch, 1, 1),
                                                                                              generator=g)
    period = 6.0 + 3.0 * torch.arange(channels, dtype=torch.float32)
    series = torch.sin(2 * math.pi * t / period) + 0.01 * t + 0.05 * torch.randn(t.shape[0], t.shape[1], channels,
                                                                                 generator=g)
    return series[:, :seq_len], series[:, seq_len:]


def check_forward_and_gradients(model: nn.Module, seq_len: int, pred_len: int, channels: int,
                                calendar_dim: int = 0, no_grad_ok: tuple[str, ...] = ()) -> None:
    """Output [B, pred_len, C], finite; a loss gradient reaches the input and every trainable parameter."""
    x = torch.randn(3, seq_len, channels, requires_grad=True)
    marks = torch.rand(3, seq_len, calendar_dim) - 0.5 if calendar_dim else None
    model.train()
    y = model(x, marks)
    assert y.shape == (3, pred_len, channels)
    assert torch.isfinite(y).all()
    y.square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    missing = [name for name, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0) and not name.startswith(no_grad_ok)]
    assert not missing, f"no gradient reaches {missing}"


def check_rejects_bad_input(model: nn.Module, seq_len: int, channels: int) -> None:
    with pytest.raises(ValueError, match="shape"):
        model(torch.randn(2, seq_len + 1, channels))
    with pytest.raises(ValueError, match="NaN"):
        bad = torch.randn(2, seq_len, channels)
        bad[0, 1, 0] = float("nan")
        model(bad)


def overfit_ratio(model: nn.Module, seq_len: int, pred_len: int, channels: int, steps: int = 40,
                  lr: float = 3e-3) -> float:
    """Final / initial training MSE after ``steps`` Adam steps on one fixed synthetic batch (eval-mode losses)."""
    x, y = synthetic_batch(16, seq_len, pred_len, channels)

    def loss() -> torch.Tensor:
        return (model(x) - y).square().mean()

    model.eval()
    with torch.no_grad():
        before = float(loss())
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimiser.zero_grad()
        loss().backward()
        optimiser.step()
    model.eval()
    with torch.no_grad():
        after = float(loss())
    return after / before


def tiny(name: str, channels: int, seq_len: int, pred_len: int, **options) -> nn.Module:
    return build_forecaster(name, channels=channels, seq_len=seq_len, pred_len=pred_len, **options)


def check_matches_reference_with_dropout(fast, reference, x: torch.Tensor, params: list, seed: int = 5) -> None:
    """``fast(x)`` against ``reference(x)`` in training mode: the same output and gradients (x and ``params``)
    when both start from the same seed, i.e. the same dropout masks are drawn; another seed gives another
    output, so dropout is really on."""
    torch.manual_seed(seed)
    out = fast(x)
    torch.manual_seed(seed)
    ref = reference(x)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, [x, *params], g), torch.autograd.grad(ref, [x, *params], g)):
        torch.testing.assert_close(a, r)
    torch.manual_seed(seed + 1)
    assert not torch.allclose(fast(x), out)
