"""Exact softmax attention (Vaswani et al., 2017), the quadratic reference every method is measured against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import (
    AttentionBase,
    Capabilities,
    QKVProjection,
    check_qkv,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.decoding import KVState, attend_keys


def _sdpa_mask(attention_mask: Tensor | None) -> Tensor | None:
    # SDPA's bool attn_mask also uses True = "may attend"; broadcast the key mask over heads and queries.
    return None if attention_mask is None else attention_mask[:, None, None, :]


@padding_safe
def softmax_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """softmax(Q K^T * scale) V through ``torch.nn.functional.scaled_dot_product_attention``.

    ``attention_mask``: bool [B, N], True = real key. Queries whose keys are all padded get zeros.
    """
    check_qkv(query, key, value, attention_mask)
    if (dropout_p > 0 and attention_mask is None and not is_causal and query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.float64)):
        return _math_path_with_dropout(query, key, value, dropout_p, scale)
    mask = _sdpa_mask(attention_mask)
    if (is_causal and mask is not None and query.shape[-2] == key.shape[-2] and not uses_gpu_path(query)
            and bool(attention_mask.all())):
        mask = None  # no padding: SDPA's own causal form, without an N x N mask (the check costs no sync on a CPU)
    if is_causal and mask is not None:
        n_q, n_k = query.shape[-2], key.shape[-2]
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(n_k - n_q)
        mask, is_causal = mask & causal, False
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    if attention_mask is not None:
        # A query row with no valid key is NaN in SDPA's math path; define it as zero.
        out = out.masked_fill(~attention_mask.any(-1)[:, None, None, None], 0.0)
    return out


def _math_path_with_dropout(query: Tensor, key: Tensor, value: Tensor, dropout_p: float,
                            scale: float | None) -> Tensor:
    """SDPA on CPU with ``dropout_p`` > 0, no mask, not causal: the operations of its math path (which it takes
    for dropout on CPU), written out, with the same numbers and the same random draws: q and k each scaled by
    sqrt(scale), softmax, ``F.dropout`` (one ``bernoulli_(1 - p)`` over a tensor of the weights' shape and
    dtype), the product with v. Left out is the math path's ``_safe_softmax`` guard (``isneginf``, ``all`` and
    ``where`` over the [B, H, N_q, N_k] scores, and the ``where``'s backward), which zeroes rows whose scores are
    all -inf: without a mask only non-finite inputs make one. About 0.8x the CPU time of the SDPA call, forward
    and backward (docs/performance.md, issue 17's fifth pass)."""
    root_scale = (1.0 / math.sqrt(query.shape[-1]) if scale is None else scale) ** 0.5
    weights = torch.softmax((query * root_scale) @ (key.transpose(-2, -1) * root_scale), dim=-1)
    return F.dropout(weights, dropout_p) @ value


def softmax_weights(
    query: Tensor,
    key: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The n x n matrix softmax(Q K^T * scale) [B, H, N_q, N_k], padded keys (and, causal, later
    keys) at zero; a query without any key gets a zero row. Materialised: reference and analyses only."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = query @ key.transpose(-1, -2) * scale
    allowed = torch.ones_like(scores, dtype=torch.bool)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :]
    if is_causal:
        n_q, n_k = scores.shape[-2:]
        allowed = allowed & torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).tril(n_k - n_q)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


@padding_safe
def softmax_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Plain math: materialises the full score matrix. Float64-friendly; for tests only."""
    return softmax_weights(query, key, attention_mask, is_causal=is_causal, scale=scale) @ value


@register_attention(
    "softmax",
    capabilities=Capabilities(causal=True, subquadratic=False, sequence_parallel=True, attention_map=True),
    functional=softmax_attention,
    reference=softmax_attention_reference,
    paper="Attention Is All You Need (Vaswani et al., 2017)",
)
class SoftmaxAttention(AttentionBase):
    """Exact multi-head softmax attention via PyTorch SDPA."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.dropout = dropout
        self.scale = scale

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        out = softmax_attention(
            q, k, v, attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal,
            scale=self.scale,
        )
        if self.recording_maps:  # analysis only: SDPA's fused kernel never forms the weights
            self.record_map(softmax_weights(q, k, attention_mask, is_causal=self.causal, scale=self.scale), v,
                            attention_mask)
        return self.proj.out(out)

    # -- decoding: the KV cache -----------------------------------------------------------------
    decode_state = "kv_cache"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, KVState]:
        out = softmax_attention(query, key, value, attention_mask, dropout_p=self.dropout if self.training else 0.0,
                                is_causal=True, scale=self.scale)
        return out, KVState.start(key, value, attention_mask)

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: KVState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, KVState]:
        """The new query against every cached key (the new one included)."""
        state.append(key, value, real)
        keys, values, visible = state.view()
        visible = visible[:, None, None, :] if state.padded else None
        out = attend_keys(query, keys, values, visible, scale=self.scale,
                          dropout_p=self.dropout if self.training else 0.0)
        return out, state
