"""Decoding one token at a time: the state every causal mechanism carries from token to token.

The API is two methods of every causal module (declared by ``Capabilities.decode_state``)::

    out, state = layer.prefill(prompt, attention_mask)     # [B, N, dim]: the causal forward, and its state
    out, state = layer.step(token, state, token_mask)      # [B, 1, dim]: one more token

``step``'s output is the last row of the causal forward over every token so far (the tests check it in
float64 against the full forward, as flash-linear-attention checks its recurrent form against its chunked
one). Positions are array positions: a left-padded row's padding counts, as it does in the full forward.
What a state holds, by kind:

* ``recurrent`` (O(1) per token): running sums. Linear attention and Performer keep sum_j phi(k_j) [v_j, 1]
  (eq. 8-9 of Katharopoulos et al., the recurrent form of the causal prefix sums); Performer also keeps the
  keys' stabiliser, the running maximum of their exponents, and rescales the sums when it grows (it cancels
  in the normalised output, as the stabiliser of the full forward does). cosFormer keeps the same sums of
  its position-weighted features (eq. 10), which needs a fixed M (``max_positions``): with M = N every new
  token would re-weight the whole prefix. Luna keeps its two packed sums and the count of real tokens.
* ``window`` (O(window)): the keys and values a query can still reach. Local attention: the last
  ``window_size * look_backward`` tokens (block-aligned windows: ``(look_backward + 1) * window_size - 1``);
  Longformer: the last ``dilation * attention_window / 2`` tokens, the global tokens, and the global
  projections of every token only while a global position still lies ahead.
* ``chunked``: Transformer-LS: its window of ``window_size`` tokens, the tokens of the chunk being filled
  and the compressed keys/values of the completed chunks (the paper's O(w + N r / l) per token);
  FLASH: the tokens of the current chunk and the linear-attention sum over the completed ones.
* ``kv_cache`` (O(N)): softmax, RealFormer (whose score row flows to the next layer through
  ``layer_state``, as in the full forward) and Synthesizer (its synthetic row of the new token).
* ``recompute``: Reformer has no incremental form (its hash buckets are drawn afresh at every call and
  their number follows N): each step runs the causal forward over the cached prefix and keeps its last row.

States hold tensors with the batch first and ``length``, the positions consumed; ``select`` and
``repeat_interleave`` reorder or widen the batch (beam search, several samples per prompt).

A state knows whose it is: :func:`prefill` stamps it with a :class:`StateOwner` (the mechanism, the layer, the
settings that shape the state, the batch, dtype and device of the prompt), whatever the mechanism's hook built,
and :func:`step` compares it with the layer and the token it is given, raising :class:`AttentionError` that
names the field, the expected and the given value: a state stepped by another layer would otherwise be
accepted (another layer's weights) or fail deep inside torch. The comparisons read metadata only, never a
tensor's values, so they add no host synchronisation to a step. Two documented ways change the owner on
purpose: ``state.to(device=..., dtype=...)`` moves a state, ``state.copy_for(layer)`` hands a copy to another
layer of the same mechanism and settings (a copy of the model, say).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import _INPUT_MASKED, AttentionBase, AttentionError, capabilities, get_spec

__all__ = [
    "DECODE_KINDS",
    "DecodingState",
    "KVState",
    "RecurrentState",
    "StateOwner",
    "WindowState",
    "attend_keys",
    "decoding_names",
    "prefill",
    "step",
]

DECODE_KINDS = ("recurrent", "window", "chunked", "kv_cache", "recompute")


def decoding_names() -> list[str]:
    """The mechanisms with a decoding state (every causal one)."""
    from longattn.attention.base import available

    return [name for name in available() if capabilities(name).decode_state]


# ----------------------------------------------------------------------------- states


@dataclass(frozen=True)
class StateOwner:
    """What a decoding state was made for: the mechanism, the layer (a weak reference: a state does not keep
    its layer alive), the settings of the layer that shape the state (:func:`state_settings`), and the batch,
    dtype and device of the tokens it continues."""

    mechanism: str
    layer: weakref.ref
    settings: tuple[tuple[str, Any], ...]
    batch: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, module: AttentionBase, x: Tensor) -> StateOwner:
        return cls(module.name, weakref.ref(module), state_settings(module), x.shape[0], x.dtype, x.device)


def state_settings(module: AttentionBase) -> tuple[tuple[str, Any], ...]:
    """The settings of ``module`` that a state's shapes and meaning follow: dim, heads, head_dim, max_len and
    every option of the mechanism held as an int, bool, str or tuple (windows, chunk sizes, feature counts,
    variants; floats such as dropout or a scale do not shape a state)."""
    names = ("dim", "heads", "head_dim", "max_len", *get_spec(module.name).option_names)
    values = ((name, getattr(module, name, None)) for name in names)
    return tuple((name, value) for name, value in values
                 if value is None or isinstance(value, (bool, int, str, tuple)) and not isinstance(value, float))


@dataclass
class DecodingState:
    """What a mechanism keeps between tokens: tensors with the batch first, and ``length``, the number of
    positions consumed (the array position of the next token, padding included). ``owner`` is stamped by
    :func:`prefill` (a mechanism's hook need not set it)."""

    length: int = 0
    owner: StateOwner | None = field(default=None, repr=False, compare=False)

    def _map(self, fn: Callable[[Tensor], Tensor]) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.dim() > 0:
                setattr(self, f.name, fn(value))
            elif isinstance(value, DecodingState):
                value._map(fn)
            elif isinstance(value, list):
                setattr(self, f.name, [fn(t) if isinstance(t, Tensor) else t for t in value])

    def _stamped(self) -> StateOwner:
        if self.owner is None:
            raise AttentionError(f"this {type(self).__name__} has no owner: a state must come from layer.prefill "
                                 "(or state.copy_for(layer))")
        return self.owner

    def select(self, index: Tensor | list[int]) -> DecodingState:
        """Keep (or reorder, or repeat) batch rows ``index`` (beam search's reordering); in place. ``index``: 1-D
        integers in [0, batch) (a list is made a tensor); checking their range reads them back once."""
        owner = self._stamped()
        if isinstance(index, (list, tuple)):
            index = torch.tensor(index, dtype=torch.long)
        if not isinstance(index, Tensor) or index.dtype == torch.bool or index.is_floating_point() \
                or index.is_complex() or index.dim() != 1:
            got = f"{index.dtype} of shape {list(index.shape)}" if isinstance(index, Tensor) else type(index).__name__
            raise AttentionError(f"select: index must be a 1-D integer tensor of batch rows, got {got}")
        if index.numel() and bool(((index < 0) | (index >= owner.batch)).any()):
            raise AttentionError(f"select: index {index.tolist()[:8]} holds rows outside the state's batch of "
                                 f"{owner.batch} (expected 0 to {owner.batch - 1})")
        self._map(lambda t: t.index_select(0, index.to(t.device)))
        self.owner = replace(owner, batch=index.numel())
        return self

    def repeat_interleave(self, repeats: int) -> DecodingState:
        """Each batch row ``repeats`` times in a row (several samples per prompt); in place."""
        owner = self._stamped()
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise AttentionError(f"repeat_interleave: repeats must be a positive int, got {repeats!r}")
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))
        self.owner = replace(owner, batch=owner.batch * repeats)
        return self

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DecodingState:
        """The one way to move a state on purpose: its tensors to ``device`` and its floating tensors to
        ``dtype`` (a floating dtype), and the owner's device and dtype with them; in place."""
        owner = self._stamped()
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise AttentionError(f"to: dtype must be a floating torch.dtype, got {dtype!r}")
        device = owner.device if device is None else torch.device(device)
        dtype = owner.dtype if dtype is None else dtype
        self._map(lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype))
        moved = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as a tensor's device reads
        self.owner = replace(owner, device=moved, dtype=dtype)
        return self

    def copy_for(self, module: AttentionBase) -> DecodingState:
        """A copy of this state for another layer ``module`` of the same mechanism and settings (a copy of the
        model, the same weights loaded in another layer): the one way to hand a state to another layer."""
        owner = self._stamped()
        _check_same_kind(owner, module)
        state = copy.deepcopy(self)
        state.owner = replace(owner, layer=weakref.ref(module))
        return state


