"""Put a longattn mechanism that owns parameters or state into a pretrained transformers model.

:func:`convert` adds the mechanism to every self-attention module it can map, as a child named
``longattn`` (so every new parameter's key contains ``.longattn.``), and keeps the model's own Q, K, V and
output projections under their original keys: the mechanism uses them in place of its own.

* Mechanisms that take q, k, v (softmax, linformer, transformer_ls, sinkhorn, ...) receive the model's
  own, after its rotary embedding, and only add their parameters (Linformer's E and F...).
* Mechanisms that project the hidden states themselves (skeleton after its Smoother, singular, fsat,
  fat, luna) get the model's linear layers as their Q/K/V projections, on models with absolute
  positions (a rotary model would lose its positions: that raises).
* Mechanisms with no Q/K/V to map (synthesizer, fnet, reformer's shared QK, ponet, flash) refuse unless
  ``fresh=True``, which gives them their own freshly initialised projections.

The conversion is recorded in ``model.config.longattn``; :func:`from_pretrained` rebuilds a saved model
with identical outputs. A saved model refuses to load without longattn: its config.json names
:data:`SAVED_ATTN_IMPLEMENTATION` as its attention implementation, which no transformers registry holds, so
``AutoModel.from_pretrained`` raises transformers' "is not supported" error naming it (refused rather than
warned: a converted model loaded as softmax attention gives other outputs, and a warning is easily lost).
Parameterised conversions start from random new parameters: they are starting points for fine-tuning, not
zero-shot replacements.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from longattn.attention.base import AttentionBase, AttentionError, build, get_spec
from longattn.train.checkpoint import CheckpointError, first_line, load_weights
from longattn.hf.bridge import (
    CONVERTED_KEY,
    PROJECTION_NAMES,
    ModelProjections,
    _cache_layer,
    _register_converted,
    _transformers,
    attention_modules,
    causal_options,
    packed_segments_of,
    check_dispatch,
    run_mechanism,
    uses_projections,
)

__all__ = ["attention_modules", "convert", "from_pretrained", "NO_QKV_MAPPING", "SAVED_ATTN_IMPLEMENTATION"]

# config.json's attention implementation of a saved converted model: registered nowhere, so that transformers
# refuses to load the model without longattn, with this text in its error
SAVED_ATTN_IMPLEMENTATION = ("longattn_converted: a model converted by longattn, load it with "
                             "longattn.hf.from_pretrained")

# Mechanisms without a proj (QKVProjection): which of their layers take the model's query/key/value
# projections. Their output projection becomes the identity (the model applies its own afterwards).
_OWN_LINEARS: dict[str, dict[str, str]] = {
    "singular": {"to_q": "q", "to_k": "k", "to_v": "v"},
    "fsat": {"to_q": "q", "to_k": "k", "to_v": "v"},
    "fat": {"to_q": "q", "to_k": "k", "to_v": "v"},
    # Luna: queries of the unpack attention and keys/values of the pack attention read the sequence X
    "luna": {"unpack_q": "q", "pack_k": "k", "pack_v": "v"},
    "vmean": {"to_v": "v"},
}
# Mechanisms whose projections have no counterpart in a pretrained model: synthesized or Fourier token
# mixing, reformer's shared QK, PoNet's fused pooling branches, FLASH's gated unit (which also
# replaces the feed-forward network in longattn's models; in a converted model the FFN stays).
NO_QKV_MAPPING = frozenset({"synthesizer", "fnet", "reformer", "ponet", "flash"})

STATE_ATTR = "_longattn_layer_state"


@dataclass
class _Runtime:
    """Per converted layer: what the attention call needs besides q, k, v (not saved, not a module)."""

    projections: ModelProjections | None
    holder: dict = field(default_factory=dict)  # {"current": layer_state of this forward} shared by layers
    ignore_dropout: bool = False
    hidden_states: Tensor | None = None
    rotary: bool = False
    calls: int = 0


def _heads(module: nn.Module) -> tuple[int, int]:
    config = getattr(module, "config", None)
    heads = getattr(module, "num_attention_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(module, "attention_head_size", None) or getattr(module, "head_dim", None)
    if not heads or not head_dim:
        raise AttentionError(f"cannot read the number of heads and head size of {type(module).__name__}")
    return int(heads), int(head_dim)


def _alias(owner: nn.Module, attribute: str, linear: nn.Module) -> None:
    """owner.attribute becomes the model's layer without registering it a second time (its parameters
    keep their original key only)."""
    owner._modules.pop(attribute, None)
    object.__setattr__(owner, attribute, linear)


def _attach(mechanism: AttentionBase, module: nn.Module, family: str, fresh: bool, label: str) -> ModelProjections | None:
    q, k, v = (getattr(module, n) for n in PROJECTION_NAMES[family])
    linears = {"to_q": q, "to_k": k, "to_v": v}
    if fresh:
        return None  # its own projections, all new
    if uses_projections(mechanism):
        projections = ModelProjections(mechanism.heads, linears=linears, label=label)
        mechanism.proj = projections
        return projections
    mapping = _OWN_LINEARS.get(mechanism.name)
    if mapping is None:
        raise AttentionError(
            f"{mechanism.name} has no query/key/value projections to take the pretrained ones "
            "to map: pass fresh=True to start it from freshly initialised projections"
        )
    for attribute, role in mapping.items():
        if getattr(mechanism, attribute, None) is not None:
            _alias(mechanism, attribute, linears["to_" + role])
    mechanism.to_out = nn.Identity()  # the model applies its own output projection
    return None


def _runtime(mechanism: AttentionBase) -> _Runtime:
    return mechanism.__dict__["_longattn_runtime"]


def _before_attention(module: nn.Module, args: tuple, kwargs: dict) -> None:
    runtime = _runtime(module.longattn)
    runtime.hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    runtime.rotary = kwargs.get("position_embeddings") is not None


def _after_attention(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    _runtime(module.longattn).hidden_states = None


def _before_model(model: nn.Module, args: tuple) -> None:
    model.__dict__[STATE_ATTR]["current"] = {}  # one layer_state per forward, handed to every layer


def _after_model(model: nn.Module, args: tuple, output: Any) -> None:
    model.__dict__[STATE_ATTR]["current"] = None


def attend_converted(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *,
                     dropout: float, scaling: float | None, causal: bool, kwargs: dict | None = None) -> Tensor:
    """The attention call of a converted layer (see longattn.hf.bridge)."""
    mechanism: AttentionBase = module.longattn
    runtime = _runtime(mechanism)
    if causal != mechanism.causal:
        raise AttentionError(
            f"{type(module).__name__} was converted with causal={mechanism.causal} but is now called with "
            f"is_causal={causal}"
        )
    if runtime.hidden_states is None:
        raise AttentionError(f"{type(module).__name__}.longattn was called outside its module's forward")
    if runtime.rotary and runtime.projections is None:
        raise AttentionError(
            f"{mechanism.name} computes its queries and keys from the hidden states, so it would skip this "
            "model's rotary position embedding: convert it on models with absolute positions (BERT family)"
        )
    runtime.calls += 1
    return run_mechanism(
        mechanism, runtime.projections, module, query, key, value, attention_mask,
        dropout=dropout, scaling=scaling, hidden_states=runtime.hidden_states,
        layer_state=runtime.holder.get("current"), ignore_dropout=runtime.ignore_dropout, rotary=runtime.rotary,
        cache_layer=_cache_layer(module),
        segments=packed_segments_of(attention_mask, kwargs or {}, query.shape[0], query.shape[2]),
    )


def _own_config(model: nn.Module) -> None:
    """Give ``model`` its own copy of its config (and sub-configs), in every module that holds it: the conversion
    records itself there and switches the attention implementation, which must not reach the caller's config
    object (nor other models built from it)."""
    memo: dict[int, Any] = {}
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in memo:
            module.__dict__["config"] = memo[id(held)]


def convert(
    model: nn.Module,
    name: str,
    *,
    max_len: int | None = None,
    layers: Sequence[int] | None = None,
    fresh: bool = False,
    ignore_dropout: bool = False,
    seed: int = 0,
    **options: Any,
) -> nn.Module:
    """Replace the self-attention of ``model`` (in place) by longattn mechanism ``name``; returns ``model``.

    Args:
        max_len: for mechanisms with a fixed length (skeleton, linformer...); default: the model's
            ``max_position_embeddings``.
        layers: indices (in module order) of the attention modules to convert; default all. The
            others run exact softmax attention.
        fresh: give mechanisms without a Q/K/V mapping (synthesizer, fnet, reformer) new projections.
        ignore_dropout: run mechanisms without attention-probability dropout even when the model
            trains with attention dropout.
        seed: the new parameters and random buffers of layer i are drawn from seed + i.
        options: the mechanism's module options (``s1=16``, ``k=64``...).
    """
    _transformers()
    spec = get_spec(name)
    if hasattr(getattr(model, "config", None), "longattn") or STATE_ATTR in model.__dict__:
        raise AttentionError("this model is already converted; convert the original model instead")
    found = attention_modules(model)
    if not found:
        raise AttentionError(
            f"{type(model).__name__} has no self-attention module with query/key/value or "
            "q_proj/k_proj/v_proj projections that longattn.hf.convert can map"
        )
    _own_config(model)
    indices = list(range(len(found))) if layers is None else [int(i) for i in layers]
    bad = [i for i in indices if not 0 <= i < len(found)]
    if bad:
        raise AttentionError(f"layers {bad} out of range: the model has {len(found)} attention modules")
    if spec.capabilities.needs_max_len and max_len is None:
        max_len = getattr(model.config, "max_position_embeddings", None)
    holder: dict = {"current": None}
    for i in indices:
        qualified, module, family = found[i]
        heads, head_dim = _heads(module)
        causal = bool(getattr(module, "is_causal", False))
        if causal and not spec.capabilities.causal:
            raise AttentionError(f"{name} does not support causal masking, which {type(module).__name__} needs")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            mechanism = build(name, dim=heads * head_dim, heads=heads, max_len=max_len, causal=causal,
                              **causal_options(name, options, causal, model.config))
        projections = _attach(mechanism, module, family, fresh, name)
        param = next(module.parameters())
        mechanism.to(device=param.device, dtype=param.dtype).train(module.training)
        mechanism.__dict__["_longattn_runtime"] = _Runtime(projections, holder, ignore_dropout)
        module.longattn = mechanism
        module.register_forward_pre_hook(_before_attention, with_kwargs=True)
        module.register_forward_hook(_after_attention, with_kwargs=True)
    from longattn.hf.cache import install_cache_hooks

    install_cache_hooks([found[i][1] for i in indices])  # generate(use_cache=True) keeps the decoding states
    model.__dict__[STATE_ATTR] = holder
    model.register_forward_pre_hook(_before_model)
    model.register_forward_hook(_after_model)
    model.config.longattn = {
        "name": name, "options": options, "max_len": max_len, "layers": indices, "fresh": fresh,
        "ignore_dropout": ignore_dropout, "seed": seed,
    }
    model.config.attn_implementation = SAVED_ATTN_IMPLEMENTATION  # written by save_pretrained, read back below
    _register_converted(attend_converted)
    model.set_attn_implementation(CONVERTED_KEY)
    if getattr(model.config, "_attn_implementation", None) != CONVERTED_KEY:
        raise AttentionError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface"
        )
    converted = [(found[i][0], found[i][1]) for i in indices]
    return check_dispatch(model, lambda: [q for q, m in converted if _runtime(m.longattn).calls == 0])


def _state_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index} is damaged: not a safetensors index ({first_line(error)})") from None
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors (save with model.save_pretrained)")
    return [single]


def from_pretrained(path: str | Path, model_class: type | None = None, *, check_finite: bool = True,
                    **config_overrides: Any) -> nn.Module:
    """Load a model saved after :func:`convert` (``save_pretrained``): rebuild, convert as recorded in its
    config, load every weight (safetensors only, no pickle). Returns the model in eval mode. ``check_finite``:
    non-finite weights (a file whose bytes were overwritten) raise, naming the tensor."""
    transformers = _transformers()
    from safetensors.torch import load_file

    folder = Path(path)
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, **config_overrides)
    record = getattr(config, "longattn", None)
    if not isinstance(record, dict) or "name" not in record:
        raise AttentionError(f"{folder} holds no longattn conversion (config.longattn is missing)")
    del config.longattn
    if config._attn_implementation == SAVED_ATTN_IMPLEMENTATION:
        config._attn_implementation = None  # convert below sets longattn's
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        if not architectures or not hasattr(transformers, architectures[0]):
            raise AttentionError(f"{folder}: config.architectures does not name a transformers class; pass model_class")
        model_class = getattr(transformers, architectures[0])
    model = model_class(config)
    convert(model, record["name"], max_len=record.get("max_len"), layers=record.get("layers"),
            fresh=record.get("fresh", False), ignore_dropout=record.get("ignore_dropout", False),
            seed=record.get("seed", 0), **record.get("options", {}))
    state: dict[str, Tensor] = {}
    for file in _state_files(folder):
        try:
            state.update(load_file(str(file)))
        except Exception as error:  # safetensors' SafetensorError (damaged header or data), OSError
            raise CheckpointError(f"{file} is damaged or truncated ({first_line(error)})") from None
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    # a config.json edited since the save (sizes, or the mechanism's options) builds a model the weights
    # do not fit: an error naming the folder, not torch's long one
    load_weights(model, state, ", ".join(str(file) for file in _state_files(folder)), ignore=lambda name: name in tied,
                 hint=f"{folder / 'config.json'} no longer describes the saved model (edited since save_pretrained?)",
                 check_finite=check_finite)
    model.tie_weights()
    return model.eval()
