"""Shared checks of the block-selecting mechanisms (nsa, moba) in their module form: packed == padded, decoding ==
the causal forward, the largest intermediate, a bf16 autocast training run."""

from __future__ import annotations

import torch

from longattn import attention
from longattn.attention import AttentionBase
from longattn.testing import LargestTensorRecorder

DIM, HEADS = 32, 2


def assert_packed_equals_padded(layer: AttentionBase, lengths: list[int]) -> None:
    """Forward and input gradients of sequences packed in one row equal those of the end-padded batch."""
    sequences = [torch.randn(n, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed = torch.cat(sequences)[None].requires_grad_()
    padded = torch.zeros(len(lengths), max(lengths), DIM, dtype=torch.float64)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for i, s in enumerate(sequences):
        padded[i, :len(s)], mask[i, :len(s)] = s, True
    padded.requires_grad_()
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out_packed = layer.forward_packed(packed, cu_seqlens=cu_seqlens)
    out_padded = layer(padded, mask)
    torch.testing.assert_close(out_packed[0], out_padded[mask])
    out_packed.square().sum().backward()
    out_padded.square().sum().backward()
    torch.testing.assert_close(packed.grad[0], padded.grad[mask])


def assert_decoding_equals_forward(layer: AttentionBase, n: int, prompt: int):
    """Prefill ``prompt`` tokens and step the rest, left padded (one row's prompt all padding): the rows equal the
    full causal forward in float64. Returns the last state."""
    x = torch.randn(3, n, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
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


def bf16_autocast_losses(layer: AttentionBase, steps: int = 8) -> list[float]:
    """Adam steps of the layer regressing random targets under CPU bfloat16 autocast (output bf16, gradients
    finite); the losses."""
    torch.manual_seed(0)
    x, target = torch.randn(2, 64, DIM), torch.randn(2, 64, DIM)
    optimiser = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
            assert out.dtype == torch.bfloat16
            loss = (out.float() - target).square().mean()
        optimiser.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
        optimiser.step()
        losses.append(loss.item())
    return losses