def _check_same_kind(owner: StateOwner, module: AttentionBase) -> None:
    if owner.mechanism != module.name:
        raise AttentionError(f"state: mechanism expected {module.name!r} (this layer's), given a state of "
                             f"{owner.mechanism!r}")
    expected = dict(state_settings(module))
    for name, value in owner.settings:
        if expected.get(name) != value:
            raise AttentionError(f"state: {name} expected {expected.get(name)!r} (this {module.name!r} layer's), "
                                 f"given a state made with {name}={value!r}")


def check_owner(module: AttentionBase, x: Tensor, state: DecodingState) -> None:
    """Raise unless ``state`` belongs to ``module`` and continues tokens like ``x`` (metadata only: no read)."""
    owner = state._stamped()
    _check_same_kind(owner, module)
    if owner.layer() is not module:
        raise AttentionError(f"state: layer expected this {module.name!r} layer, given a state made by another "
                             "layer (its own weights); hand a copy over with state.copy_for(layer)")
    for name, expected, given in (("batch", owner.batch, x.shape[0]), ("dtype", owner.dtype, x.dtype),
                                  ("device", owner.device, x.device)):
        if expected != given:
            raise AttentionError(f"state: {name} expected {expected} (the state's), given a token with {name} "
                                 f"{given}" + ("; move the state with state.to(...)" if name != "batch" else ""))


