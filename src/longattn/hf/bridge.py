"""The adapter between transformers' attention interface and longattn's mechanisms.

transformers (>= 4.48) routes the attention of most model families through two registries:
``AttentionInterface`` (the function that turns the model's queries, keys and values into the context)
and ``AttentionMaskInterface`` (the function that builds the mask handed to it). longattn registers both
under one key (``longattn_<name>``):

* the mask function returns the model's 2-D key padding mask, bool ``[B, N]`` with True = real token
  (longattn's own convention, as transformers' flash-attention mask does), or None without padding:
  no ``[B, 1, N, N]`` tensor is ever built;
* the attention function receives ``(module, query, key, value, attention_mask, dropout=, scaling=,
  **kwargs)`` with ``[B, H, N, Dh]`` tensors, repeats GQA key/value heads, takes causality from
  ``kwargs["is_causal"]`` or ``module.is_causal``, runs the mechanism and returns ``[B, N, H, Dh]``.

A mechanism runs through its module form with :class:`ModelProjections` in place of its own
projections: ``qkv()`` hands over the model's queries, keys and values (after its rotary embedding), and
``out()`` only merges the heads, since the model applies its own output projection afterwards. So one
code path serves every mechanism, whatever buffers (Performer's features, BigBird's random blocks) or
parameters (under :func:`longattn.hf.convert`) it owns.
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn

from longattn.attention.base import AttentionBase, AttentionError, build, get_spec, merge_heads
from longattn.attention.softmax import softmax_attention

__all__ = [
    "CONVERTED_KEY",
    "FUNCTION_FORM_OPTIONS",
    "ModelProjections",
    "check_dispatch",
    "enable",
    "function_path_names",
    "implementation_key",
    "register",
    "register_all",
    "registered",
    "unregister",
]

PREFIX = "longattn_"
CONVERTED_KEY = "longattn_converted"  # the key of models converted by longattn.hf.convert

# Options that give a mechanism its parameter-free form, used by register() unless the caller sets them:
# nystrom without its depthwise convolution on V, longformer with the sliding-window projections reused
# for the global rows.
FUNCTION_FORM_OPTIONS: dict[str, dict[str, Any]] = {
    "nystrom": {"conv_kernel": None},
    "longformer": {"separate_global_projections": False},
}

# Mechanisms whose scores are not scaled dot products (kernel feature maps, plain means): they cannot
# honour a model's non-default ``scaling``.
_UNSCALED = frozenset({"linear", "cosformer", "vmean", "fnet"})


def implementation_key(name: str) -> str:
    """The transformers implementation name of longattn mechanism ``name``: ``longattn_<name>``."""
    return PREFIX + name


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "longattn.hf needs transformers: pip install 'longattn[hf]' (or pip install transformers)"
        ) from None
    return transformers


# ----------------------------------------------------------------------------- projections


class ModelProjections(nn.Module):
    """Stands in for a mechanism's :class:`~longattn.attention.QKVProjection` inside a transformers model.

    ``qkv(x)`` returns the queries, keys and values the model computed for this call (rotary embedding
    applied, GQA heads repeated); ``out(h)`` merges heads only (the model owns the output projection);
    ``to_q``/``to_k``/``to_v`` are the model's own linear layers, for mechanisms that project the hidden
    states themselves (SKTformer's Smoother runs before the projections). Those layers are not
    registered here, so their parameters keep their original keys; ``to_out`` is the identity.
    """

    def __init__(self, heads: int, linears: dict[str, nn.Module] | None = None, label: str = "") -> None:
        super().__init__()
        self.heads = heads
        self.to_out = nn.Identity()
        self.label = label
        self._linears = dict(linears or {})  # a plain dict: not registered, no duplicate keys
        self._qkv: tuple[Tensor, Tensor, Tensor] | None = None
        self._rotary = False  # this call's model rotates q and k after its projections
        self._rescaled = False  # this call's queries were rescaled to the model's scaling
        self.reads_hidden_states = False  # the mechanism projected the hidden states itself

    def load(self, query: Tensor | None, key: Tensor | None = None, value: Tensor | None = None, *,
             rotary: bool = False, rescaled: bool = False) -> None:
        """Hand over (or, with None, take back) the model's q, k, v for one attention call."""
        # plain attributes, set directly: nn.Module.__setattr__ costs more than the rest of a decoding step's call
        self.__dict__.update(_qkv=None if query is None else (query, key, value), _rotary=rotary, _rescaled=rescaled)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self._qkv is None:
            raise AttentionError("ModelProjections.qkv called outside a transformers attention call")
        return self._qkv

    def out(self, heads_out: Tensor) -> Tensor:
        return merge_heads(heads_out)

    def _linear(self, role: str) -> nn.Module:
        if role not in self._linears:
            raise AttentionError(
                f"{self.label or 'this mechanism'} projects the hidden states itself, which the attention "
                "interface does not see: use longattn.hf.convert(model, name) instead of register(name)"
            )
        if self._rescaled:
            raise AttentionError(
                f"{self.label} computes its queries from the hidden states, so it cannot use the model's "
                "non-default attention scaling"
            )
        if self._rotary and role != "to_v":
            raise AttentionError(
                f"{self.label or 'this mechanism'} computes its queries and keys from the hidden states, so it "
                "would skip this model's rotary position embedding: convert it on models with absolute "
                "positions (BERT family), or pick a mechanism that takes the model's q, k, v"
            )
        self.reads_hidden_states = True
        return self._linears[role]

    to_q = property(lambda self: self._linear("to_q"))
    to_k = property(lambda self: self._linear("to_k"))
    to_v = property(lambda self: self._linear("to_v"))


def uses_projections(mechanism: AttentionBase) -> bool:
    """True when the mechanism's module form gets its q, k, v from a ``proj`` (QKVProjection-like)."""
    return isinstance(getattr(mechanism, "proj", None), (nn.Module,)) and hasattr(mechanism.proj, "qkv")


# ----------------------------------------------------------------------------- the attention call


def _default_scaling(head_dim: int) -> float:
    return head_dim**-0.5


class PackedMask(NamedTuple):
    """What longattn's mask function hands the attention function for a packed batch (several sequences per row,
    transformers' ``DataCollatorWithFlattening``): the sequence of each token [B, N] and the padding mask."""

    segments: Tensor
    padding: Tensor | None


def _mask_parts(mask_function: Callable) -> list[tuple[str, dict[str, Any]]]:
    """(qualified name, closure variables) of a transformers mask function and of the parts ``and_masks`` joins."""
    name = getattr(mask_function, "__qualname__", "")
    closure = inspect.getclosurevars(mask_function).nonlocals if inspect.isfunction(mask_function) else {}
    if name.startswith("and_masks.") and "mask_functions" in closure:
        return [part for f in closure["mask_functions"] for part in _mask_parts(f)]
    return [(name, closure)]


def _packed_segments(mask_function: Callable) -> Tensor | None:
    """The [B, N] sequence ids of transformers' packed-sequence mask (causal or bidirectional within each
    sequence, detected from position ids that restart), or None for any other pattern."""
    parts = dict(_mask_parts(mask_function))
    remap = parts.pop("remap_positions_for_packed_sequence.<locals>.inner_mask", None)
    packed = parts.pop("packed_sequence_mask_function.<locals>.inner_mask", None)
    if parts or remap is None or packed is None:
        return None
    inner = getattr(remap.get("mask_function"), "__name__", "")
    if inner not in ("causal_mask_function", "bidirectional_mask_function"):
        return None
    segments = packed.get("packed_sequence_mask")
    return segments if isinstance(segments, Tensor) and segments.dim() == 2 else None


def packed_segments_of(attention_mask: Any, kwargs: dict, batch: int, length: int) -> Tensor | None:
    """The [B, N] sequence ids of a packed batch, None when the batch is not packed: from flash-attention's
    ``cu_seq_lens_q`` among the call's kwargs, from longattn's mask function (transformers' packed-sequence
    pattern), or,
    without a padding mask, from ``position_ids`` that restart (transformers itself detects packing only
    without a cache, so a model called with its default ``use_cache=True`` would mix the sequences)."""
    from longattn.attention.packing import segment_ids

    if kwargs.get("cu_seq_lens_q") is not None:  # first: given, it is validated even beside a packed mask
        return segment_ids(cu_seqlens=kwargs["cu_seq_lens_q"], shape=(batch, length))
    if isinstance(attention_mask, PackedMask):
        return attention_mask.segments
    positions = kwargs.get("position_ids")
    if attention_mask is None and length > 1 and isinstance(positions, Tensor) and positions.dim() == 2 \
            and positions.shape[1] == length:
        segments = segment_ids(position_ids=positions, shape=(batch, length))
        if bool((segments[:, -1] > 0).any()):
            return segments
    return None


def _check_mask(mask: Any, batch: int, kv_len: int) -> Tensor | None:
    if isinstance(mask, PackedMask):
        mask = mask.padding
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.dtype != torch.bool:
        shape = list(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
        raise AttentionError(
            "longattn expects the bool [B, N] key padding mask of its own mask function, got "
            f"{type(mask).__name__} {shape}: a model that prepares its own 4-D mask, or a flex-attention "
            "BlockMask, cannot be routed through longattn"
        )
    if mask.shape != (batch, kv_len):
        raise AttentionError(f"key padding mask must be [B, N] = [{batch}, {kv_len}], got {list(mask.shape)}")
    return mask


def repeat_kv(key: Tensor, value: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Grouped-query attention: repeat each key/value head for the heads // kv_heads queries it serves."""
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise AttentionError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if kv_heads == heads:
        return key, value
    return key.repeat_interleave(heads // kv_heads, dim=1), value.repeat_interleave(heads // kv_heads, dim=1)


def common_dtype(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in one dtype: the autocast dtype inside ``torch.autocast`` (rotary embeddings hand back float32
    queries and keys next to half-precision values), else the widest of the three."""
    device_type = query.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif query.dtype == key.dtype == value.dtype:
        return query, key, value
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def run_mechanism(
    mechanism: AttentionBase,
    projections: ModelProjections | None,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    *,
    dropout: float,
    scaling: float | None,
    hidden_states: Tensor | None = None,
    layer_state: dict | None = None,
    ignore_dropout: bool = False,
    rotary: bool = False,
    cache_layer: Any = None,
    segments: Tensor | None = None,
) -> Tensor:
    """One attention call of a transformers module through ``mechanism``; returns [B, N, H, Dh].

    With ``cache_layer`` (a :class:`~longattn.hf.cache.LongattnCacheLayer`) the call decodes: the first one
    prefills the mechanism's decoding state, later ones step it one token at a time; ``key``/``value`` are then
    the new tokens' only and ``attention_mask`` covers every token so far. With ``segments`` ([B, N] sequence
    ids of a packed batch) each sequence is computed on its own (see :mod:`longattn.attention.packing`)."""
    name = mechanism.name
    query, key, value = common_dtype(query, key, value)
    b, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if getattr(module, "is_cross_attention", False) or "crossattention" in type(module).__name__.lower():
        raise AttentionError(f"longattn_{name} handles self-attention only, not {type(module).__name__}")
    key, value = repeat_kv(key, value, heads)
    if cache_layer is not None and cache_layer.packed:
        raise AttentionError("this cache was filled by a packed batch (several sequences per row): it cannot be "
                             "continued; decode from a padded batch")
    if cache_layer is not None:
        mask = _check_mask(attention_mask, b, cache_layer.length + q_len)
    else:
        mask = _check_mask(attention_mask, b, kv_len)
        if q_len != kv_len:
            if name == "softmax" and q_len == 1:
                # decoding with transformers' own KV cache: the one new query sees every cached key
                out = softmax_attention(query, key, value, mask, scale=scaling)
                return out.transpose(1, 2).contiguous()
            raise AttentionError(
                f"longattn_{name} needs as many queries as keys, got {q_len} queries and {kv_len} keys: decoding "
                "with a cache needs longattn's decoding state (longattn.hf.enable(model, name) or "
                "longattn.hf.convert install it), or generate with use_cache=False"
            )

    options = get_spec(name).option_names
    rescaled = False
    if scaling is not None and not math.isclose(scaling, _default_scaling(head_dim), rel_tol=1e-6):
        if "scale" in options:
            mechanism.scale = scaling
        elif projections is not None and name not in _UNSCALED:
            # softmax-kernel mechanisms score q.k / sqrt(Dh): rescaling q gives the model's scaling exactly
            query = query * (scaling / _default_scaling(head_dim))
            rescaled = True
        else:
            raise AttentionError(
                f"longattn_{name} cannot use the model's attention scaling {scaling:g} (it scores with "
                f"1/sqrt(head_dim) = {_default_scaling(head_dim):g} or no scaling at all)"
            )
    if "dropout" in options:
        mechanism.dropout = dropout
    elif dropout > 0 and not ignore_dropout:
        raise AttentionError(
            f"{name} has no attention-probability dropout but the model asks for {dropout:g} while training: "
            "set the model's attention dropout to 0 (e.g. config.attention_probs_dropout_prob = 0.0), or pass "
            "ignore_dropout=True"
        )

    x = hidden_states
    if x is None:  # function path: the module form only reads the shape, device and dtype of x
        x = query.new_zeros(()).expand(b, q_len, heads * head_dim)
    plan = None
    if segments is not None:  # a packed batch: its sequences side by side, each padded to the longest
        from longattn.attention.packing import check_packable, packing_plan

        if cache_layer is not None:
            if cache_layer.state is not None:
                raise AttentionError("packed sequences cannot continue a cached sequence: decode from a padded batch")
            cache_layer.packed = True  # a training forward's cache (use_cache=True by default): never continued
            cache_layer = None
        check_packable(name, mechanism)
        plan = packing_plan(segments.to(query.device))
        query, key, value = (plan.unpack(t, dim=2) for t in (query, key, value))
        x = plan.unpack(x)
        mask = plan.valid if mask is None else plan.valid & plan.unpack(mask)

    def load(sl: slice = slice(None)) -> None:
        if projections is not None:
            projections.load(query[:, :, sl], key[:, :, sl], value[:, :, sl], rotary=rotary, rescaled=rescaled)

    load()
    try:
        if cache_layer is None:
            out = mechanism(x, attention_mask=mask, layer_state=layer_state)
        elif cache_layer.state is None:
            out, cache_layer.state = mechanism.prefill(x, mask, layer_state)
        else:
            if q_len > 1 and mechanism.capabilities.uses_layer_state:
                raise AttentionError(f"{name} continues a cached sequence one token per forward call only")
            steps = []
            for i in range(q_len):  # several new tokens after a prefill: one step each
                load(slice(i, i + 1))
                token_mask = None if mask is None else mask[:, cache_layer.length + i:cache_layer.length + i + 1]
                step_out, cache_layer.state = mechanism.step(x[:, i:i + 1], cache_layer.state, token_mask, layer_state)
                steps.append(step_out)
            out = torch.cat(steps, dim=1)
    finally:
        if projections is not None:
            projections.load(None)
    if cache_layer is not None:
        cache_layer.length += q_len
    if plan is not None:
        out = plan.repack(out)
    return out.view(b, q_len, heads, head_dim)


def causal_options(name: str, options: dict[str, Any], causal: bool, config: Any) -> dict[str, Any]:
    """``options`` with what a causal mechanism needs from the model: cosFormer's M (``max_positions``, eq. 9)
    is the model's ``max_position_embeddings`` unless given, so that a token's re-weighting does not change as
    the sequence grows (with M = N it would, and cached decoding could not follow it)."""
    if causal and "max_positions" in get_spec(name).option_names and options.get("max_positions") is None:
        limit = getattr(config, "max_position_embeddings", None)
        if limit is None:
            raise AttentionError(f"causal {name} needs max_positions (M of eq. 9): the model config has no "
                                 "max_position_embeddings to take it from")
        options = {**options, "max_positions": int(limit)}
    return options


def _cache_layer(module: nn.Module) -> Any:
    """The LongattnCacheLayer of this call (None without a cache, or when no hooks were installed)."""
    from longattn.hf.cache import cache_layer_of

    return cache_layer_of(module)


def _causal_of(module: nn.Module, kwargs: dict) -> bool:
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", False) if causal is None else causal)


# ----------------------------------------------------------------------------- registration

_CALLS = [0]  # longattn attention calls so far, read by the dispatch check
_REGISTERED: dict[str, dict[str, Any]] = {}


def function_path_names() -> list[str]:
    """Mechanisms that :func:`register` accepts: parameter-free in their function form."""
    from longattn.attention import available

    names = []
    for name in available():
        try:
            _function_mechanism(name, dict(FUNCTION_FORM_OPTIONS.get(name, {})), causal=False)
        except AttentionError:
            continue
        names.append(name)
    return names


def _function_mechanism(name: str, options: dict[str, Any], causal: bool, heads: int = 2, head_dim: int = 8,
                        seed: int = 0) -> tuple[AttentionBase, ModelProjections | None]:
    """The mechanism's module form with the model's projections in place of its own, or (V-Mean, which
    has no query/key projections) the bare module whose functional form the adapter calls."""
    spec = get_spec(name)
    if spec.capabilities.needs_max_len:
        raise AttentionError(f"{name} learns a fixed-length map (needs max_len): use longattn.hf.convert")
    if spec.capabilities.uses_layer_state:
        raise AttentionError(f"{name} passes state between layers (layer_state): use longattn.hf.convert")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the same random features / blocks for every run of the model
        mechanism = build(name, dim=heads * head_dim, heads=heads, causal=causal, **options)
    owned = {n for n, _ in mechanism.named_parameters()}
    if uses_projections(mechanism):
        projections = ModelProjections(heads, label=name)
        mechanism.proj = projections
        owned = {n for n, _ in mechanism.named_parameters()}
        if owned:
            raise AttentionError(
                f"{name} with options {options} owns parameters ({', '.join(sorted(owned)[:4])}) that a pretrained "
                "model does not have: use longattn.hf.convert(model, name, ...) to add them"
            )
        return mechanism, projections
    value_only = owned <= {"to_v.weight", "to_v.bias", "to_out.weight", "to_out.bias"}
    if not value_only or spec.functional is None:
        raise AttentionError(f"{name} has no function form on the model's q, k, v: use longattn.hf.convert")
    return mechanism, None


def register(name: str, *, ignore_dropout: bool = False, seed: int = 0, **options: Any) -> str:
    """Register longattn mechanism ``name`` with transformers as ``longattn_<name>``; returns that key.

    Use the key as ``attn_implementation=`` in ``from_pretrained`` or with ``model.set_attn_implementation``
    (or call :func:`enable`). Options are the mechanism's module options (``num_landmarks=64``). Calling
    it again with the same options is harmless; other options under the same name raise.
    """
    _transformers()
    from transformers import AttentionInterface, AttentionMaskInterface

    options = {**FUNCTION_FORM_OPTIONS.get(name, {}), **options}
    key = implementation_key(name)
    settings = {"options": options, "ignore_dropout": ignore_dropout, "seed": seed}
    if key in _REGISTERED:
        if _REGISTERED[key] != settings:
            raise AttentionError(
                f"{key} is already registered with {_REGISTERED[key]}; a second registration with {settings} "
                f"would change every model using it (longattn.hf.unregister({name!r}) first)"
            )
        return key
    _function_mechanism(name, options, causal=False)  # fails now, not at the model's first forward

    built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def attention(module: nn.Module, query: Tensor, key_: Tensor, value: Tensor, attention_mask: Any,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        causal = _causal_of(module, kwargs)
        per_module = built.setdefault(module, {})
        shape = (causal, query.shape[1], query.shape[3])
        if shape not in per_module:
            if causal and not get_spec(name).capabilities.causal:
                raise AttentionError(f"{name} does not support causal masking, which {type(module).__name__} needs")
            layer_seed = seed + int(getattr(module, "layer_idx", 0) or 0)
            per_module[shape] = _function_mechanism(name, causal_options(name, options, causal, module.config),
                                                    causal, query.shape[1], query.shape[3], layer_seed)
        mechanism, projections = per_module[shape]
        mechanism.train(module.training)
        mechanism.to(query.device)
        _CALLS[0] += 1
        segments = packed_segments_of(attention_mask, kwargs, query.shape[0], query.shape[2])
        if projections is None:  # V-Mean: no projections to stand in for, its functional form on v
            mask = _check_mask(attention_mask, query.shape[0], key_.shape[2])
            if key_.shape[2] != query.shape[2]:
                raise AttentionError(f"longattn_{name} needs as many queries as keys")
            value = repeat_kv(value, value, query.shape[1])[1]
            functional = get_spec(name).functional
            if segments is None:
                return functional(query, value, value, mask).transpose(1, 2).contiguous(), None
            from longattn.attention.packing import packing_plan

            plan = packing_plan(segments.to(query.device))
            q, v = plan.unpack(query, dim=2), plan.unpack(value, dim=2)
            unpacked_mask = plan.valid if mask is None else plan.valid & plan.unpack(mask)
            return plan.repack(functional(q, v, v, unpacked_mask), dim=2).transpose(1, 2).contiguous(), None
        out = run_mechanism(mechanism, projections, module, query, key_, value, attention_mask,
                            dropout=dropout, scaling=scaling, ignore_dropout=ignore_dropout,
                            cache_layer=_cache_layer(module), segments=segments)
        return out, None

    AttentionInterface.register(key, attention)
    AttentionMaskInterface.register(key, key_padding_mask)
    _REGISTERED[key] = settings
    return key


def unregister(name: str) -> None:
    """Remove ``longattn_<name>`` (or the key itself) from both transformers interfaces."""
    from transformers import AttentionInterface, AttentionMaskInterface

    key = name if name.startswith(PREFIX) else implementation_key(name)
    for interface in (AttentionInterface, AttentionMaskInterface):
        interface._global_mapping.pop(key, None)  # transformers has no public removal
    _REGISTERED.pop(key, None)


def registered() -> list[str]:
    """The keys longattn registered with transformers so far."""
    return sorted(_REGISTERED)


def register_all() -> list[str]:
    """Register every mechanism that has a parameter-free function form (see :func:`register`)."""
    return [register(name) for name in function_path_names()]


def key_padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                     mask_function: Callable | None = None, attention_mask: Tensor | None = None,
                     **kwargs: Any) -> Tensor | PackedMask | None:
    """transformers' mask hook for longattn: the bool [B, kv_len] padding mask (None without padding).

    Only the plain causal and bidirectional patterns are accepted, and transformers' packed sequences (position
    ids that restart), handed on as a :class:`PackedMask`: causality is the mechanism's own (``is_causal``), and
    patterns it cannot express (sliding windows, chunks, overlays) raise instead of being dropped.
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    segments = None
    if mask_function not in (None, causal_mask_function, bidirectional_mask_function):
        segments = _packed_segments(mask_function)
        if segments is None:
            raise AttentionError(
                f"longattn supports key padding with plain causal or bidirectional attention, and packed sequences, "
                f"not the mask pattern {getattr(mask_function, '__name__', mask_function)!r} (sliding window, "
                "chunked or an overlay)"
            )
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, -kv_length:].to(torch.bool)
        if mask.shape[-1] != kv_length:
            raise AttentionError(f"attention_mask covers {mask.shape[-1]} keys but the model attends to {kv_length}")
        mask = None if bool(mask.all()) else mask
    if segments is not None:
        return PackedMask(segments.expand(batch_size, -1), mask)
    return mask


def _exact_softmax(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, dropout: float,
                   scaling: float | None, kwargs: dict) -> Tensor:
    """The attention of a layer that a conversion left out (``layers=...``): exact softmax, [B, N, H, Dh]."""
    query, key, value = common_dtype(query, key, value)
    b, heads = query.shape[:2]
    segments = packed_segments_of(attention_mask, kwargs, b, query.shape[2])
    mask = _check_mask(attention_mask, b, key.shape[2])
    key, value = repeat_kv(key, value, heads)
    causal = _causal_of(module, kwargs) and query.shape[2] == key.shape[2]
    if segments is None:
        return softmax_attention(query, key, value, mask, dropout_p=dropout, is_causal=causal,
                                 scale=scaling).transpose(1, 2).contiguous()
    from longattn.attention.packing import packing_plan

    plan = packing_plan(segments.to(query.device))
    query, key, value = (plan.unpack(t, dim=2) for t in (query, key, value))
    mask = plan.valid if mask is None else plan.valid & plan.unpack(mask)
    out = softmax_attention(query, key, value, mask, dropout_p=dropout, is_causal=causal, scale=scaling)
    return plan.repack(out, dim=2).transpose(1, 2).contiguous()


# Attribute names of the query, key, value and output projections per model family (what convert maps).
PROJECTION_NAMES = {
    "llama": ("q_proj", "k_proj", "v_proj"),  # Llama, Mistral, Qwen2, ... (o_proj applied by the module)
    "bert": ("query", "key", "value"),  # BERT, RoBERTa, ELECTRA, ... (output dense in BertSelfOutput)
}


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, module, family) of every self-attention module whose projections convert maps."""
    found = []
    for qualified, module in model.named_modules():
        if "cross" in type(module).__name__.lower() or getattr(module, "is_cross_attention", False):
            continue
        for family, names in PROJECTION_NAMES.items():
            if all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
                found.append((qualified, module, family))
                break
    return found


def _register_converted(attend: Callable[..., Tensor]) -> None:
    """Register the attention function of converted layers (``attend``: longattn.hf.convert.attend_converted,
    passed in so that the bridge does not import the conversion)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    if CONVERTED_KEY in _REGISTERED:
        return

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        _CALLS[0] += 1
        if not isinstance(getattr(module, "longattn", None), AttentionBase):  # a layer left out of the conversion (layers=...): exact softmax attention
            return _exact_softmax(module, query, key, value, attention_mask, dropout, scaling, kwargs), None
        return attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                      causal=_causal_of(module, kwargs), kwargs=kwargs), None

    AttentionInterface.register(CONVERTED_KEY, attention)
    AttentionMaskInterface.register(CONVERTED_KEY, key_padding_mask)
    _REGISTERED[CONVERTED_KEY] = {}


