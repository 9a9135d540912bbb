"""Shared checks of the GPU paths (forced on CPU with force_path("gpu")) and of the Triton kernels (run in
Triton's interpreter): RMS ratios, op counts on meta tensors, the largest intermediate."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest
import torch

from longattn import attention
from longattn.attention import force_path
from longattn.testing import DispatchCounter, LargestTensorRecorder

# op counts are compared at these (batch, length) pairs: 1k vs 64k tokens, batch 2 vs 64
OP_COUNT_SHAPES = [(2, 1024), (2, 65536), (64, 1024)]


# where the kernel tests run the Triton kernels: compiled on CUDA when there is a GPU, else in Triton's interpreter
# on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 where CUDA is absent)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def needs_triton() -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton (the 'triton' extra)")


@contextlib.contextmanager
def running_kernels() -> Iterator[str]:
    """Inside, the GPU paths' Triton kernels run on tensors on the yielded device (KERNEL_DEVICE): compiled on
    CUDA, interpreted on CPU. Skips the test without triton."""
    needs_triton()
    if KERNEL_DEVICE == "cuda":
        yield KERNEL_DEVICE
        return
    from longattn.attention._triton import interpret_triton

    with interpret_triton():
        yield KERNEL_DEVICE


def kernel_dtype(kernels: bool) -> torch.dtype:
    """The dtype of a test that runs the kernels: float32 on CUDA (float64 takes the PyTorch GPU path there),
    float64 in the interpreter and without kernels."""
    return torch.float32 if kernels and KERNEL_DEVICE == "cuda" else torch.float64


def assert_gpu_result_close(out: torch.Tensor, grads: tuple[torch.Tensor, ...], ref: torch.Tensor,
                            inputs: tuple[torch.Tensor, ...], upstream: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` and ``grads`` (of ``inputs`` for ``upstream``) equal the reference's, to float64's default
    tolerance or, in float32, to 1e-4."""
    tolerance = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, **tolerance)
    for got, want in zip(grads, torch.autograd.grad(ref, inputs, upstream)):
        torch.testing.assert_close(got, want, **tolerance)


def skip_float64_kernels_on_cuda(dtype: torch.dtype) -> None:
    """The kernels take float64 only in the interpreter (on CUDA float64 takes the PyTorch GPU path)."""
    if dtype == torch.float64 and KERNEL_DEVICE == "cuda":
        pytest.skip("float64 kernels run only in the interpreter")


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
