"""When the mechanisms' Triton kernels run, and how the tests run them on a CPU.

Kernels live beside their mechanism in modules named ``_<mechanism>_triton.py`` (the leading
underscore keeps them out of the package's automatic imports: triton is an optional extra, and a
kernel module is imported only when a kernel is about to run). Each such module holds the kernel,
its launcher and a plain PyTorch reference of the same computation that the tests compare with.

On CUDA the kernels run whenever triton is installed (``triton_runs_on``); without triton the
mechanism's PyTorch GPU path runs instead. On a CPU the kernels run only inside
:func:`interpret_triton`, which the tests use: Triton's interpreter executes a kernel, ``tl.dot``
included, on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton compiled the kernel
(tests/conftest.py sets it on machines without CUDA).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["interpret_triton", "kernels_run_on", "triton_installed", "triton_runs_on", "use_triton"]

_INTERPRETING: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_interpret_triton", default=False)
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_use_triton", default=True)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(t: Tensor) -> bool:
    """Whether the Triton kernels run for inputs like ``t``: CUDA tensors with triton installed, or
    CPU tensors inside :func:`interpret_triton`; never inside ``use_triton(False)``."""
    if not (_ENABLED.get() and triton_installed()):
        return False
    if t.device.type == "cuda":
        return True
    return _INTERPRETING.get() and t.device.type == "cpu"


def kernels_run_on(t: Tensor) -> bool:
    """Whether the kernels of the linear family's causal scan, skein, informer and reformer take inputs
    like ``t``: where :func:`triton_runs_on` says kernels run, in float16, bfloat16 or float32 on CUDA
    (float64 there takes the PyTorch GPU path), and in Triton's CPU interpreter in any dtype but bfloat16
    (whose ``tl.dot`` the interpreter of triton 3.9 gets wrong)."""
    if not triton_runs_on(t):
        return False
    if t.device.type == "cuda":
        return t.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return t.dtype != torch.bfloat16


@contextlib.contextmanager
def interpret_triton() -> Iterator[None]:
    """Run the kernels in Triton's interpreter on CPU tensors (tests). Needs TRITON_INTERPRET=1 in
    the environment before the kernel modules were imported; raises a clear error otherwise."""
    if not triton_installed():
        raise RuntimeError("interpret_triton needs triton: pip install 'longattn[triton]'")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpret_triton needs TRITON_INTERPRET=1 set before triton compiles the kernels "
                           "(tests/conftest.py sets it where CUDA is absent)")
    token = _INTERPRETING.set(True)
    try:
        yield
    finally:
        _INTERPRETING.reset(token)


@contextlib.contextmanager
def use_triton(enabled: bool) -> Iterator[None]:
    """``with use_triton(False):`` runs the PyTorch GPU path even where the kernels could run (to
    compare the two, or to time them side by side)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)
