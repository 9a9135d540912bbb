"""Sequence-parallel Linformer: E K and F V are sums over the sequence of the rows of E, F at each
token's position (eq. 7), so each rank projects its tokens with the rows at its positions and one
all-reduce of the [B, H, k, 2 Dh] result gives every rank the projected keys and values; its
queries then attend to them locally. Independent of N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import AttentionBase
from longattn.attention.linformer import _project_sequence
from longattn.parallel.api import register_form
from longattn.parallel.comm import Shard, all_reduce_sum


@register_form("linformer")
def linformer_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    q, k, v = layer.proj.qkv(x)
    if attention_mask is not None:
        keep = attention_mask[:, None, :, None].to(k.dtype)
        k, v = k * keep, v * keep  # a padded position contributes no column of E, F
    positions = slice(shard.offset, shard.offset + x.shape[1])
    proj_v = layer.proj_k if layer.proj_v is None else layer.proj_v
    projected = torch.cat(
        (_project_sequence(k, layer.proj_k[..., positions, :]), _project_sequence(v, proj_v[..., positions, :])), dim=-1
    )
    small_k, small_v = all_reduce_sum(projected, shard).chunk(2, dim=-1)  # [B, H, k, Dh] each
    out = F.scaled_dot_product_attention(q, small_k, small_v, dropout_p=layer.dropout if layer.training else 0.0)
    return layer.proj.out(out)
