"""Singularformer (Wu et al., IJCAI 2023): learn the SVD factors of the attention matrix.

The n x n attention matrix of a head is written as ``alpha_U A' alpha_V^T`` (eq. 8) and computed
right to left, so nothing of size n x n ever exists:

* one shared linear map ``X W_a + b_a`` (eq. 14) gives ``[B, N, r]`` logits;
  ``alpha_U`` is their softmax over r (eq. 10) and ``alpha_V^T`` (= ``alpha_Q^T`` = ``alpha_K^T``)
  their softmax over the sequence (eqs. 11-13), masked so padded tokens get zero weight;
* ``alpha_V^T`` merges the n tokens into r pseudo tokens, which run ordinary multi-head attention
  among themselves (eq. 9), optionally with RealFormer's residual of raw scores from the previous
  layer;
* ``alpha_U`` unfolds the r outputs back to n tokens (eqs. 8, 18).

Orthogonality of ``alpha_U``/``alpha_V`` and diagonality of ``A'`` are soft constraints
(eqs. 15-17), recorded as auxiliary losses while training.

Shapes: ``factor_logits`` is ``[B, N, r]`` (shared, eq. 14) or ``[B, N, 4, r]`` (separate
``f_U, f_Q, f_K, f_V`` of eqs. 10-13, the paper's unshared ablation).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    check_qkv,
    compute_dtype,
    merge_heads,
    padding_safe,
    register_attention,
    split_heads,
)

__all__ = [
    "SingularAttention",
    "SingularFactors",
    "diagonal_loss",
    "orthogonal_loss",
    "singular_attention",
    "singular_attention_reference",
    "singular_factors",
    "singular_map",
]

#: ``layer_state`` key under which each layer leaves its pseudo-token scores for the next one.
SCORES_KEY = "singular_scores"


class SingularFactors(NamedTuple):
    """The learned SVD-like factors of eqs. 10-13 (``alpha_*_t`` are the transposed, [B, r, N] ones)."""

    alpha_u: Tensor  # [B, N, r], rows sum to 1 (softmax over r)
    alpha_q_t: Tensor  # [B, r, N], rows sum to 1 over the real tokens
    alpha_k_t: Tensor
    alpha_v_t: Tensor


def _check_factor_logits(factor_logits: Tensor, batch: int, length: int, dtype: torch.dtype) -> None:
    if not isinstance(factor_logits, Tensor) or factor_logits.dtype != dtype:
        raise AttentionError(f"factor_logits must be a tensor of the inputs' dtype {dtype}")
    if factor_logits.dim() not in (3, 4) or factor_logits.shape[:2] != (batch, length):
        raise AttentionError(
            f"factor_logits must be [B, N, r] or [B, N, 4, r] with B={batch}, N={length}, "
            f"got {list(factor_logits.shape)}"
        )
    if factor_logits.dim() == 4 and factor_logits.shape[2] != 4:
        raise AttentionError(
            "unshared factor_logits must stack f_U, f_Q, f_K, f_V on dim 2: [B, N, 4, r], "
            f"got {list(factor_logits.shape)}"
        )


def _sequence_softmax_t(logits: Tensor, attention_mask: Tensor | None) -> Tensor:
    """softmax over the sequence of ``logits`` [B, N, r], transposed to [B, r, N] (eqs. 11-13).

    Padded tokens get exactly zero weight; a sequence with no real token gets all-zero rows (not
    NaN), so its pseudo tokens are zero and nothing leaks from padding.
    """
    if attention_mask is None:
        return torch.softmax(logits, dim=1).transpose(1, 2)
    keep = attention_mask.unsqueeze(-1)
    logits = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    return (torch.softmax(logits, dim=1) * keep.to(logits.dtype)).transpose(1, 2)


def singular_factors(factor_logits: Tensor, attention_mask: Tensor | None = None) -> SingularFactors:
    """alpha_U (eq. 10) and alpha_Q^T, alpha_K^T, alpha_V^T (eqs. 11-13) from the f(X) logits."""
    if factor_logits.dim() == 3:  # eq. 14: one shared projection for all four factors
        alpha_u = torch.softmax(factor_logits, dim=-1)
        alpha_t = _sequence_softmax_t(factor_logits, attention_mask)
        return SingularFactors(alpha_u, alpha_t, alpha_t, alpha_t)
    u, q, k, v = factor_logits.unbind(dim=2)
    return SingularFactors(
        torch.softmax(u, dim=-1),
        _sequence_softmax_t(q, attention_mask),
        _sequence_softmax_t(k, attention_mask),
        _sequence_softmax_t(v, attention_mask),
    )


def _pseudo_token_attention(
    pseudo_q: Tensor,
    pseudo_k: Tensor,
    pseudo_v: Tensor,
    prev_scores: Tensor | None,
    scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Multi-head attention among the r pseudo tokens (eq. 9) on [B, H, r, Dh].

    Returns (context [B, H, r, Dh], A' [B, H, r, r], scores [B, H, r, r]); ``scores`` are the raw
    scores plus ``prev_scores`` (RealFormer), i.e. what the next layer adds to its own. Scores, their
    sum over the layers and the softmax are float32 for half inputs (:func:`compute_dtype`).
    """
    scores = (pseudo_q @ pseudo_k.transpose(-1, -2)).to(compute_dtype(pseudo_q.dtype)) * scale
    if prev_scores is not None:
        if prev_scores.shape != scores.shape:
            raise AttentionError(
                f"previous layer's pseudo-token scores have shape {list(prev_scores.shape)} but this "
                f"layer's are {list(scores.shape)}: residual scores need the same batch, heads and rank "
                "in consecutive layers (or residual_scores=False)"
            )
        scores = scores + prev_scores
    attn = torch.softmax(scores, dim=-1)
    context = _dropout(attn, dropout_p).to(pseudo_v.dtype) @ pseudo_v
    return context, attn, scores


