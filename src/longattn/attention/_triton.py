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

Triton launches on the *current* CUDA device, not on its arguments' device: every launcher is decorated
with :func:`launches_on_input_device`, which makes its tensors' device current while it launches (a
captured launch records the device it was made under, so the AOT check sees a launcher that is not).

Every launch goes through :func:`launch`, which on a GPU first compares the shared memory the compiled kernel
needs per block with what the device has (a GPU with less than the A100 / H100 the tiles were chosen for:
99 KB on sm_86 / sm_89 / sm_120). A kernel that does not fit raises :class:`KernelDoesNotFit` before it is
launched; :func:`pytorch_path_where_kernels_do_not_fit` (a mechanism's GPU-path function) and
:func:`kernels_or_pytorch_path` (one step) turn that into the PyTorch GPU path, said once.
Autograd Functions check their backward kernels in their forward (:func:`check_backward`), where the PyTorch
path can still be taken.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Hashable, Iterator, TypeVar

import torch
from torch import Tensor

__all__ = ["MIN_CAPABILITY", "SHARED_MEMORY_PER_BLOCK", "Launch", "capture_launches", "device_takes_kernels",
           "KernelDoesNotFit", "check_backward", "float32_takes_pytorch_path", "interpret_triton",
           "kernels_or_pytorch_path", "kernels_run_on", "launch", "launch_device", "launches_on_input_device",
           "on_device", "pytorch_path_where_kernels_do_not_fit", "shared_memory_limit", "shared_memory_needed",
           "triton_importable", "triton_installed", "triton_runs_on", "use_triton"]

# The shared memory one block may use (the opt-in maximum), in bytes, by compute capability (major * 10 + minor;
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"): 163 KB on A100, 227 KB on
# H100 and B200, 99 KB on the sm_86 / sm_89 / sm_120 parts.
SHARED_MEMORY_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

_INTERPRETING: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_interpret_triton", default=False)
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_use_triton", default=True)
_CAPTURED: contextvars.ContextVar[list["Launch"] | None] = contextvars.ContextVar("longattn_capture_launches",
                                                                                  default=None)
_LAUNCH_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("longattn_launch_device",
                                                                                     default=None)
_CHECK_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_check_only", default=False)
# the launches a launcher made so far (their configuration keys: what check_backward remembers them by)
_LAUNCHED: contextvars.ContextVar[list[Hashable] | None] = contextvars.ContextVar("longattn_launched", default=None)
_Function = TypeVar("_Function", bound=Callable[..., Any])
_Result = TypeVar("_Result")


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
    """Whether float32 inputs like ``t`` skip the block-sparse, linear-scan, reformer, skein and skeleton-core
    kernels on a GPU for the PyTorch GPU path: compiled for sm_80 / sm_90 (``longattn bench compile``,
    docs/performance.md) their float32 ``input_precision="ieee"`` dots spill up to 92 KB per thread and take more
    than 60 s to compile (skeleton's core kernels at head dim 128 on sm_80);
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


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Kernels launched inside run on ``device``: a CUDA device is made current (``torch.cuda.device``), since
    triton launches on the current device and its stream, whatever device the arguments are on (tensors on
    cuda:1 with cuda:0 current would be read by a kernel running on cuda:0)."""
    token = _LAUNCH_DEVICE.set(device)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            yield
    finally:
        _LAUNCH_DEVICE.reset(token)


def launch_device() -> torch.device | None:
    """The device of the innermost :func:`on_device`; None outside any."""
    return _LAUNCH_DEVICE.get()


def launches_on_input_device(launcher: _Function) -> _Function:
    """Decorates a function that launches kernels (a launcher, an autograd Function's forward or backward): it
    runs :func:`on_device` the device of its first tensor argument (all its tensors are on one device)."""

    @functools.wraps(launcher)
    def launch_on_input_device(*args: Any, **kwargs: Any) -> Any:
        tensor = next((value for value in (*args, *kwargs.values()) if isinstance(value, Tensor)), None)
        if tensor is None:
            raise TypeError(f"{launcher.__qualname__} launches kernels but was given no tensor to take a device from")
        token = _LAUNCHED.set([])
        try:
            with on_device(tensor.device):
                return launcher(*args, **kwargs)
        finally:
            _LAUNCHED.reset(token)

    return launch_on_input_device  # type: ignore[return-value]


class KernelDoesNotFit(RuntimeError):
    """A kernel needs more shared memory per block than its device has (raised by :func:`launch` before it
    launches it)."""


def shared_memory_limit(device: torch.device) -> int:
    """The shared memory one block may use on the CUDA ``device`` (triton's driver: the opt-in maximum), bytes."""
    from triton.compiler.compiler import max_shared_mem

    return max_shared_mem(torch.cuda.current_device() if device.index is None else device.index)


def shared_memory_needed(kernel: Any, grid: tuple, args: tuple, kwargs: dict[str, Any]) -> int:
    """The shared memory per block of ``kernel`` compiled for these arguments, bytes (the compile is triton's
    own, cached: the launch after it reuses it)."""
    return kernel.warmup(*args, grid=grid, **kwargs).metadata.shared


def checks_shared_memory(device: torch.device | None) -> bool:
    """Whether launches on ``device`` are checked against its shared memory (CUDA: the interpreter and the
    captured launches have no limit)."""
    return device is not None and device.type == "cuda"


_FITS: set[Hashable] = set()  # configurations checked: the check compiles, and then only on a kernel's first launch


def _configuration(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> Hashable:
    """What a kernel's shared memory depends on: its dtypes, constexprs and launch options (not the sizes)."""
    return (kernel, tuple(str(a.dtype) if isinstance(a, Tensor) else None for a in args),
            tuple(sorted((k, v if isinstance(v, Hashable) else str(v)) for k, v in kwargs.items()
                         if not isinstance(v, Tensor))))


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, checked first (once per configuration) against the shared memory of the
    device it launches on (:func:`checks_shared_memory`): raises :class:`KernelDoesNotFit` instead of launching
    a kernel that needs more (triton would raise its OutOfResources from inside the launch). Inside
    :func:`check_backward` it checks without launching."""
    device = launch_device()
    configuration = (device, _configuration(kernel, args, kwargs))
    if checks_shared_memory(device) and configuration not in _FITS:
        needed, limit = shared_memory_needed(kernel, grid, args, kwargs), shared_memory_limit(device)
        if needed > limit:
            raise KernelDoesNotFit(f"the Triton kernel {kernel.__name__} needs {needed:,} B of shared memory per "
                                   f"block, {device} has {limit:,} B")
        _FITS.add(configuration)
    launched = _LAUNCHED.get()
    if launched is not None:
        launched.append(configuration)
    if not _CHECK_ONLY.get():
        kernel[grid](*args, **kwargs)


_BACKWARDS_CHECKED: set[Hashable] = set()


def check_backward(function: type[torch.autograd.Function], ctx: Any, saved: tuple, grads: tuple) -> None:
    """From ``function``'s forward (after its launches): checks every kernel its backward would launch on these
    saved tensors and output gradients (stand-ins of the right dtype: the outputs themselves), without launching
    any, so that a backward kernel that does not fit raises :class:`KernelDoesNotFit` while the mechanism can
    still take its PyTorch path. Once per configuration of the forward's launches; only where launches are
    checked (:func:`checks_shared_memory`)."""
    launched = _LAUNCHED.get()
    if not (checks_shared_memory(launch_device()) and any(ctx.needs_input_grad)) or launched is None:
        return
    key = (function, tuple(launched), tuple(None if t is None else str(t.dtype) for t in (*saved, *grads)))
    if key in _BACKWARDS_CHECKED:
        return
    stand_in = SimpleNamespace(**vars(ctx), saved_tensors=saved)
    token = _CHECK_ONLY.set(True)
    try:
        function.backward(stand_in, *grads)
    finally:
        _CHECK_ONLY.reset(token)
    _BACKWARDS_CHECKED.add(key)


def pytorch_path_where_kernels_do_not_fit(gpu_path: _Function) -> _Function:
    """Decorates a mechanism's GPU-path function that takes the Triton kernels where they run: where one of
    them (forward, or backward: :func:`check_backward`) does not fit the device's shared memory, the function
    runs again inside ``use_triton(False)``, its PyTorch GPU path, with a one-line warning once per reason. The
    random generators (CPU, and the inputs' GPU) are put back as they were before the attempt, so the PyTorch
    path draws what it would have drawn (samples, dropout) had it run first."""

    @functools.wraps(gpu_path)
    def gpu_path_that_fits(*args: Any, **kwargs: Any) -> Any:
        device = next((value.device for value in (*args, *kwargs.values()) if isinstance(value, Tensor)), None)
        on_gpu = device is not None and device.type == "cuda"
        states = torch.get_rng_state(), torch.cuda.get_rng_state(device) if on_gpu else None

        def pytorch_path() -> Any:
            torch.set_rng_state(states[0])
            if on_gpu:
                torch.cuda.set_rng_state(states[1], device)
            with use_triton(False):
                return gpu_path(*args, **kwargs)

        return kernels_or_pytorch_path(lambda: gpu_path(*args, **kwargs), pytorch_path)

    return gpu_path_that_fits  # type: ignore[return-value]


def kernels_or_pytorch_path(kernels: Callable[[], _Result], pytorch_path: Callable[[], _Result]) -> _Result:
    """``kernels()``, or ``pytorch_path()`` where one of its kernels does not fit the device's shared memory
    (:class:`KernelDoesNotFit`, raised before that kernel launched), with a one-line warning once per reason."""
    try:
        return kernels()
    except KernelDoesNotFit as exc:
        _say_once(f"{exc}: the mechanism runs its PyTorch GPU path")
        return pytorch_path()


@dataclass
class Launch:
    """One kernel launch as a launcher made it: the ``triton.jit`` function and its arguments (tensors,
    scalars, constexprs and launch options such as ``num_warps``), as ``kernel[grid](*args, **kwargs)``; and the
    device it was launched under (:func:`on_device`; None: outside any, a launcher that is not decorated)."""

    kernel: Any
    args: tuple
    kwargs: dict[str, Any]
    device: torch.device | None = None

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
        captured.append(Launch(self, args, kwargs, launch_device()))
        return None

    token = _CAPTURED.set(launches)
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original
        _CAPTURED.reset(token)
