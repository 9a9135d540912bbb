"""Checks shared by the tests of the gated-scan mechanisms (gla, mamba2), and flash-linear-attention's naive
references as their peer, run in float64.

fla's ``naive.py`` functions cast their inputs to float32 (``.float()``, ``.to(torch.float32)``) before the
recurrence. Inside :class:`KeepFloat64` those casts of float64 tensors return the tensor itself, so the peer runs
its own loop in float64 and the comparison is float64-exact: a mistake of 1e-7 shows.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gpu_path_checks import assert_gpu_result_close
from module_checks import DIM, bf16_autocast_losses

from longattn import attention
from longattn.attention import force_path
from longattn.attention.ops.gated_scan import gated_scan_reference
from longattn.testing import assert_forward_backward_close, random_qkv, scattered_mask


class KeepFloat64(TorchFunctionMode):
    """``Tensor.float()`` and ``Tensor.to(torch.float32)`` leave float64 tensors as they are."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.float, torch.Tensor.to) and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:
            target = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            if func is torch.Tensor.float or target is torch.float32:
                return args[0]
        return func(*args, **kwargs)


def fla_naive(module: str):
    """``fla/ops/<module>/naive.py`` of fla-core (skips the test without it, the 'peers' extra), loaded from its file:
    it needs only torch and einops, while importing the ``fla`` package loads every layer and model it has (~10 s)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("the peer references need fla-core (the 'peers' extra)")
    path = Path(spec.origin).parent / "ops" / module / "naive.py"
    loaded = importlib.util.spec_from_file_location(f"fla_naive_{module}", path)
    naive = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(naive)
    return naive


def to_fla(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[B, H, N, *] -> fla's [B, N, H, *] (and back: the same transpose)."""
    return [t.transpose(1, 2) for t in tensors]


def per_row_without_padding(fn, mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on each row's real tokens alone ([1, H, n_real, *]), scattered back to [B, H, N, *] (zeros at padding)."""
    rows = []
    for b in range(mask.shape[0]):
        out = fn(*(t[b:b + 1, :, mask[b]] for t in tensors))
        row = out.new_zeros(1, out.shape[1], mask.shape[1], out.shape[-1])
        row[:, :, mask[b]] = out
        rows.append(row)
    return torch.cat(rows)


def assert_equals_peer_without_padding(out: torch.Tensor, peer, mask: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """``out`` (a functional form on ``inputs`` with ``mask``) equals ``peer`` on each row's real tokens alone, in
    float64, forward and gradients of every input: padded tokens are skipped, wherever they sit."""
    want = per_row_without_padding(peer, mask, *inputs)
    assert want.dtype == torch.float64
    assert_forward_backward_close(out, want, inputs)


def assert_equals_fla_naive_with_padding(functional, naive_call, n: int, log_decay: torch.Tensor) -> None:
    """``functional(q, k, v, g, mask, is_causal=True)`` equals fla's naive recurrence ``naive_call(q, k, v, g)`` (fla's
    [B, N, H, *] layout in and out, run in float64 under :class:`KeepFloat64`) on each row's real tokens alone, with
    scattered and left padding; forward and gradients of q, k, v and the log decays ``log_decay`` [2, 2, n, *]."""
    q, k, v = random_qkv(2, 2, n, 8)
    mask = scattered_mask(2, n)
    mask[1, : n // 3] = False  # left padding too

    def peer(q_, k_, v_, g_):
        with KeepFloat64():
            return to_fla(naive_call(*to_fla(q_, k_, v_, g_)))[0]

    inputs = [q, k, v, log_decay]
    assert_equals_peer_without_padding(functional(*inputs, mask, is_causal=True), peer, mask, inputs)


def assert_functional_equals_reference(functional, reference, log_decay: torch.Tensor, causal: bool, path: str) -> None:
    """The functional form (chunks of 16, on the CPU or the GPU ``path``) equals the parallel reference with
    scattered padding, forward and gradients of q, k, v and ``log_decay`` [2, 2, n, *]."""
    n = log_decay.shape[2]
    q, k, v = random_qkv(2, 2, n, 8)
    mask = scattered_mask(2, n)
    inputs = (q, k, v, log_decay)
    upstream = torch.randn(2, 2, n, 8, dtype=torch.float64)
    with force_path(path):
        out = functional(*inputs, mask, is_causal=causal, chunk_size=16)
        grads = torch.autograd.grad(out, inputs, upstream)
    ref = reference(*inputs, mask, is_causal=causal)
    assert_gpu_result_close(out, grads, ref, inputs, upstream, torch.float64)


def switched_layer(name: str, options: dict, dim: int = 32, heads: int = 2) -> torch.nn.Module:
    """The causal module built with ``options``: its forward and backward run, with finite input gradients, and its
    output differs from the default layer's (the same seed) unless ``options`` set the chunk size (which leaves the
    function as it is). Returns the layer for the option's own checks."""
    torch.manual_seed(0)
    default = attention.build(name, dim=dim, heads=heads, causal=True).double()
    torch.manual_seed(0)
    layer = attention.build(name, dim=dim, heads=heads, causal=True, **options).double()
    x = torch.randn(2, 11, dim, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    if "chunk_size" not in options:
        with torch.no_grad():
            assert not torch.allclose(out, default(x))
    return layer


def assert_scan_equals_recurrence(scan, inputs: list[torch.Tensor], chunk: int) -> None:
    """``scan(q, k, v, g, chunk)`` gives the token-by-token recurrence's outputs and gradients, and its final state."""
    out, state = scan(*inputs, chunk)
    want, want_state = gated_scan_reference(*inputs)
    torch.testing.assert_close(state, want_state)
    assert_forward_backward_close(out, want, inputs)


def assert_trains_under_bf16_autocast(name: str, heads: int = 2) -> None:
    """Ten Adam steps of the causal module form under CPU bf16 autocast (the CPU path) with scattered padding: the
    output is bf16, every loss finite, the last below the first."""
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=heads, causal=True)
    losses = bf16_autocast_losses(layer, steps=10, length=33, mask=scattered_mask(2, 33))
    assert all(value == value for value in losses)
    assert losses[-1] < losses[0]