def _real(mask: Tensor | None, batch: int, length: int, device: torch.device) -> Tensor:
    return torch.ones(batch, length, dtype=torch.bool, device=device) if mask is None else mask


@dataclass
class KVState(DecodingState):
    """Every key and value so far: [B, H, capacity, D] buffers grown by doubling (appending is amortised O(1)),
    of which the first ``size`` entries are filled, and which of them are real (``padded``: whether any may not
    be, so that a step over a cache without padding needs no mask). Padded entries hold zeros."""

    keys: Tensor | None = None
    values: Tensor | None = None
    real: Tensor | None = None
    size: int = 0
    padded: bool = False

    @classmethod
    def start(cls, key: Tensor | None, value: Tensor, attention_mask: Tensor | None) -> KVState:
        b, _, n, _ = value.shape
        real = _real(attention_mask, b, n, value.device)
        keep = real[:, None, :, None]
        return cls(length=n, keys=None if key is None else key.masked_fill(~keep, 0.0),
                   values=value.masked_fill(~keep, 0.0), real=real.clone(), size=n,
                   padded=attention_mask is not None and not bool(attention_mask.all()))

    def append(self, key: Tensor | None, value: Tensor, real: Tensor | None) -> None:
        """Add one entry (``real``: [B] bool, or None when it is real in every row)."""
        b = value.shape[0]
        self.padded = self.padded or real is not None
        real = torch.ones(b, dtype=torch.bool, device=value.device) if real is None else real
        if self.size == self.values.shape[2]:
            grow = max(self.size, 16)
            self.values = F.pad(self.values, (0, 0, 0, grow))
            self.keys = None if self.keys is None else F.pad(self.keys, (0, 0, 0, grow))
            self.real = F.pad(self.real, (0, grow), value=False)
        i = self.size
        keep = real[:, None, None, None]
        self.values[:, :, i:i + 1] = value.masked_fill(~keep, 0.0)
        if self.keys is not None:
            self.keys[:, :, i:i + 1] = key.masked_fill(~keep, 0.0)
        self.real[:, i] = real
        self.size = i + 1

    def view(self) -> tuple[Tensor | None, Tensor, Tensor]:
        """(keys, values, real) of the entries so far."""
        n = self.size
        return (None if self.keys is None else self.keys[:, :, :n]), self.values[:, :, :n], self.real[:, :n]


@dataclass
class WindowState(DecodingState):
    """The keys and values of the last ``width`` positions ([length - width, length)), [B, H, width, D], and
    which of them are real (positions before the sequence start count as padding)."""

    keys: Tensor | None = None
    values: Tensor | None = None
    real: Tensor | None = None

    @classmethod
    def start(cls, key: Tensor, value: Tensor, real: Tensor, width: int) -> WindowState:
        """The last ``width`` positions of a prompt (``real`` [B, N]: the positions that may enter)."""
        n = key.shape[2]
        take = min(width, n)
        keep = real[:, None, n - take:, None]
        keys = F.pad(key[:, :, n - take:].masked_fill(~keep, 0.0), (0, 0, width - take, 0))
        values = F.pad(value[:, :, n - take:].masked_fill(~keep, 0.0), (0, 0, width - take, 0))
        return cls(length=n, keys=keys, values=values, real=F.pad(real[:, n - take:], (width - take, 0), value=False))

    def with_token(self, key: Tensor, value: Tensor, real: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The window followed by the new position: [B, H, width + 1, D] keys, values and [B, width + 1] real."""
        keep = real[:, None, None, None]
        return (torch.cat([self.keys, key.masked_fill(~keep, 0.0)], dim=2),
                torch.cat([self.values, value.masked_fill(~keep, 0.0)], dim=2),
                torch.cat([self.real, real[:, None]], dim=1))

    def slide(self, keys: Tensor, values: Tensor, real: Tensor) -> None:
        """Keep the last ``width`` of ``with_token``'s positions."""
        drop = keys.shape[2] - self.keys.shape[2]  # the oldest position
        self.keys, self.values, self.real = keys[:, :, drop:], values[:, :, drop:], real[:, drop:]


@dataclass
class RecurrentState(DecodingState):
    """Running sums of a kernel feature map: ``sums`` [B, H, F, Dv + 1] holds sum_j phi(k_j) [v_j, 1]
    (numerator and normaliser in one); ``extra`` holds what a mechanism keeps besides (Performer's
    stabiliser, Luna's second sum and count)."""

    sums: Tensor | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)

    def _map(self, fn: Callable[[Tensor], Tensor]) -> None:
        super()._map(fn)
        self.extra = {k: fn(v) for k, v in self.extra.items()}


