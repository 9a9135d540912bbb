"""Sequence-parallel softmax attention, the baseline: all-gather of K and V.

Each rank gathers every rank's keys, values and key mask (in rank order, so the gathered sequence
is the original one) and runs SDPA for its own queries. Communication grows linearly with N; this
is the cost the sketch mechanisms avoid. A ring (K/V passed around with an online softmax) moves
the same bytes in P - 1 steps with less memory; torch's own context parallelism
(``torch.distributed.tensor.experimental.context_parallel``) does that but dispatches only the
CUDA flash / efficient SDPA kernels, so it does not run on this CPU build with gloo.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import AttentionBase
from longattn.attention.softmax import softmax_attention
from longattn.parallel.api import register_form
from longattn.parallel.comm import Shard, all_gather_sequence


@register_form("softmax")
def softmax_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    q, k, v = layer.proj.qkv(x)
    keys_values = all_gather_sequence(torch.stack((k, v)), shard, dim=3)  # [2, B, H, N, Dh]
    local_mask = attention_mask if attention_mask is not None else torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    key_mask = all_gather_sequence(local_mask.to(torch.uint8), shard, dim=1).bool()  # [B, N]
    dropout_p = layer.dropout if layer.training else 0.0
    if not layer.causal:
        out = softmax_attention(q, keys_values[0], keys_values[1], key_mask, dropout_p=dropout_p, scale=layer.scale)
        return layer.proj.out(out)
    query_positions = shard.offset + torch.arange(shard.length, device=x.device)
    key_positions = torch.arange(shard.total, device=x.device)
    allowed = key_mask[:, None, None, :] & (key_positions <= query_positions[:, None])  # [B, 1, n, N]
    out = F.scaled_dot_product_attention(
        q, keys_values[0], keys_values[1], attn_mask=allowed, dropout_p=dropout_p, scale=layer.scale
    )
    return layer.proj.out(out.masked_fill(~allowed.any(-1, keepdim=True), 0.0))
