"""longattn's decoding states inside transformers' cache, so that ``model.generate(..., use_cache=True)`` works.

transformers' attention modules call ``cache.update(key, value, layer_idx)`` and hand what it returns to the
attention function. A :class:`LongattnCacheLayer` (a ``CacheLayerMixin``, one per converted layer) returns the
new tokens' keys and values unchanged; the attention function runs the mechanism's ``prefill`` on the first
call and ``step`` on every later token, and keeps the mechanism's decoding state (running sums, a window, a
KV cache; see :mod:`longattn.attention.decoding`) in the layer. ``get_seq_length`` and ``get_mask_sizes``
count the tokens consumed, so positions and the padding mask (which then covers every token so far) come out
as with transformers' own ``DynamicLayer``.

The cache itself is whatever transformers builds (``DynamicCache``, by ``generate`` or by a model called with
``use_cache=True``): a forward pre-hook on each attention module puts a ``LongattnCacheLayer`` in its slot
before the module's first ``update`` (:func:`install_cache_hooks`). Beam search and several samples per prompt
reorder and repeat the states (``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``); a
recurrent state cannot be rolled back, so ``crop`` (assisted generation) raises.

The module imports without transformers (the ``hf`` extra): ``LongattnCacheLayer`` is built on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from longattn.attention.base import AttentionError
from longattn.attention.decoding import DecodingState
from longattn.utils import optional_import

__all__ = ["CACHE_LAYER_ATTR", "LongattnCacheLayer", "cache_layer_of", "install_cache_hooks"]

CACHE_LAYER_ATTR = "_longattn_cache_layer"  # the module's cache layer during one forward call
_HOOKED_ATTR = "_longattn_cache_hooks"


class _CacheLayerMethods:
    """One layer's longattn decoding state in a transformers ``Cache``.

    ``update`` hands the new tokens' keys and values straight back (the mechanism's state takes them in);
    ``state`` is the mechanism's :class:`~longattn.attention.decoding.DecodingState`, ``length`` the tokens
    consumed so far (array positions, padding included).
    """

    is_compileable = False
    is_croppable = False
    supports_early_init = False
    is_sliding = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.state: DecodingState | None = None
        self.length = 0
        self.packed = False  # filled by a packed batch (a training forward): not to be continued

    def __repr__(self) -> str:
        kind = type(self.state).__name__ if self.state is not None else "empty"
        return f"LongattnCacheLayer({kind}, length={self.length})"

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.length, self.packed = None, 0, False

    def offload(self) -> None:  # the states are small (recurrent, windowed) or the KV cache itself: kept in place
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state.select(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.state is not None:
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            self.state.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise AttentionError(
                "a longattn decoding state (running sums, a window) cannot be rolled back: assisted generation "
                "and other uses of Cache.crop are not supported"
            )


@functools.cache
def _layer_class() -> type:
    """``LongattnCacheLayer``: the methods above on transformers' ``CacheLayerMixin`` (imported here, when used)."""
    mixin = optional_import("transformers.cache_utils", extra="hf").CacheLayerMixin

    class LongattnCacheLayer(_CacheLayerMethods, mixin):
        __doc__ = _CacheLayerMethods.__doc__

    LongattnCacheLayer.__module__, LongattnCacheLayer.__qualname__ = __name__, "LongattnCacheLayer"
    return LongattnCacheLayer


def __getattr__(name: str) -> Any:
    if name == "LongattnCacheLayer":
        return _layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _attach(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: put a LongattnCacheLayer in this module's slot of the call's cache (if any)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layer = None
    if cache is not None:
        cache = getattr(cache, "self_attention_cache", cache)  # an encoder-decoder cache: its self-attention part
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or not hasattr(cache, "layers"):
            raise AttentionError(
                f"{type(module).__name__} uses a {type(cache).__name__} that longattn cannot keep its decoding state "
                "in (it needs transformers' Cache with one layer per layer_idx): generate with use_cache=False"
            )
        layers = cache.layers
        while len(layers) <= index and getattr(cache, "layer_class_to_replicate", None) is not None:
            layers.append(cache.layer_class_to_replicate())
        if len(layers) <= index:
            raise AttentionError(f"the cache has {len(layers)} layers, none for layer {index}")
        layer = layers[index]
        if not isinstance(layer, _CacheLayerMethods):
            if layer.get_seq_length() > 0:
                raise AttentionError(
                    f"layer {index} of the cache already holds {layer.get_seq_length()} tokens from another "
                    "attention: start generation from an empty cache"
                )
            layer = layers[index] = _layer_class()()
    module.__dict__[CACHE_LAYER_ATTR] = layer


def _detach(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    module.__dict__[CACHE_LAYER_ATTR] = None


def install_cache_hooks(modules: list[nn.Module]) -> None:
    """Let ``modules`` (transformers attention modules routed through longattn) keep their decoding state in
    the cache of each call; idempotent."""
    for module in modules:
        if module.__dict__.get(_HOOKED_ATTR):
            continue
        module.register_forward_pre_hook(_attach, with_kwargs=True)
        module.register_forward_hook(_detach, with_kwargs=True)
        module.__dict__[_HOOKED_ATTR] = True
        module.__dict__[CACHE_LAYER_ATTR] = None


def cache_layer_of(module: nn.Module) -> Any:
    """The LongattnCacheLayer of ``module``'s current call, or None (no cache, or no hooks installed)."""
    return module.__dict__.get(CACHE_LAYER_ATTR)