def kernel_state_sums(phi_k: Tensor, value: Tensor) -> Tensor:
    """sum_j phi(k_j) [v_j, 1]: [B, H, F, Dv + 1] (padded keys' features must be zero)."""
    return phi_k.transpose(-1, -2) @ torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)


def kernel_step_output(phi_q: Tensor, sums: Tensor, eps: float | None = None, floor: float | None = None) -> Tensor:
    """phi(q) sum phi(k) v / (phi(q) sum phi(k) + eps), or / max(., floor): [B, H, 1, Dv]."""
    both = phi_q @ sums
    numerator, normaliser = both[..., :-1], both[..., -1:]
    return numerator / (normaliser.clamp_min(floor) if floor is not None else normaliser + eps)


# ----------------------------------------------------------------------------- shared computations


def attend_keys(query: Tensor, keys: Tensor, values: Tensor, visible: Tensor | None, *, scale: float | None = None,
                dropout_p: float = 0.0) -> Tensor:
    """softmax attention of a few queries [B, H, q, D] over keys [B, H, T, D] through SDPA, ``visible`` a bool
    mask broadcastable to [B, H, q, T] (None: every key); a query that sees no key gets zeros."""
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, dropout_p=dropout_p, scale=scale)
    if visible is not None:
        out = torch.where(visible.any(-1, keepdim=True), out, 0.0)
    return out


def require_decoding(module: AttentionBase) -> None:
    if not module.capabilities.decode_state:
        raise AttentionError(f"{module.name!r} has no decoding state (it is not causal)")
    if not module.causal:
        raise AttentionError(f"{module.name!r} decodes one token at a time only as a causal layer: build it with "
                             "causal=True")


def prefill(module: AttentionBase, x: Tensor, attention_mask: Tensor | None,
            layer_state: dict | None) -> tuple[Tensor, Any]:
    """:meth:`AttentionBase.prefill`: the input checks and padding rules of the forward around the hook."""
    require_decoding(module)
    box: dict[str, Any] = {}

    def attend(inputs: Tensor, mask: Tensor | None, state: dict | None) -> Tensor:
        out, box["state"] = module.prefill_attend(inputs, mask, state)
        return out

    out = module.forward_with(attend, x, attention_mask, layer_state)
    if "state" not in box:
        raise AttentionError("prefill needs at least one sequence (an empty batch has no state)")
    state = box["state"]
    state.owner = StateOwner.of(module, x)
    return out, state


def step(module: AttentionBase, x: Tensor, state: Any, attention_mask: Tensor | None,
         layer_state: dict | None) -> tuple[Tensor, Any]:
    """:meth:`AttentionBase.step`: checks, padding replacement, the hook, zeroed padded output, length + 1."""
    require_decoding(module)
    module.check_input(x, attention_mask)
    if x.shape[1] != 1:
        raise AttentionError(f"step takes one new token, x of shape [B, 1, dim]; got {list(x.shape)} (prefill a prompt)")
    if not isinstance(state, DecodingState):
        raise AttentionError(f"state must be what prefill or step returned, got {type(state).__name__}")
    check_owner(module, x, state)
    if module.capabilities.needs_max_len and module.max_len is not None and state.length + 1 > module.max_len:
        raise AttentionError(f"position {state.length} is past max_len={module.max_len} of this {module.name!r} layer")
    real = None
    if attention_mask is not None:
        x = x.masked_fill(~attention_mask.unsqueeze(-1), 0.0)
        real = None if bool(attention_mask.all()) else attention_mask[:, 0]
    token = _INPUT_MASKED.set(True)
    owner = state.owner
    try:
        out, state = module.step_attend(x, state, real, layer_state)
    finally:
        _INPUT_MASKED.reset(token)
    state.owner = owner  # kept when a hook returns a new state object
    state.length += 1
    if real is not None:
        out = out.masked_fill(~real[:, None, None], 0.0)
    return out, state


def ones_or(real: Tensor | None, batch: int, device: torch.device) -> Tensor:
    """The new token's [B] real flags (all True when ``real`` is None)."""
    return torch.ones(batch, dtype=torch.bool, device=device) if real is None else real
