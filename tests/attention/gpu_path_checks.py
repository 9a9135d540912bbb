"""Shared checks of the GPU paths (forced on CPU with force_path("gpu")) and of the Triton kernels (run in
Triton's interpreter): RMS ratios, op counts on meta tensors, the largest intermediate."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from longattn import attention
from longattn.attention import force_path
from longattn.testing import DispatchCounter, LargestTensorRecorder

# op counts are compared at these (batch, length) pairs: 1k vs 64k tokens, batch 2 vs 64
OP_COUNT_SHAPES = [(2, 1024), (2, 65536), (64, 1024)]


def needs_triton() -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton (the 'triton' extra)")


def rms_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), in float64 (flash-linear-attention's tolerance measure)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).square().mean().sqrt() / ref.square().mean().sqrt()).item()


def assert_close_rms(out: torch.Tensor, ref: torch.Tensor, ratio: float, label: str = "") -> None:
    got = rms_ratio(out, ref)
    assert got <= ratio, f"{label} RMS ratio {got:.2e} > {ratio:.1e}"


def module_op_counts(name: str, dim: int = 64, heads: int = 2, shapes=OP_COUNT_SHAPES, **options) -> list[int]:
    """aten ops of one forward+backward of the module form on the GPU path, per (batch, length), on meta tensors
    (shapes only: 64k tokens cost nothing) with a scattered padding mask."""
    counts = []
    for batch, length in shapes:
        torch.manual_seed(0)
        layer = attention.build(name, dim=dim, heads=heads, **options).to("meta")
        x = torch.randn(batch, length, dim, device="meta", requires_grad=True)
        mask = torch.ones(batch, length, dtype=torch.bool, device="meta")
        with force_path("gpu"), DispatchCounter() as ops:
            layer(x, mask).sum().backward()
        counts.append(ops.total)
    return counts


def largest_on_gpu_path(run: Callable[[int], torch.Tensor], n: int) -> LargestTensorRecorder:
    """The largest tensor of ``run(n)`` (forward and backward) on the GPU path."""
    with force_path("gpu"), LargestTensorRecorder() as rec:
        run(n).sum().backward()
    return rec
