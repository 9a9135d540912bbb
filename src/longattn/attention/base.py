"""The one interface every attention mechanism in longattn implements.

Conventions (documented once, used everywhere):

* Module form: ``module(x, attention_mask=None, layer_state=None)`` maps ``x`` of shape
  ``[B, N, dim]`` to ``[B, N, dim]``; projections are part of the module.
* Functional form: ``fn(query, key, value, attention_mask=None, **options)`` on
  ``[B, H, N, Dh]`` tensors, SDPA-like argument names.
* ``attention_mask`` is a **bool tensor of shape [B, N] where True marks a real token** and
  False marks padding (the Hugging Face convention). Padding may sit anywhere, not only at the
  end. Padded positions never influence real positions; the module form returns zeros at
  padded positions.
* Padded positions are *replaced* by zeros (never multiplied: NaN * 0 is NaN) before they enter
  any computation, in the module form (:meth:`AttentionBase.forward`) and in every functional
  form (:func:`padding_safe`), so any value there (NaN, inf, 1e30) leaves real outputs and
  gradients unchanged, and padded positions come out as zeros.
* Dtypes: the module form raises :class:`AttentionError` when the input's dtype differs from its
  parameters' (convert one of them), except under ``torch.autocast``, which casts per operation.
* An empty batch (B = 0) gives an empty result of the same shape.
* ``with check_finite():`` turns on an opt-in check that raises on NaN or inf at real positions
  of any attention input (off by default: the check reads the tensors back, a GPU sync).
* Auxiliary losses (e.g. Singularformer's orthogonality losses) are recorded by the module
  with :meth:`AttentionBase.add_aux_loss` during a training forward pass and read (and
  cleared) by the training loop with :func:`collect_aux_losses`. Each forward pass replaces
  the module's previous losses, so nothing is ever counted twice.
* State that flows between the layers of one model (e.g. Singularformer's residual of raw
  attention scores) goes through ``layer_state``: a dict the model creates once per forward
  pass and hands to every attention layer in order.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import Tensor, nn

__all__ = [
    "AttentionBase",
    "AttentionError",
    "Capabilities",
    "MechanismSpec",
    "available",
    "build",
    "capabilities",
    "collect_aux_losses",
    "get_spec",
    "register_attention",
    "check_attention_mask",
    "check_finite",
    "check_qkv",
    "padding_safe",
    "compute_dtype",
    "allow_tf32",
    "autocast_disabled",
    "autocast_state",
    "exact_float32",
    "exact_float32_op",
    "force_path",
    "full_float32",
    "output_dtype",
    "recomputed",
    "restored_autocast",
    "uses_gpu_path",
    "AttentionMap",
    "record_attention_maps",
    "split_heads",
    "merge_heads",
]


class AttentionError(ValueError):
    """Raised for any misuse of an attention mechanism: bad shapes, masks, options or lengths."""


@dataclass(frozen=True)
class Capabilities:
    """What a mechanism can do; the harness reads this to skip what does not apply.

    Attributes:
        causal: supports autoregressive (causal) masking.
        needs_max_len: must be built with ``max_len`` and accepts only ``N <= max_len``.
        stochastic_eval: output is random even in ``eval()`` mode (e.g. Skeinformer redraws
            its samples every call); seed the global RNG for reproducible outputs.
        aux_losses: records auxiliary training losses (see :func:`collect_aux_losses`).
        subquadratic: promises no N x N intermediate in forward or backward.
        uses_layer_state: reads/writes ``layer_state`` to talk to neighbouring layers.
        max_seq_len: hard upper bound on N independent of ``max_len`` (None: unbounded).
        replaces_ffn: the layer is attention and feed-forward network in one (FLASH's GAU);
            models leave out their own FFN around it.
        sequence_parallel: has an exact sequence-parallel form in :mod:`longattn.parallel` (one
            sequence split across processes, equal to the single-process result).
        attention_map: can hand its n x n attention matrix to :func:`record_attention_maps`
            (analysis only, in eval mode).
        decode_state: how the causal form decodes one token at a time (:meth:`AttentionBase.prefill`,
            :meth:`AttentionBase.step`; see :mod:`longattn.attention.decoding`): ``"recurrent"`` (running
            sums, O(1) per token), ``"window"`` (a sliding window of keys and values, O(window)),
            ``"chunked"`` (the current chunk or window plus a summary of the earlier ones), ``"kv_cache"``
            (every key and value, O(N)), ``"recompute"`` (the causal forward over the cached prefix, for a
            mechanism without an incremental form); ``""``: no decoding state (not causal). Declared by
            the class attribute of the same name.
        compile_backends: the ``torch.compile`` backends under which the module form trains (forward and
            backward, graph breaks allowed) with eager's output and gradients; tests/attention/test_compile.py
            runs a training step of every mechanism under each backend it declares (``inductor`` with
            ``LONGATTN_TEST_INDUCTOR=1``: on a CPU it compiles C++ for every graph). Empty: the module form
            does not compile, and calling it under ``torch.compile`` raises :class:`AttentionError`. A
            stochastic mechanism under ``inductor`` draws other random numbers than eager unless
            ``torch._inductor.config.fallback_random`` is set (inductor's own generator).
    """

    causal: bool = False
    needs_max_len: bool = False
    stochastic_eval: bool = False
    aux_losses: bool = False
    subquadratic: bool = True
    uses_layer_state: bool = False
    max_seq_len: int | None = None
    replaces_ffn: bool = False
    sequence_parallel: bool = False
    attention_map: bool = False
    decode_state: str = ""
    compile_backends: tuple[str, ...] = ("aot_eager", "inductor")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class MechanismSpec:
    """Registry entry for one mechanism."""

    name: str
    module_cls: type["AttentionBase"]
    capabilities: Capabilities
    functional: Callable[..., Tensor] | None = None
    reference: Callable[..., Tensor] | None = None
    paper: str = ""
    description: str = ""
    option_names: tuple[str, ...] = field(default_factory=tuple)


_REGISTRY: dict[str, MechanismSpec] = {}


def register_attention(
    name: str,
    *,
    capabilities: Capabilities,
    functional: Callable[..., Tensor] | None = None,
    reference: Callable[..., Tensor] | None = None,
    paper: str = "",
    description: str = "",
) -> Callable[[type["AttentionBase"]], type["AttentionBase"]]:
    """Class decorator that adds an :class:`AttentionBase` subclass to the registry.

    ``functional`` is the fast functional core on [B, H, N, Dh] (if the mechanism has one) and
    ``reference`` a plain, readable, float64-friendly version of the same computation used by
    the tests to check the fast path.
    """

    def decorator(cls: type[AttentionBase]) -> type[AttentionBase]:
        if name in _REGISTRY:
            raise AttentionError(f"attention mechanism {name!r} is registered twice")
        if not issubclass(cls, AttentionBase):
            raise TypeError(f"{cls.__name__} must subclass AttentionBase")
        cls.name = name
        declared = capabilities
        if cls.decode_state:  # declared next to the decoding methods it names
            declared = replace(capabilities, decode_state=cls.decode_state)
        cls.capabilities = declared
        _REGISTRY[name] = MechanismSpec(
            name=name,
            module_cls=cls,
            capabilities=declared,
            functional=functional,
            reference=reference,
            paper=paper,
            description=description or (inspect.getdoc(cls) or "").split("\n")[0],
            option_names=_option_names(cls),
        )
        return cls

    return decorator


def _option_names(cls: type) -> tuple[str, ...]:
    params = inspect.signature(cls.__init__).parameters
    skip = {"self", "dim", "heads", "max_len", "causal"}
    return tuple(
        p for p, v in params.items() if p not in skip and v.kind is not inspect.Parameter.VAR_KEYWORD
    )


def _ensure_loaded() -> None:
    # Importing the package registers every mechanism module it contains.
    import longattn.attention  # noqa: F401


def available() -> list[str]:
    """Names of all registered attention mechanisms, sorted."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def get_spec(name: str) -> MechanismSpec:
    """The registry entry of ``name``; raises a clear error listing the valid names."""
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AttentionError(
            f"unknown attention mechanism {name!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None


def capabilities(name: str) -> Capabilities:
    return get_spec(name).capabilities


def build(
    name: str,
    dim: int,
    heads: int,
    max_len: int | None = None,
    causal: bool = False,
    **options: Any,
) -> "AttentionBase":
    """Build attention mechanism ``name`` as an ``nn.Module`` mapping [B, N, dim] -> [B, N, dim].

    Unknown options and unsupported uses (causal on a non-causal method, a missing ``max_len``
    where one is needed) raise :class:`AttentionError` instead of being ignored.
    """
    spec = get_spec(name)
    caps = spec.capabilities
    if causal and not caps.causal:
        raise AttentionError(f"attention {name!r} does not support causal masking")
    if caps.needs_max_len and max_len is None:
        raise AttentionError(f"attention {name!r} needs a fixed max_len; pass max_len=...")
    unknown = sorted(set(options) - set(spec.option_names))
    if unknown:
        raise AttentionError(
            f"unknown option(s) {unknown} for attention {name!r}; valid options: "
            f"{', '.join(spec.option_names) or '(none)'}"
        )
    return spec.module_cls(dim=dim, heads=heads, max_len=max_len, causal=causal, **options)


def collect_aux_losses(model: nn.Module, clear: bool = True) -> dict[str, Tensor]:
    """Sum the auxiliary losses recorded by every attention layer of ``model`` in its last forward.

    Returns a dict ``{loss name: scalar tensor}`` (empty when no layer recorded any, e.g. in
    eval mode). The training loop adds ``sum(collect_aux_losses(model).values())`` to the task
    loss, for every model, whatever its attention.
    """
    totals: dict[str, Tensor] = {}
    for module in model.modules():
        if isinstance(module, AttentionBase):
            for key, value in module._aux_losses.items():
                totals[key] = totals[key] + value if key in totals else value
            if clear:
                module._aux_losses = {}
    return totals


# ----------------------------------------------------------------------------- checks


def check_attention_mask(mask: Tensor | None, batch: int, length: int, device: torch.device) -> None:
    """Validate a key padding mask: bool [B, N], True = real token."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise AttentionError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise AttentionError(
            f"attention_mask must be bool (True = real token, False = padding), got {mask.dtype}"
        )
    if mask.shape != (batch, length):
        raise AttentionError(
            f"attention_mask must have shape [B, N] = [{batch}, {length}], got {list(mask.shape)}"
        )
    if mask.device != device:
        raise AttentionError(f"attention_mask is on {mask.device} but the input is on {device}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate sums, norms and statistics in: float32 for half inputs (whose range
    and precision do not hold them), the input's own dtype otherwise (float64 stays float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ----------------------------------------------------------------------------- per-device paths

# "gpu" / "cpu" while force_path() is active, None otherwise (the input's device decides).
_FORCED_PATH: contextvars.ContextVar[str | None] = contextvars.ContextVar("longattn_forced_path", default=None)
_PATHS = ("cpu", "gpu")


def uses_gpu_path(t: Tensor) -> bool:
    """Whether a mechanism runs its GPU path on ``t``.

    The CPU paths (tiles sized for caches, Python loops over blocks and chunks) and the GPU paths
    (batched tensor programs with no Python loop over batch, heads, tiles, blocks or chunks;
    autocast-native) compute the same numbers in different shapes. The input's device picks one:
    CUDA tensors take the GPU path, every other device the CPU path, unless :func:`force_path` says
    otherwise (the tests run the GPU path on CPU and meta tensors, comparing it with the float64
    reference and counting the aten ops it dispatches).
    """
    forced = _FORCED_PATH.get()
    if forced is not None:
        return forced == "gpu"
    return t.device.type == "cuda"


@contextlib.contextmanager
def force_path(kind: str) -> Iterator[None]:
    """Inside ``with force_path("gpu"):`` every mechanism runs its GPU path whatever the device
    (``"cpu"``: the CPU path, e.g. to compare the two on CUDA)."""
    if kind not in _PATHS:
        raise AttentionError(f"force_path takes one of {_PATHS}, got {kind!r}")
    token = _FORCED_PATH.set(kind)
    try:
        yield
    finally:
        _FORCED_PATH.reset(token)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Inside ``with full_float32():`` float32 matrix products and convolutions on CUDA run in float32:
    TF32 is switched off for cuBLAS matmuls and cuDNN convolutions (cuDNN's default is TF32, which
    rounds the factors to 10 mantissa bits), and both settings are restored on exit. The settings are
    process-wide, so a mechanism enters it around its own products, in forward and in backward (which
    autograd may run on another thread). Without CUDA it changes nothing observable."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def output_dtype(t: Tensor) -> torch.dtype:
    """The dtype a mechanism returns for an input like ``t``: the autocast dtype inside
    ``torch.autocast`` on ``t``'s device (as SDPA does), ``t``'s own dtype otherwise."""
    device_type = t.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


AutocastState = tuple[str, bool, torch.dtype]


def autocast_state(device: torch.device) -> AutocastState:
    """Autocast as it is now on ``device`` (off on devices autocast does not know, ``meta`` included), for a
    hand-written backward to restore with :func:`restored_autocast` (backward runs outside the forward's autocast)."""
    if device.type not in ("cpu", "cuda"):
        return device.type, False, torch.float32
    return device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def restored_autocast(state: AutocastState) -> contextlib.AbstractContextManager:
    """Autocast as :func:`autocast_state` saw it (a no-op where it was off)."""
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype) if enabled else contextlib.nullcontext()


def autocast_disabled(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` for a block that must run in its inputs' own dtype (a small float32 solve
    under a bfloat16 autocast); a no-op where autocast is off or does not exist (``meta``)."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` whose intermediates are recomputed in backward instead of kept (``torch.utils.checkpoint``,
    non-reentrant, without the RNG state: ``fn`` draws nothing). The recomputation runs under the forward's
    autocast, as checkpoint arranges, and under the torch function modes active in the forward, which the
    autograd engine drops (``with torch.device(...)``, :class:`longattn.testing.CudaAutocastOnCPU`): without
    them it could save tensors of other dtypes than the forward did, which checkpoint rejects. Under
    ``torch.compile`` the recomputation is part of the traced graph, where the modes are traced as well, and
    dynamo traces checkpoint only without a ``context_fn``: the plain checkpoint."""
    from torch.overrides import _get_current_function_mode_stack  # torch has no public reader of the stack
    from torch.utils.checkpoint import checkpoint

    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    modes = _get_current_function_mode_stack()

    @contextlib.contextmanager
    def modes_again() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            yield

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), modes_again()

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=contexts)


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward copies the gradient into a contiguous tensor (see :func:`contiguous_gradient`)."""

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:  # type: ignore[override]
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        # a copy, not .contiguous(): the trace believes the gradient contiguous already and would drop the call
        return grad.clone(memory_format=torch.contiguous_format)


def contiguous_gradient(t: Tensor) -> Tensor:
    """``t``, with its gradient made contiguous in backward. Where an elementwise op's gradient comes back in a layout
    that the CPU kernel and its meta function (``torch.compile``'s tracing) choose differently (softplus' backward
    with a transposed incoming gradient), AOT autograd traces the reshape that follows as a view, which then fails
    on the kernel's real strides: wrapped, the op's input gets a gradient of one layout in both."""
    return _ContiguousGradient.apply(t)


# ----------------------------------------------------------------------------- what float32 means on CUDA

# True inside allow_tf32(): the library's own convolutions may use TF32 like cuDNN's default.
_ALLOW_TF32: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_allow_tf32", default=False)


@contextlib.contextmanager
def allow_tf32(enabled: bool = True) -> Iterator[None]:
    """Inside ``with allow_tf32():`` the library's own convolutions run as cuDNN's default has them on
    Ampere and later GPUs: float32 inputs multiplied in TF32 (10-bit mantissa, about 1e-3 relative error,
    faster). Outside it they are IEEE float32 (see :func:`exact_float32`)."""
    token = _ALLOW_TF32.set(enabled)
    try:
        yield
    finally:
        _ALLOW_TF32.reset(token)


def _needs_exact_float32(tensors: tuple[Any, ...]) -> bool:
    return not _ALLOW_TF32.get() and any(
        isinstance(t, Tensor) and t.dtype == torch.float32 and uses_gpu_path(t) for t in tensors)


@contextlib.contextmanager
def exact_float32(*tensors: Any) -> Iterator[None]:
    """What float32 means in the library on CUDA: IEEE float32, as on a CPU.

    PyTorch's float32 matmuls are IEEE by default (``torch.get_float32_matmul_precision() == "highest"``;
    a user who sets "high" opts every matmul, projections included, into TF32 knowingly, and the library
    follows that setting). cuDNN's convolutions are not: their TF32 default turns a float32 convolution
    into one with ~1e-3 relative error. Inside this block, when one of ``tensors`` is float32 on the GPU
    path, the convolutions run with TF32 off (the flag is set back afterwards); elsewhere, on CPU tensors
    and inside :func:`allow_tf32`, it does nothing.

    It covers what runs inside the block: hand-written backward passes enter it again; for code whose
    backward autograd builds (it runs later, outside the block), use :func:`exact_float32_op`.
    """
    with _ieee_convolutions() if _needs_exact_float32(tensors) else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _ieee_convolutions() -> Iterator[None]:
    """cuDNN's TF32 off for convolutions, set back afterwards."""
    cudnn = torch.backends.cudnn
    try:
        saved: Any = cudnn.allow_tf32  # the legacy flag, which defaults and most users set
    except RuntimeError:  # the user set TF32 through the per-operator API: use it too, not the legacy flag
        saved = None
    if saved is None:
        previous = cudnn.conv.fp32_precision
        cudnn.conv.fp32_precision = "ieee"
    else:
        cudnn.allow_tf32 = False
    try:
        yield
    finally:
        if saved is None:
            cudnn.conv.fp32_precision = previous
        else:
            cudnn.allow_tf32 = saved


class _ExactFloat32(torch.autograd.Function):
    """``fn(*inputs)`` with TF32 off for convolutions, and its backward (autograd's, through the subgraph
    that ``fn`` built) again so (:func:`exact_float32_op` applies it only where that block is wanted)."""

    @staticmethod
    def forward(ctx, fn: Callable[..., Tensor], *inputs: Any) -> Tensor:  # type: ignore[override]
        leaves = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, Tensor) and t.is_floating_point()
                  else t for t in inputs]
        with torch.enable_grad(), _ieee_convolutions():
            out = fn(*leaves)
        ctx.leaves, ctx.out = leaves, out
        return out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        wanted = [t for t in ctx.leaves if isinstance(t, Tensor) and t.requires_grad]
        with _ieee_convolutions():
            got = iter(torch.autograd.grad(ctx.out, wanted, grad, allow_unused=True) if ctx.out.requires_grad
                       else [None] * len(wanted))
        return (None, *(next(got) if isinstance(t, Tensor) and t.requires_grad else None for t in ctx.leaves))


def exact_float32_op(fn: Callable[..., Tensor], *inputs: Any) -> Tensor:
    """``fn(*inputs)`` with :func:`exact_float32` around its forward and its backward. Everything ``fn``
    differentiates must be among ``inputs`` (pass parameters too); where the block would do nothing
    (CPU path, no float32 input, :func:`allow_tf32`) it is a plain call."""
    if not _needs_exact_float32(inputs):
        return fn(*inputs)
    return _ExactFloat32.apply(fn, *inputs)


def check_qkv(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> None:
    """Validate functional-form inputs: [B, H, N, Dh] floating tensors with matching shapes."""
    for label, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise AttentionError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionError(f"{label} must be 4-D [B, H, N, Dh], got shape {list(t.shape)}")
        if not t.is_floating_point():
            raise AttentionError(f"{label} must be a floating-point tensor, got {t.dtype}")
    if key.shape[:3] != value.shape[:3] or query.shape[:2] != key.shape[:2]:
        raise AttentionError(
            "query, key and value must agree on [B, H] and key/value on N: got "
            f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise AttentionError(
            f"query and key head dims differ: {query.shape[-1]} vs {key.shape[-1]}"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionError(f"query, key, value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    check_attention_mask(attention_mask, key.shape[0], key.shape[2], key.device)


_CHECK_FINITE: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_check_finite", default=False)
# True while a module's forward runs: its input is already masked, so functional forms called
# inside it (on projections of that input) need not mask again.
_INPUT_MASKED: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_input_masked", default=False)


@contextlib.contextmanager
def check_finite(enabled: bool = True):
    """Opt-in check mode: inside ``with check_finite():`` every attention layer and functional form
    raises :class:`AttentionError` when a real (unpadded) input position holds NaN or inf.

    Off by default because the check reads the values back (a device synchronisation on GPUs);
    padded positions are never checked, whatever they hold.
    """
    token = _CHECK_FINITE.set(enabled)
    try:
        yield
    finally:
        _CHECK_FINITE.reset(token)


def _raise_if_not_finite(label: str, t: Tensor, token_dim: int) -> None:
    """``t`` is already masked (padded positions are zeros); raise naming the first bad position."""
    bad = ~torch.isfinite(t)
    if bad.any():
        index = bad.nonzero()[0].tolist()
        raise AttentionError(
            f"{label} holds a non-finite value ({t[tuple(index)].item()}) at a real position "
            f"(batch {index[0]}, token {index[token_dim]}); check_finite mode is on"
        )


def padding_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of a functional form ``fn(query, key, value, attention_mask=None, **options)``.

    Its sequence tensors (the positional parameters before ``attention_mask``) are replaced by
    zeros at padded positions before ``fn`` sees them, and the output rows of padded queries are
    returned as zeros; in check-finite mode their real positions are checked. The key mask applies
    to the queries too when they have the keys' length (self-attention, the library's convention);
    queries of another length are left as they are. Inside a module's forward, whose input is
    already masked, and inside another functional form, it adds no work.
    """
    signature = inspect.signature(fn)
    parameters = list(signature.parameters)
    sequence_names = parameters[: parameters.index("attention_mask")]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _INPUT_MASKED.get():
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        mask = bound.arguments.get("attention_mask")
        usable = isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() == 2
        masked_names = []
        for name in sequence_names:
            t = bound.arguments.get(name)
            if not (isinstance(t, Tensor) and t.is_floating_point() and t.dim() == 4):
                continue  # fn's own checks give the clear error
            if usable and (t.shape[0], t.shape[2]) == tuple(mask.shape) and t.device == mask.device:
                t = t.masked_fill(~mask[:, None, :, None], 0.0)
                bound.arguments[name] = t
                masked_names.append(name)
            if _CHECK_FINITE.get():
                _raise_if_not_finite(name, t, token_dim=2)
        token = _INPUT_MASKED.set(True)  # functional forms that fn calls see masked inputs
        try:
            out = fn(*bound.args, **bound.kwargs)
        finally:
            _INPUT_MASKED.reset(token)
        queries = bound.arguments.get(sequence_names[0])
        if not masked_names or not (queries is None or sequence_names[0] in masked_names):
            return out  # no mask, or queries of another length than the keys: no padded query rows
        keep = mask[:, None, :, None]
        if isinstance(out, tuple):
            return (out[0].masked_fill(~keep, 0.0), *out[1:])
        return out.masked_fill(~keep, 0.0) if isinstance(out, Tensor) else out

    return wrapper


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[B, N, H*Dh] -> [B, H, N, Dh]."""
    b, n, d = x.shape
    return x.view(b, n, heads, d // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """[B, H, N, Dh] -> [B, N, H*Dh]."""
    b, h, n, dh = x.shape
    return x.transpose(1, 2).reshape(b, n, h * dh)


def budget_slices(count: int, item_elements: int, budget: int) -> list[slice]:
    """Consecutive slices of ``count`` items (batch rows, heads) of ``item_elements`` elements each, each slice
    holding at most ``budget`` elements (at least one item): the groups a cache- or memory-bounded loop takes."""
    size = max(1, budget // max(1, item_elements))
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


# ----------------------------------------------------------------------------- base module


def _refuse_compile(name: str) -> None:
    """Called through torch.compiler.disable (at the call, not as a decorator: that would import dynamo with the
    library): raised from eager code, since an error raised while dynamo traces only makes it run the frame
    eagerly."""
    raise AttentionError(
        f"attention {name!r} does not run under torch.compile (its capabilities.compile_backends is empty); keep "
        "the layer out of the compiled region with torch.compiler.disable(layer), or choose a mechanism whose "
        "capabilities(name).compile_backends names your backend")


class AttentionBase(nn.Module):
    """Base class of every mechanism's module form.

    Subclasses implement :meth:`attend` (inputs already validated) and usually build their
    projections in ``__init__`` (see :class:`QKVProjection`). ``forward`` validates the input,
    calls ``attend`` and zeroes the outputs at padded positions.
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()
    decode_state: str = ""  # see Capabilities.decode_state; set by the classes that implement the decoding hooks

    def __init__(self, dim: int, heads: int, max_len: int | None = None, causal: bool = False) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim <= 0:
            raise AttentionError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(heads, int) or heads <= 0:
            raise AttentionError(f"heads must be a positive int, got {heads!r}")
        if dim % heads:
            raise AttentionError(f"dim ({dim}) must be divisible by heads ({heads})")
        if max_len is not None and (not isinstance(max_len, int) or max_len <= 0):
            raise AttentionError(f"max_len must be a positive int or None, got {max_len!r}")
        if causal and not self.capabilities.causal:
            raise AttentionError(f"attention {self.name!r} does not support causal masking")
        self.dim = dim
        self.heads = heads
        self.head_dim = dim // heads
        self.max_len = max_len
        self.causal = causal
        self._aux_losses: dict[str, Tensor] = {}
        self._map_records: list[AttentionMap] | None = None  # set by record_attention_maps only

    # -- hooks for subclasses ------------------------------------------------------------
    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        raise NotImplementedError

    def add_aux_loss(self, name: str, value: Tensor) -> None:
        """Record an auxiliary loss of this forward pass (summed over layers by collect_aux_losses)."""
        self._aux_losses[name] = value

    @property
    def recording_maps(self) -> bool:
        """True inside :func:`record_attention_maps`: the mechanism then materialises its map."""
        return self._map_records is not None

    def record_map(self, weights: Tensor, value: Tensor, attention_mask: Tensor | None) -> None:
        """Hand this forward's attention matrix [B, H, N, N] and the per-head values [B, H, N, Dh]
        it multiplies to the recorder; rows and columns of padded tokens are zeroed."""
        if attention_mask is not None:
            real = attention_mask[:, None, :, None]
            weights = weights.masked_fill(~real, 0.0).masked_fill(~real.transpose(-1, -2), 0.0)
        self._map_records.append(AttentionMap(self, weights.detach(), value.detach()))

    # -- public ----------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        layer_state: dict | None = None,
    ) -> Tensor:
        return self.forward_with(self.attend, x, attention_mask, layer_state)

    def forward_with(
        self,
        attend: Callable[[Tensor, Tensor | None, dict | None], Tensor],
        x: Tensor,
        attention_mask: Tensor | None = None,
        layer_state: dict | None = None,
    ) -> Tensor:
        """:meth:`forward` around another ``attend`` of the same signature: the input checks, the
        padding replacement and the zeroed padded outputs (longattn.parallel runs a layer's
        sequence-parallel form through it)."""
        if not self.capabilities.compile_backends and torch.compiler.is_compiling():
            torch.compiler.disable(_refuse_compile)(self.name)
        self.check_input(x, attention_mask)
        if self.recording_maps and self.training:
            raise AttentionError("attention maps are recorded for analysis only: call model.eval() first")
        self._aux_losses = {}
        if x.shape[0] == 0:
            return x.clone()  # an empty batch: an empty result of the same shape
        if attention_mask is not None:
            # Replaced, not multiplied: NaN * 0 is NaN, so a multiplied inf/nan would still leak.
            x = x.masked_fill(~attention_mask.unsqueeze(-1), 0.0)
        if _CHECK_FINITE.get():
            _raise_if_not_finite("input", x, token_dim=1)
        token = _INPUT_MASKED.set(True)
        try:
            out = attend(x, attention_mask, layer_state)
        finally:
            _INPUT_MASKED.reset(token)
        if attention_mask is not None:
            out = out.masked_fill(~attention_mask.unsqueeze(-1), 0.0)
        return out

    def forward_packed(self, x: Tensor, *, cu_seqlens: Tensor | None = None, position_ids: Tensor | None = None,
                       attention_mask: Tensor | None = None, layer_state: dict | None = None) -> Tensor:
        """The forward of packed sequences ``x`` [B, N, dim] (several sequences per row, given by ``cu_seqlens`` or
        restarting ``position_ids``), each computed on its own; see :mod:`longattn.attention.packing`."""
        from longattn.attention.packing import forward_packed

        return forward_packed(self, x, cu_seqlens=cu_seqlens, position_ids=position_ids,
                              attention_mask=attention_mask, layer_state=layer_state)

    # -- decoding one token at a time (longattn.attention.decoding) ----------------------------
    def prefill(self, x: Tensor, attention_mask: Tensor | None = None,
                layer_state: dict | None = None) -> tuple[Tensor, Any]:
        """The causal forward over a prompt ``x`` [B, N, dim] and the state that :meth:`step` continues
        from: ``(output [B, N, dim], state)``. Needs ``causal=True`` and ``capabilities.decode_state``."""
        from longattn.attention.decoding import prefill

        return prefill(self, x, attention_mask, layer_state)

    def step(self, x: Tensor, state: Any, attention_mask: Tensor | None = None,
             layer_state: dict | None = None) -> tuple[Tensor, Any]:
        """One new token ``x`` [B, 1, dim] (``attention_mask`` [B, 1], True = real) after the tokens
        ``state`` holds: ``(output [B, 1, dim], state)``, the output equal to the last row of the causal
        forward over all of them. The state is updated in place and returned."""
        from longattn.attention.decoding import step

        return step(self, x, state, attention_mask, layer_state)

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, Any]:
        """Hook of :meth:`prefill` on checked, masked input: (output, state). By default the projections
        around :meth:`prefill_heads`."""
        q, k, v = self.proj.qkv(x)
        out, state = self.prefill_heads(q, k, v, attention_mask, layer_state)
        return self.proj.out(out), state

    def step_attend(self, x: Tensor, state: Any, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, Any]:
        """Hook of :meth:`step` (``real``: [B] bool, or None when every new token is real); by default
        the projections around :meth:`step_heads`."""
        q, k, v = self.proj.qkv(x)
        out, state = self.step_heads(q, k, v, state, real, layer_state)
        return self.proj.out(out), state

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{self.name!r} has no decoding state")

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: Any, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{self.name!r} has no decoding state")

    def check_input(self, x: Tensor, attention_mask: Tensor | None) -> None:
        if not isinstance(x, Tensor):
            raise AttentionError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise AttentionError(f"input must be [B, N, dim], got shape {list(x.shape)}")
        if not x.is_floating_point():
            raise AttentionError(f"input must be floating point, got {x.dtype}")
        b, n, d = x.shape
        if d != self.dim:
            raise AttentionError(f"input feature size {d} does not match dim={self.dim}")
        if n == 0:
            raise AttentionError("input has zero tokens")
        if self.max_len is not None and self.capabilities.needs_max_len and n > self.max_len:
            raise AttentionError(
                f"sequence length {n} exceeds max_len={self.max_len} of this {self.name!r} layer"
            )
        limit = self.capabilities.max_seq_len
        if limit is not None and n > limit:
            raise AttentionError(f"{self.name!r} supports sequences up to {limit} tokens, got {n}")
        check_attention_mask(attention_mask, b, n, x.device)
        param_dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), None)
        if param_dtype not in (None, x.dtype) and not torch.is_autocast_enabled(x.device.type):
            raise AttentionError(
                f"input dtype {x.dtype} differs from the {param_dtype} parameters of this {self.name!r} "
                f"layer; convert one of them (layer.to({x.dtype}) or x.to({param_dtype})) or run "
                "under torch.autocast"
            )

    def extra_repr(self) -> str:
        return f"name={self.name!r}, dim={self.dim}, heads={self.heads}, max_len={self.max_len}"


class AttentionMap(NamedTuple):
    """One layer's attention matrix in one forward pass, materialised for analysis only.

    ``weights @ value`` is the layer's per-head output before its output projection (the tests
    check it against the mechanism's own output): ``weights`` [B, H, N, N] (row = query, zeros at
    padded rows and columns), ``value`` [B, H, N, Dh].
    """

    layer: AttentionBase
    weights: Tensor
    value: Tensor


@contextlib.contextmanager
def record_attention_maps(model: nn.Module) -> Iterator[list[AttentionMap]]:
    """Inside ``with record_attention_maps(model) as maps:`` every attention layer of ``model``
    appends an :class:`AttentionMap` to ``maps`` at each forward call, in call order.

    The n x n matrices exist only here, for analyses on lengths where they fit; training never
    builds them (recording refuses a model in training mode). Mechanisms declare the ability as
    ``Capabilities.attention_map``; a model with another mechanism raises :class:`AttentionError`.
    """
    layers = [m for m in model.modules() if isinstance(m, AttentionBase)]
    if not layers:
        raise AttentionError(f"{type(model).__name__} has no attention layer to record")
    unable = sorted({m.name for m in layers if not m.capabilities.attention_map})
    if unable:
        able = sorted(n for n in available() if capabilities(n).attention_map)
        raise AttentionError(f"attention {unable} cannot hand out attention maps; mechanisms that can: {able}")
    if any(m.training for m in layers):
        raise AttentionError("attention maps are recorded for analysis only: call model.eval() first")
    records: list[AttentionMap] = []
    for layer in layers:
        layer._map_records = records
    try:
        yield records
    finally:
        for layer in layers:
            layer._map_records = None


class QKVProjection(nn.Module):
    """Linear maps to queries, keys and values split into heads, and the output projection."""

    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(dim, dim, bias=bias)
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (
            split_heads(self.to_q(x), self.heads),
            split_heads(self.to_k(x), self.heads),
            split_heads(self.to_v(x), self.heads),
        )

    def out(self, heads_out: Tensor) -> Tensor:
        return self.to_out(merge_heads(heads_out))
