"""flash-linear-attention's naive references as the tests' peer, run in float64.

fla's ``naive.py`` functions cast their inputs to float32 (``.float()``, ``.to(torch.float32)``) before the
recurrence. Inside :class:`KeepFloat64` those casts of float64 tensors return the tensor itself, so the peer runs
its own loop in float64 and the comparison is float64-exact: a mistake of 1e-7 shows.
"""

from __future__ import annotations

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
    """``fla.ops.<module>.naive`` (skips the test without fla-core, the 'peers' extra)."""
    pytest.importorskip("fla", reason="the peer references need fla-core (the 'peers' extra)")
    import importlib

    return importlib.import_module(f"fla.ops.{module}.naive")


def to_fla(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[B, H, N, *] -> fla's [B, N, H, *] (and back: the same transpose)."""
    return [t.transpose(1, 2) for t in tensors]
