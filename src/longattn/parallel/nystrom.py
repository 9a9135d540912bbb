"""Sequence-parallel Nystromformer: the m landmarks and their values are sums over the sequence.

Landmark j averages the real tokens of rank [j s, (j + 1) s) among the sequence's L real ones,
s = ceil(L / m) (eq. 13-14, as nystrom_attention): each rank adds its tokens into their landmarks' sums and one all-reduce of [B, H, m, 2 Dh]
sums (plus the m real-token counts) gives every rank the landmarks. softmax(Q~ K^T) V (the right
factor of eq. 15) is a softmax over the whole sequence: a shared shift (all-reduce max, no
gradient) and one all-reduce of the [B, H, m, Dh + 1] exp-sums. The m x m kernel, its pseudo-inverse
(eq. 16) and each rank's queries' softmax(Q K~^T) need nothing more; the depth-wise convolution of
V along the sequence reads kernel // 2 tokens of each neighbouring rank (halo exchange).
All exchanged sizes are independent of N.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import AttentionBase
from longattn.attention.nystrom import _masked_softmax, depthwise_value_conv, iterative_pinv
from longattn.parallel.api import register_form
from longattn.parallel.comm import Shard, all_reduce_max, all_reduce_sum, exchange_halos


@register_form("nystrom")
def nystrom_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    query, key, value = layer.proj.qkv(x)
    batch, heads, n, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim)
    real = torch.ones(batch, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
    keep = real[:, None, :, None].to(value.dtype)
    query_real, key_real, value = query * keep, key * keep, value * keep

    m = layer.num_landmarks
    # segments over each sequence's real tokens (as nystrom_attention with a mask; the same as by
    # position without padding): the real token of rank r among the L real ones is in segment
    # r // ceil(L / m); the ranks before this shard come from every rank's real-token count
    real_counts = real.new_zeros(shard.world_size, batch, dtype=value.dtype)
    real_counts[shard.rank] = real.sum(-1)
    real_counts = all_reduce_sum(real_counts, shard)  # [P, B]
    earlier = real_counts[: shard.rank].sum(0).long()[:, None]
    segment = (real_counts.sum(0).long()[:, None] + m - 1).div(m, rounding_mode="floor").clamp(min=1)
    rank_among_real = earlier + real.long().cumsum(-1) - 1  # [B, n]
    landmark_of = torch.where(real, rank_among_real.div(segment, rounding_mode="floor"), m)  # padding: spare slot
    spread = landmark_of[:, None, :, None].expand(batch, heads, n, 2 * head_dim)
    sums = query.new_zeros(batch, heads, m + 1, 2 * head_dim).scatter_add(2, spread, torch.cat((query_real, key_real), -1))
    sums = all_reduce_sum(sums[:, :, :m], shard)
    counts = value.new_zeros(batch, m + 1).scatter_add(1, landmark_of, real.to(value.dtype))
    counts = all_reduce_sum(counts[:, :m], shard)[:, None, :, None]  # [B, 1, m, 1]
    q_land = sums[..., :head_dim] / counts.clamp(min=1) * scale
    k_land = sums[..., head_dim:] / counts.clamp(min=1)
    valid = counts[..., 0] > 0  # [B, 1, m]
    landmark_mask = valid[:, :, None, :]

    kernel_2 = _masked_softmax(q_land @ k_land.transpose(-1, -2), landmark_mask)  # [B, H, m, m]
    eye = torch.eye(m, dtype=kernel_2.dtype, device=kernel_2.device)
    kernel_2 = torch.where(valid[..., None], kernel_2, eye)  # invalid landmark: identity row

    # softmax(Q~ K^T) V over the whole sequence's keys, from this rank's partial exp-sums
    scores = (q_land @ key.transpose(-1, -2)).masked_fill(~real[:, None, None, :], float("-inf"))  # [B, H, m, n]
    shift = all_reduce_max(scores.amax(-1, keepdim=True), shard)
    shift = shift.masked_fill(~torch.isfinite(shift), 0.0)  # a fully padded sequence
    weights = torch.exp(scores - shift)
    partial_sums = all_reduce_sum(torch.cat((weights @ value, weights.sum(-1, keepdim=True)), -1), shard)
    landmark_values = partial_sums[..., :-1] / partial_sums[..., -1:].clamp_min(torch.finfo(value.dtype).tiny)

    mixed = iterative_pinv(kernel_2, layer.pinv_iterations) @ landmark_values  # [B, H, m, Dh]
    out = F.scaled_dot_product_attention(query, k_land, mixed, attn_mask=landmark_mask, scale=scale)
    if layer.conv_weight is not None:
        half = layer.conv_weight.shape[-2] // 2
        before, after = exchange_halos(value, shard, half, dim=2)
        widened = torch.cat((before, value, after), dim=2)
        out = out + depthwise_value_conv(widened, layer.conv_weight)[:, :, half : half + n]
    return layer.proj.out(out)
