"""flash-linear-attention's naive references as the tests' peer, run in float64.

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
