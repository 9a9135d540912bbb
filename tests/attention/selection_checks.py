"""Shared checks of the block-selecting mechanisms (nsa, moba) in their module form: packed == padded (their
other module checks are module_checks.py's)."""

from __future__ import annotations

import torch
from module_checks import DIM

from longattn.attention import AttentionBase

HEADS = 2


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