# ----------------------------------------------------------------------------- dispatch check


def check_dispatch(model: nn.Module, unreached: Callable[[], list[str]] | None = None) -> nn.Module:
    """Make the next forward of ``model`` raise unless it reached longattn.

    transformers lets models that do not use its attention interface (MPNet, DeBERTa, Longformer...)
    accept ``attn_implementation`` and keep their own attention; this turns that into an error.
    ``unreached`` (converted models) names the converted layers the forward did not reach.
    """
    start = [0]

    def before(mod: nn.Module, args: Any) -> None:
        start[0] = _CALLS[0]

    def after(mod: nn.Module, args: Any, output: Any) -> None:
        pre.remove()
        post.remove()
        missed = unreached() if unreached is not None else []
        if _CALLS[0] == start[0] or missed:
            where = f" (never reached: {', '.join(missed[:3])})" if missed else ""
            raise AttentionError(
                f"{type(model).__name__} did not route its attention through transformers' AttentionInterface"
                f"{where}, so longattn was not called: this model family keeps its own attention (see "
                "https://huggingface.co/docs/transformers/en/attention_interface)"
            )

    pre = model.register_forward_pre_hook(before)
    post = model.register_forward_hook(after)
    return model


def enable(model: nn.Module, name: str, **options: Any) -> nn.Module:
    """Register ``name`` (see :func:`register`), switch ``model`` to it and check that its next forward
    reaches longattn; returns the model."""
    key = register(name, **options)
    model.set_attn_implementation(key)
    actual = getattr(model.config, "_attn_implementation", None)
    if actual != key:
        raise AttentionError(
            f"{type(model).__name__} kept attn_implementation={actual!r}: it does not route its attention "
            "through transformers' AttentionInterface, so longattn cannot replace it"
        )
    from longattn.hf.cache import install_cache_hooks

    install_cache_hooks([module for _, module, _ in attention_modules(model)])  # generate(use_cache=True)
    return check_dispatch(model)
