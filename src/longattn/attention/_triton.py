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

Inside :func:`capture_launches` the kernels "run" on meta tensors: every launch is recorded (kernel,
arguments, constexprs) instead of executed, so that :mod:`longattn.bench.aot` can compile, for a GPU
that is not there, exactly what the launchers would launch, at any size, without computing anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

__all__ = ["MIN_CAPABILITY", "SHARED_MEMORY_PER_BLOCK", "Launch", "capture_launches", "device_takes_kernels",
           "float32_takes_pytorch_path", "interpret_triton", "kernels_run_on", "triton_importable", "triton_installed",
           "triton_runs_on", "use_triton"]

# The shared memory one block may use (the opt-in maximum), in bytes, by compute capability (major * 10 + minor;
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"): 163 KB on A100, 227 KB on
# H100 and B200, 99 KB on the sm_86 / sm_89 / sm_120 parts.
SHARED_MEMORY_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

_INTERPRETING: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_interpret_triton", default=False)
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_use_triton", default=True)
_CAPTURED: contextvars.ContextVar[list["Launch"] | None] = contextvars.ContextVar("longattn_capture_launches",
                                                                                  default=None)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """A one-line warning, once per process for each message: why the PyTorch GPU path runs instead."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.cache
def triton_importable() -> bool:
    """Whether triton is installed and imports (a broken install, say a triton built for another CUDA or
    Python, falls back to the PyTorch GPU path with a warning instead of raising in the middle of a run)."""
    if not triton_installed():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (whatever the breakage, the PyTorch GPU path runs)
        _say_once(f"triton is installed but fails to import ({type(exc).__name__}: {exc}); the mechanisms run "
                  "their PyTorch GPU path")
        return False
    return True


# The kernels' oldest GPU: bf16 tl.dot, and the tiles' shared memory, need sm_80 (Ampere) or newer.
MIN_CAPABILITY = (8, 0)


def device_takes_kernels(device: torch.device) -> bool:
    """Whether the CUDA device ``device`` runs the kernels: an NVIDIA GPU of compute capability at least
    MIN_CAPABILITY. ROCm devices (which torch calls "cuda") and older GPUs take the PyTorch GPU path, said
    once per reason."""
    if torch.version.hip is not None:
        _say_once("a ROCm device: the Triton kernels are compiled and checked for NVIDIA GPUs only; the mechanisms "
                  "run their PyTorch GPU path")
        return False
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        _say_once(f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}: the Triton kernels "
                  f"need sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]} or newer; the mechanisms run their PyTorch GPU path")
        return False
    return True


def triton_runs_on(t: Tensor) -> bool:
    """Whether the Triton kernels run for inputs like ``t``: CUDA tensors on a device that takes them
    (:func:`device_takes_kernels`) with triton importable, or CPU tensors inside :func:`interpret_triton`;
    never inside ``use_triton(False)``."""
    if not (_ENABLED.get() and triton_importable()):
        return False
    if t.device.type == "cuda":
        return device_takes_kernels(t.device)
    if t.device.type == "meta":
        return _CAPTURED.get() is not None
    return _INTERPRETING.get() and t.device.type == "cpu"


def kernels_run_on(t: Tensor) -> bool:
    """Whether the kernels of the linear family's causal scan, skein, informer and reformer take inputs
    like ``t``: where :func:`triton_runs_on` says kernels run, in float16, bfloat16 or float32 on CUDA
    (float64 there takes the PyTorch GPU path), and in Triton's CPU interpreter in any dtype but bfloat16
    (whose ``tl.dot`` the interpreter of triton 3.9 gets wrong)."""
    if not triton_runs_on(t):
        return False
    if t.device.type in ("cuda", "meta"):  # meta: launches captured for a GPU (capture_launches)
        return t.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return t.dtype != torch.bfloat16


def float32_takes_pytorch_path(t: Tensor) -> bool:
    """Whether float32 inputs like ``t`` skip the block-sparse, linear-scan, reformer and skein kernels on a GPU
    for the PyTorch GPU path: compiled for sm_80 / sm_90 (``longattn bench compile``, docs/performance.md) their
    float32 ``input_precision="ieee"`` dots spill up to 92 KB per thread and take more than 60 s to compile;
    cuBLAS's float32 GEMMs of the PyTorch path are the faster float32 route. The interpreter (CPU) keeps running
    them in float32 for the tests."""
    return t.dtype == torch.float32 and t.device.type in ("cuda", "meta")


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


@dataclass
class Launch:
    """One kernel launch as a launcher made it: the ``triton.jit`` function and its arguments (tensors,
    scalars, constexprs and launch options such as ``num_warps``), as ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    args: tuple
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return self.kernel.__name__


@contextlib.contextmanager
def capture_launches() -> Iterator[list[Launch]]:
    """Inside ``with capture_launches() as launches:`` the mechanisms take their kernels on meta tensors
    (the GPU path forced with ``force_path("gpu")``), and every launch is appended to ``launches``
    instead of run; outputs stay meta. Needs triton's compiler (not its interpreter: TRITON_INTERPRET
    unset when the kernel modules were imported)."""
    if not triton_installed():
        raise RuntimeError("capture_launches needs triton: pip install 'longattn[triton]'")
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("capture_launches records compiled kernels: unset TRITON_INTERPRET (the interpreter's "
                           "kernels cannot be compiled for a GPU)")
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        captured = _CAPTURED.get()
        if captured is None:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        captured.append(Launch(self, args, kwargs))
        return None

    token = _CAPTURED.set(launches)
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original
        _CAPTURED.reset(token)
