"""Sequence-parallel Singularformer: the r pseudo tokens are sums over the sequence.

alpha_V^T X (eqs. 11-13) is a softmax over the sequence: with a shared shift (an all-reduce max,
no gradient: it cancels) each rank sums exp(f - shift) X and exp(f - shift) over its tokens, and
one all-reduce of these [B, r, dim + 1] sums gives every rank the pseudo tokens. The attention
among the r pseudo tokens (eq. 9) then runs on every rank (identical inputs, identical result) and
alpha_U unfolds it to the rank's own tokens. The Gram matrices of the orthogonality loss (eq. 15)
are sums over tokens too: one more all-reduce of [B, 2, r, r] while training. Each rank records
1/P of the auxiliary losses, so that their sum over the ranks is the single-process loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longattn.attention.base import AttentionBase
from longattn.attention.singular import _dropout, orthogonal_loss_from_grams
from longattn.parallel.api import register_form
from longattn.parallel.comm import Shard, all_reduce_max, all_reduce_sum


def _exp_over_sequence(logits: Tensor, keep: Tensor | None, shard: Shard) -> Tensor:
    """exp(f - max over the whole sequence) [B, n, r], zero at padded tokens."""
    if keep is not None:
        logits = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    shift = all_reduce_max(logits.amax(dim=1, keepdim=True), shard)
    weights = torch.exp(logits - shift)
    return weights if keep is None else weights * keep.to(weights.dtype)


@register_form("singular")
def singular_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    p = layer.dropout if layer.training else 0.0
    logits = layer.factor_logits(x)
    shared = logits.dim() == 3
    per_factor = [logits] if shared else list(logits.unbind(dim=2))  # shared, or f_U, f_Q, f_K, f_V
    alpha_u = torch.softmax(per_factor[0], dim=-1)  # eq. 10: over r, local to each token
    keep = None if attention_mask is None else attention_mask.unsqueeze(-1)
    exps = [_exp_over_sequence(f, keep, shard) for f in (per_factor if shared else per_factor[1:])]
    # numerators sum_j e_j x_j and normalisers sum_j e_j of every sequence softmax, in one all-reduce
    sums = all_reduce_sum(
        torch.stack([torch.cat((_dropout(e, p).transpose(1, 2) @ x, e.sum(1).unsqueeze(-1)), dim=-1) for e in exps]),
        shard,
    )  # [F, B, r, dim + 1]
    normalisers = sums[..., -1:]
    pseudo = sums[..., :-1] / torch.where(normalisers > 0, normalisers, torch.ones_like(normalisers))
    pseudo_q, pseudo_k, pseudo_v = (pseudo[0],) * 3 if shared else pseudo.unbind(0)
    out = layer.attend_pseudo_tokens(
        pseudo_q, pseudo_k, pseudo_v, alpha_u, layer_state, p, attention_mask, None, aux_share=1.0 / shard.world_size
    )
    if layer.training and layer.gamma_orthogonal:
        masked_u = alpha_u if keep is None else alpha_u * keep.to(alpha_u.dtype)
        e_v = exps[-1]
        grams = all_reduce_sum(torch.stack((masked_u.transpose(1, 2) @ masked_u, e_v.transpose(1, 2) @ e_v), 1), shard)
        z = normalisers[-1]  # [B, r, 1]: alpha_V^T = e_v^T / z
        z = torch.where(z > 0, z, torch.ones_like(z))
        ortho = orthogonal_loss_from_grams(grams[:, 0], grams[:, 1] / (z @ z.transpose(1, 2)))
        layer.add_aux_loss("singular_orthogonal", layer.gamma_orthogonal * ortho / shard.world_size)
    return out