def _dropout(t: Tensor, p: float) -> Tensor:
    return F.dropout(t, p=p) if p > 0 else t  # callers pass p = 0 in eval


def _default_scale(head_dim: int, scale: float | None) -> float:
    # eq. 1 scales by 1/sqrt(d/m); eq. 9 omits it, the authors' code keeps it (see docs/singular.md).
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


@padding_safe
def singular_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    factor_logits: Tensor,
    prev_scores: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_scores: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Singular attention (eq. 18) on per-token heads [B, H, N, Dh] in O(N r Dh) time and memory.

    ``factor_logits``: ``f(X)`` of eq. 14, [B, N, r] (or [B, N, 4, r] unshared), shared by all
    heads. ``prev_scores``: the previous layer's [B, H, r, r] scores (RealFormer residual).
    With ``return_scores`` also returns this layer's scores for the next layer.
    """
    check_qkv(query, key, value, attention_mask)
    batch, _, length, head_dim = query.shape
    if key.shape[2] != length:
        raise AttentionError("singular attention is self-attention: query and key lengths must match")
    _check_factor_logits(factor_logits, batch, length, query.dtype)
    factors = singular_factors(factor_logits, attention_mask)
    # alpha^T Q, alpha^T K, alpha^T V: n tokens -> r pseudo tokens, shared over heads (eq. 9)
    pseudo_q = _dropout(factors.alpha_q_t, dropout_p).unsqueeze(1) @ query
    pseudo_k = _dropout(factors.alpha_k_t, dropout_p).unsqueeze(1) @ key
    pseudo_v = _dropout(factors.alpha_v_t, dropout_p).unsqueeze(1) @ value
    context, _, scores = _pseudo_token_attention(
        pseudo_q, pseudo_k, pseudo_v, prev_scores, _default_scale(head_dim, scale), dropout_p
    )
    out = _dropout(factors.alpha_u, dropout_p).unsqueeze(1) @ context  # alpha_U (A' alpha_V^T V), eq. 8
    return (out, scores) if return_scores else out


@padding_safe
def singular_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    factor_logits: Tensor,
    prev_scores: Tensor | None = None,
    scale: float | None = None,
    return_scores: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Plain eq. 8: builds the full n x n matrix alpha_U A' alpha_V^T, then multiplies V. Tests only."""
    head_dim = query.shape[-1]
    logits = factor_logits if factor_logits.dim() == 4 else torch.stack([factor_logits] * 4, dim=2)
    f_u, f_q, f_k, f_v = logits.unbind(dim=2)
    real = (
        torch.ones(f_u.shape[:2], dtype=torch.bool, device=f_u.device)
        if attention_mask is None
        else attention_mask
    )

    def over_sequence(f: Tensor) -> Tensor:  # [B, N, r] -> [B, r, N], exp-normalise real tokens
        w = torch.exp(f - f.amax(dim=1, keepdim=True)) * real.unsqueeze(-1)
        return (w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)).transpose(1, 2)

    alpha_u = torch.exp(f_u) / torch.exp(f_u).sum(dim=-1, keepdim=True)
    alpha_q_t, alpha_k_t, alpha_v_t = over_sequence(f_q), over_sequence(f_k), over_sequence(f_v)
    scores = torch.einsum("brn,bhnd,bsm,bhmd->bhrs", alpha_q_t, query, alpha_k_t, key)
    scores = scores * _default_scale(head_dim, scale)
    if prev_scores is not None:
        scores = scores + prev_scores
    a_prime = torch.exp(scores - scores.amax(-1, keepdim=True))
    a_prime = a_prime / a_prime.sum(-1, keepdim=True)
    out = singular_map(alpha_u, a_prime, alpha_v_t) @ value
    return (out, scores) if return_scores else out


