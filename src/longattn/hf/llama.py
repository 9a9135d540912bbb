"""Llama-style causal language models from transformers' ``LlamaForCausalLM`` with any causal longattn mechanism
(the causal-LM benchmark, ``longattn bench lm``).

``llama_lm`` (family ``causal_lm``): pre-norm Llama blocks (RMSNorm, rotary positions, SwiGLU feed-forward,
grouped-query attention when ``kv_heads`` < ``heads``), the output layer tied to the embeddings. ``softmax`` is
transformers' own SDPA attention (with its own KV cache when decoding); every other mechanism goes through
:func:`longattn.hf.convert`, which takes the model's rotated queries and keys and keeps the mechanism's decoding
state in the model's cache, so ``generate(use_cache=True)`` decodes it token by token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from longattn.attention import capabilities
from longattn.hf.bridge import _transformers
from longattn.hf.convert import convert
from longattn.models.registry import register_model

__all__ = ["LlamaLM", "LlamaShape", "llama_config"]


@dataclass(frozen=True)
class LlamaShape:
    """The size of a from-scratch model (the LM benchmark's CPU preset)."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int | None = None  # None: as many as heads (no grouped-query attention)
    intermediate_size: int = 352


def llama_config(vocab_size: int, max_len: int, shape: LlamaShape, dropout: float = 0.0) -> Any:
    """A ``transformers.LlamaConfig`` of this size; ``max_len`` is the longest sequence (cosFormer's M)."""
    transformers = _transformers()
    if shape.hidden_size % shape.heads:
        raise ValueError(f"hidden_size {shape.hidden_size} is not a multiple of heads {shape.heads}")
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads or shape.heads,
        intermediate_size=shape.intermediate_size, max_position_embeddings=max_len, attention_dropout=dropout,
        tie_word_embeddings=True, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )


@register_model("llama_lm", family="causal_lm", description="Llama decoder (transformers) with any causal mechanism")
class LlamaLM(nn.Module):
    """``transformers.LlamaForCausalLM`` with mechanism ``attention``; see the module docstring."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        attention: str = "softmax",
        attention_options: dict[str, Any] | None = None,
        hidden_size: int = LlamaShape.hidden_size,
        layers: int = LlamaShape.layers,
        heads: int = LlamaShape.heads,
        kv_heads: int | None = LlamaShape.kv_heads,
        intermediate_size: int = LlamaShape.intermediate_size,
        mechanism_seed: int = 0,
    ) -> None:
        super().__init__()
        transformers = _transformers()
        shape = LlamaShape(hidden_size, layers, heads, kv_heads, intermediate_size)
        self.lm = transformers.LlamaForCausalLM(llama_config(vocab_size, max_len, shape))
        options = dict(attention_options or {})
        if attention != "softmax" or options:
            convert(self.lm, attention, max_len=max_len if capabilities(attention).needs_max_len else None,
                    ignore_dropout=True, seed=mechanism_seed, **options)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Next-token logits [B, N, V] (no cache: a training or evaluation forward)."""
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
