"""Checks of a mechanism's module form that the tests of several mechanisms share (gla, mamba2, nsa, moba, linear):
the causal form never looks ahead, decoding against the causal forward, the largest intermediate of the causal
form and its growth with N, a bf16 autocast training run."""

from __future__ import annotations

import torch

from longattn import attention
from longattn.attention import AttentionBase
from longattn.testing import LargestTensorRecorder

DIM = 32


def assert_never_looks_ahead(name: str) -> None:
    """Changing tokens 30 on changes no causal output before them, and changes those after."""
    layer = attention.build(name, dim=16, heads=2, causal=True).double()
    x = torch.randn(2, 50, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 30:] += torch.randn_like(changed[:, 30:]) * 10
    out, moved = layer(x), layer(changed)
    torch.testing.assert_close(moved[:, :30], out[:, :30])
    assert not torch.allclose(moved[:, 30:], out[:, 30:])


def assert_decoding_equals_forward(layer: AttentionBase, n: int, prompt: int):
    """Prefill ``prompt`` tokens and step the rest, left padded (one row's prompt all padding): the rows equal the
    full causal forward in float64. Returns the last state."""
    x = torch.randn(3, n, layer.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, :4], mask[2, :prompt + 2] = False, False
    full = layer(x, mask)
    out, state = layer.prefill(x[:, :prompt], mask[:, :prompt])
    rows = [out]
    for t in range(prompt, n):
        out, state = layer.step(x[:, t:t + 1], state, mask[:, t:t + 1])
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows, 1), full, atol=1e-10, rtol=1e-10)
    return state


def largest_intermediate(name: str, n: int, **options) -> int:
    """Elements of the largest tensor of one causal forward + backward at length ``n``."""
    layer = attention.build(name, dim=DIM, heads=1, causal=True, **options)
    x = torch.randn(1, n, DIM, requires_grad=True)
    with LargestTensorRecorder() as rec:
        layer(x).sum().backward()
    return rec.max_numel


def assert_no_quadratic_intermediate(name: str, n: int = 4096, share: int = 4, **options) -> None:
    """The causal form's largest tensor, forward and backward, is at most N^2 / ``share`` at N = ``n`` and grows
    linearly: at most 2.5x the one at N / 2."""
    big = largest_intermediate(name, n, **options)
    assert big <= n * n // share and big <= 2.5 * largest_intermediate(name, n // 2, **options)


def bf16_autocast_losses(layer: AttentionBase, steps: int = 8, length: int = 64,
                         mask: torch.Tensor | None = None) -> list[float]:
    """Adam steps of the layer regressing random targets under CPU bfloat16 autocast (output bf16, gradients
    finite), the loss over the real tokens of ``mask`` [2, length] (None: no padding); the losses."""
    torch.manual_seed(0)
    x, target = torch.randn(2, length, layer.dim), torch.randn(2, length, layer.dim)
    optimiser = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, mask)
            assert out.dtype == torch.bfloat16
            error = out.float() - target
            loss = (error if mask is None else error[mask]).square().mean()
        optimiser.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
        optimiser.step()
        losses.append(loss.item())
    return losses