def singular_map(alpha_u: Tensor, a_prime: Tensor, alpha_v_t: Tensor) -> Tensor:
    """The n x n attention matrix of each head, alpha_U A' alpha_V^T (eq. 8): [B, N, r], [B, H, r, r],
    [B, r, N] -> [B, H, N, N]. Materialised: reference and analyses only."""
    return torch.einsum("bnr,bhrs,bsm->bhnm", alpha_u, a_prime, alpha_v_t)


def orthogonal_loss(alpha_u: Tensor, alpha_v_t: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Eq. 15: off-diagonal energy of the r x r Gram matrices of alpha_U's columns and alpha_V^T's rows.

    ``(1/r^2) ||(alpha_U^T alpha_U) o (1 - I)||_F^2 + (1/r^2) ||(alpha_V^T alpha_V) o (1 - I)||_F^2``,
    averaged over the batch. Padded rows of alpha_U are left out (alpha_V^T is zero there already).
    """
    if attention_mask is not None:
        alpha_u = alpha_u * attention_mask.unsqueeze(-1).to(alpha_u.dtype)
    gram_u = alpha_u.transpose(1, 2) @ alpha_u  # [B, r, r]
    gram_v = alpha_v_t @ alpha_v_t.transpose(1, 2)  # [B, r, r]
    return orthogonal_loss_from_grams(gram_u, gram_v)


def orthogonal_loss_from_grams(gram_u: Tensor, gram_v: Tensor) -> Tensor:
    """Eq. 15 from the two [B, r, r] Gram matrices (sums over the tokens, so a sequence split
    across processes sums its shards' Grams first)."""
    rank = gram_u.shape[-1]
    off_diagonal = 1.0 - torch.eye(rank, dtype=gram_u.dtype, device=gram_u.device)
    energy_u = (gram_u * off_diagonal).square().sum((-1, -2))
    energy_v = (gram_v * off_diagonal).square().sum((-1, -2))
    return ((energy_u + energy_v) / rank**2).mean()


def diagonal_loss(a_prime: Tensor) -> Tensor:
    """Eq. 16: ``(1/r^2) ||A' o (1 - I)||_F^2`` of the pseudo-token attention [..., r, r], averaged over
    batch and heads."""
    rank = a_prime.shape[-1]
    off_diagonal = 1.0 - torch.eye(rank, dtype=a_prime.dtype, device=a_prime.device)
    return ((a_prime * off_diagonal).square().sum((-1, -2)) / rank**2).mean()


@register_attention(
    "singular",
    capabilities=Capabilities(aux_losses=True, uses_layer_state=True, subquadratic=True, sequence_parallel=True,
                              attention_map=True),
    functional=singular_attention,
    reference=singular_attention_reference,
    paper="Singularformer: Learning to Decompose Self-Attention to Linearize the Complexity of "
    "Transformer (Wu et al., IJCAI 2023)",
)
class SingularAttention(AttentionBase):
    """Singularformer attention: n tokens -> r pseudo tokens -> multi-head attention -> n tokens.

    Options (paper defaults):
        rank: r, the number of pseudo tokens; None = head dim d/m (Sec. 3.1, "Value of r").
        residual_scores: add the previous layer's pseudo-token scores (RealFormer) through
            ``layer_state``; no effect when ``layer_state`` is None.
        gamma_orthogonal, gamma_diagonal: gamma_1, gamma_2 of eq. 17 (0.01, Table 2); 0 disables.
        shared_factors: one projection W_a for f_U, f_Q, f_K, f_V (eq. 14); False = four.
        dropout: dropout on alpha_V^T, A' and alpha_U while training (as the authors' code).
        scale: pseudo-token score scale; None = 1/sqrt(d/m).
        bias: biases of W_a and the Q/K/V/output projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        rank: int | None = None,
        residual_scores: bool = True,
        gamma_orthogonal: float = 0.01,
        gamma_diagonal: float = 0.01,
        shared_factors: bool = True,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        rank = self.head_dim if rank is None else rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise AttentionError(f"rank must be a positive int or None (= head dim), got {rank!r}")
        for label, gamma in (("gamma_orthogonal", gamma_orthogonal), ("gamma_diagonal", gamma_diagonal)):
            if not isinstance(gamma, (int, float)) or gamma < 0:
                raise AttentionError(f"{label} must be a non-negative number, got {gamma!r}")
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        if scale is not None and not scale > 0:
            raise AttentionError(f"scale must be positive or None, got {scale!r}")
        self.rank = rank
        self.residual_scores = residual_scores
        self.gamma_orthogonal = float(gamma_orthogonal)
        self.gamma_diagonal = float(gamma_diagonal)
        self.shared_factors = shared_factors
        self.dropout = dropout
        self.scale = _default_scale(self.head_dim, scale)
        # f(X) = X W_a + b_a (eq. 14); four stacked maps for the unshared ablation (eqs. 10-13)
        self.to_factors = nn.Linear(dim, rank if shared_factors else 4 * rank, bias=bias)
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(dim, dim, bias=bias)
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)

    def factor_logits(self, x: Tensor) -> Tensor:
        """f(X): [B, N, r] shared, or [B, N, 4, r] for separate f_U, f_Q, f_K, f_V."""
        logits = self.to_factors(x)
        return logits if self.shared_factors else logits.unflatten(-1, (4, self.rank))

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        factors = singular_factors(self.factor_logits(x), attention_mask)
        p = self.dropout if self.training else 0.0
        # Merge tokens before projecting: alpha^T (X W + b) = (alpha^T X) W + b as alpha^T's rows sum
        # to 1, so Q, K, V are only ever computed for the r pseudo tokens (Table 1's r d^2 terms).
        if self.shared_factors:
            pseudo_x = _dropout(factors.alpha_v_t, p) @ x
            pseudo_q, pseudo_k, pseudo_v = pseudo_x, pseudo_x, pseudo_x
        else:
            pseudo_q = _dropout(factors.alpha_q_t, p) @ x
            pseudo_k = _dropout(factors.alpha_k_t, p) @ x
            pseudo_v = _dropout(factors.alpha_v_t, p) @ x
        # analysis only (record_attention_maps): the per-head values of the n tokens that the n x n map multiplies
        map_value = split_heads(self.to_v(x), self.heads) if self.recording_maps else None
        return self.attend_pseudo_tokens(pseudo_q, pseudo_k, pseudo_v, factors.alpha_u, layer_state, p, attention_mask,
                                         factors, map_value=map_value)

    def attend_pseudo_tokens(
        self,
        pseudo_q: Tensor,
        pseudo_k: Tensor,
        pseudo_v: Tensor,
        alpha_u: Tensor,
        layer_state: dict | None,
        p: float,
        attention_mask: Tensor | None,
        factors: SingularFactors | None,
        aux_share: float = 1.0,
        map_value: Tensor | None = None,
    ) -> Tensor:
        """Eq. 9 among the r pseudo tokens [B, r, dim], then alpha_U unfolds them (eqs. 3, 8), and the
        auxiliary losses of eq. 17 while training. A sequence split across processes
        (longattn.parallel) passes ``factors=None`` with its own orthogonality loss and each
        process's ``aux_share`` of the losses, so that their sum over the processes is the loss.
        With ``map_value`` (the n tokens' per-head values) the layer records its n x n map for analysis."""
        prev = None
        if self.residual_scores and layer_state is not None:
            prev = layer_state.get(SCORES_KEY)
        context, a_prime, scores = _pseudo_token_attention(
            split_heads(self.to_q(pseudo_q), self.heads),
            split_heads(self.to_k(pseudo_k), self.heads),
            split_heads(self.to_v(pseudo_v), self.heads),
            prev,
            self.scale,
            p,
        )
        if self.residual_scores and layer_state is not None:
            layer_state[SCORES_KEY] = scores
        if map_value is not None and factors is not None:
            self.record_map(singular_map(alpha_u, a_prime, factors.alpha_v_t), map_value, attention_mask)
        # Output projection on the r pseudo tokens, then alpha_U unfolds them to n (eqs. 3, 8).
        out = _dropout(alpha_u, p) @ self.to_out(merge_heads(context))
        if self.training:
            # eq. 17: this layer's share of the loss; collect_aux_losses sums layers exactly once.
            if self.gamma_orthogonal and factors is not None:
                ortho = orthogonal_loss(factors.alpha_u, factors.alpha_v_t, attention_mask)
                self.add_aux_loss("singular_orthogonal", self.gamma_orthogonal * ortho)
            if self.gamma_diagonal:
                self.add_aux_loss("singular_diagonal", self.gamma_diagonal * aux_share * diagonal_loss(a_prime))
        return out

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, rank={self.rank}, residual_scores={self.residual_scores}, "
            f"gamma_orthogonal={self.gamma_orthogonal}, gamma_diagonal={self.gamma_diagonal}, "
            f"shared_factors={self.shared_factors}"
        )
