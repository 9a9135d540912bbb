"""RealFormer (He et al., 2021): softmax attention with a residual connection on the raw scores.

Each layer adds the previous layer's pre-softmax scores to its own (RealFormer Sec. 3, the
"Residual Attention" equations):

    S_l = Q_l K_l^T / sqrt(d_k) + S_{l-1}
    ResidualAttention(Q, K, V, S_{l-1}) = softmax(S_l) V

and hands ``S_l`` on to layer l + 1 through ``layer_state`` (per head, so consecutive layers need
the same batch, heads and length). The first layer, or any use without ``layer_state``, is plain
softmax attention. The padding mask is applied afresh in every layer and never stored in ``S_l``:
padded query rows and key columns of Q and K are zeroed first, so their scores are exactly 0 and
the carried scores stay finite whatever the padded inputs hold.

Quadratic by nature: the n x n scores are the state that flows between layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    compute_dtype,
    padding_safe,
    register_attention,
)
from longattn.attention.decoding import KVState

__all__ = ["RealformerAttention", "realformer_attention", "realformer_attention_reference"]

#: ``layer_state`` key under which each layer leaves its raw scores S_l for the next one.
SCORES_KEY = "realformer_scores"


def _check_prev_scores(prev_scores: Tensor | None, expected: torch.Size) -> None:
    if prev_scores is not None and prev_scores.shape != expected:
        raise AttentionError(
            f"previous layer's RealFormer scores have shape {list(prev_scores.shape)} but this layer's "
            f"are {list(expected)}: residual attention needs the same batch, heads and length in "
            "consecutive layers"
        )


def _allowed(attention_mask: Tensor | None, is_causal: bool, n_q: int, n_k: int, device: torch.device) -> Tensor | None:
    """Bool [B or 1, 1, n_q, n_k] of the keys each query may attend to (None: all)."""
    allowed = None if attention_mask is None else attention_mask[:, None, None, :]
    if is_causal:
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)
        allowed = causal if allowed is None else allowed & causal
    return allowed


def _zero_padding(t: Tensor, attention_mask: Tensor | None) -> Tensor:
    return t if attention_mask is None else t.masked_fill(~attention_mask[:, None, :, None], 0.0)


@padding_safe
def realformer_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    prev_scores: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Residual attention on [B, H, N, Dh]; returns (output, this layer's raw scores S_l [B, H, N, N]),
    and with ``return_weights`` also softmax(S_l) [B, H, N, N] as it multiplied V (analyses).

    Scores accumulate in :func:`compute_dtype` (float32 for half inputs) and are returned in it.
    Under autocast Q K^T runs in the autocast dtype and the sum S_l in float32 (a fused ``baddbmm``
    would add the carried scores in the autocast dtype). A query with no key to attend to gets zeros.
    """
    check_qkv(query, key, value, attention_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    work = compute_dtype(query.dtype)
    autocast = query.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(query.device.type)
    q = _zero_padding(query, attention_mask)
    k = _zero_padding(key, attention_mask)
    if not autocast:
        q, k = q.to(work), k.to(work)
    n_q, n_k = q.shape[-2], k.shape[-2]
    expected = torch.Size((*q.shape[:2], n_q, n_k))
    _check_prev_scores(prev_scores, expected)
    flat_q, flat_k = q.flatten(0, 1), k.flatten(0, 1).transpose(-1, -2)
    if autocast:
        scores = torch.bmm(flat_q, flat_k).to(work).mul_(scale)
        if prev_scores is not None:
            scores = scores.add_(prev_scores.flatten(0, 1).to(work))
    elif prev_scores is None:
        scores = torch.bmm(flat_q, flat_k).mul_(scale)
    else:  # S_l = prev + scale * Q K^T in one fused kernel
        scores = torch.baddbmm(prev_scores.to(work).flatten(0, 1), flat_q, flat_k, alpha=scale)
    scores = scores.view(expected)
    allowed = _allowed(attention_mask, is_causal, n_q, n_k, q.device)
    no_key = None
    if allowed is not None:
        # A query without any allowed key would be a row of -inf (NaN softmax): let it see every
        # key and zero its output instead, on [B, 1, n_q, 1] rather than a pass over n x n weights.
        no_key = ~allowed.any(-1, keepdim=True)
        allowed = allowed | no_key
    logits = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ (value if autocast else value.to(work))
    if no_key is not None:
        out = out.masked_fill(no_key, 0.0)
    if return_weights:
        return out.to(value.dtype), scores, weights if no_key is None else weights.masked_fill(no_key, 0.0)
    return out.to(value.dtype), scores


@padding_safe
def realformer_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    prev_scores: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The residual-attention equations written plainly (explicit exp-normalise); tests only."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    real_q = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool) if attention_mask is None else attention_mask
    q = query * real_q[:, None, :, None]
    k = key * real_q[:, None, :, None]
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if prev_scores is not None:
        scores = scores + prev_scores
    n_q, n_k = scores.shape[-2:]
    allowed = real_q[:, None, None, :].expand(scores.shape)
    if is_causal:
        allowed = allowed & torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    shifted = scores - scores.amax(-1, keepdim=True)
    weights = torch.exp(shifted) * allowed
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    return torch.einsum("bhij,bhjd->bhid", weights, value), scores


@register_attention(
    "realformer",
    capabilities=Capabilities(causal=True, subquadratic=False, uses_layer_state=True, attention_map=True),
    functional=realformer_attention,
    reference=realformer_attention_reference,
    paper="RealFormer: Transformer Likes Residual Attention (He et al., Findings of ACL 2021)",
)
class RealformerAttention(AttentionBase):
    """Multi-head softmax attention whose raw scores add the previous layer's (residual attention).

    Options:
        residual_scores: read and write the scores in ``layer_state`` (False = plain softmax
            attention, the Post-LN baseline's attention).
        dropout: attention-probability dropout while training.
        scale: score scale; None = 1/sqrt(head dim).
        bias: biases of the Q/K/V/output projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        residual_scores: bool = True,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        if scale is not None and not scale > 0:
            raise AttentionError(f"scale must be positive or None, got {scale!r}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.residual_scores = residual_scores
        self.dropout = dropout
        self.scale = scale

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        carry = self.residual_scores and layer_state is not None
        out, scores, *weights = realformer_attention(
            q, k, v, attention_mask,
            prev_scores=layer_state.get(SCORES_KEY) if carry else None,
            is_causal=self.causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=self.recording_maps,
        )
        if weights:
            self.record_map(weights[0], v, attention_mask)
        if carry:
            layer_state[SCORES_KEY] = scores
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, residual_scores={self.residual_scores}, causal={self.causal}"

    # -- decoding: the KV cache; the new query's score row flows to the next layer ---------------
    decode_state = "kv_cache"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, KVState]:
        carry = self.residual_scores and layer_state is not None
        out, scores = realformer_attention(
            query, key, value, attention_mask, prev_scores=layer_state.get(SCORES_KEY) if carry else None,
            is_causal=True, scale=self.scale, dropout_p=self.dropout if self.training else 0.0)
        if carry:
            layer_state[SCORES_KEY] = scores
        return out, KVState.start(key, value, attention_mask)

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: KVState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, KVState]:
        """Row t of S_l = Q K^T / sqrt(d) + S_{l-1}: the previous layer's row t (left in ``layer_state`` by its step)
        plus the new query's scores against the cached keys; its softmax over the real keys weighs the values."""
        state.append(key, value, real)
        keys, values, visible = state.view()
        work = compute_dtype(query.dtype)
        if real is not None:  # a padded query row scores 0 (its q is zeroed in the full forward too)
            query = query.masked_fill(~real[:, None, None, None], 0.0)
        scale = 1.0 / math.sqrt(query.shape[-1]) if self.scale is None else self.scale
        scores = (query.to(work) @ keys.to(work).transpose(-1, -2)) * scale
        carry = self.residual_scores and layer_state is not None
        if carry and layer_state.get(SCORES_KEY) is not None:
            previous = layer_state[SCORES_KEY]
            _check_prev_scores(previous, scores.shape)
            scores = scores + previous.to(work)
        if carry:
            layer_state[SCORES_KEY] = scores
        sees = visible.any(-1)[:, None, None, None]
        weights = torch.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")), dim=-1)
        weights = torch.where(sees, weights, 0.0)
        if self.training and self.dropout > 0:
            weights = F.dropout(weights, p=self.dropout)
        return (weights @ values.to(work)).to(value.dtype), state
