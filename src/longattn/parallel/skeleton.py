"""Sequence-parallel skeleton attention (SKTformer / S^3) with its Smoother.

What each part needs from the other ranks (all exact: the same sums, in a different order):

* Smoother, Fourier convolution (eq. 4-5): a circular convolution of length max_len, linear in the
  input, so the sequence's spectrum is the sum of the shards' spectra at their positions. Each
  rank transforms its segment-averaged tokens placed at their offset, one all-reduce of the
  [B, max_len // 2 + 1, r] spectrum gives the whole sequence's, and each rank inverts it and keeps
  its own rows. The exchange is independent of N (it scales with max_len and r).
* Smoother, convolution stem: kernel // 2 tokens from each neighbour (halo exchange); BatchNorm
  over positions is local (each position is its own channel), over features it is refused while
  training (its statistics would need sums over the sequence; eval uses running statistics).
* Row attention: the s1 sampled tokens (after the Smoother) live on some ranks; an all-reduce of
  [B, s1, dim + 1] (the owners' rows and their validity, zeros elsewhere) gives them to everyone.
* Column attention: the softmax over the s2 sampled features of Q^T K P2 (a sum over tokens): one
  all-reduce of [B, H, Dh, s2] scores. The LayerNorms and the output projection are per token.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import AttentionBase, AttentionError, split_heads
from longattn.attention.skeleton import _linear, _SampledProjections
from longattn.attention.smoother import _ACTIVATIONS, Smoother
from longattn.parallel.api import register_form
from longattn.parallel.comm import Shard, all_reduce_sum, exchange_halos


def smoother_form(smoother: Smoother, x: Tensor, attention_mask: Tensor | None, shard: Shard) -> Tensor:
    """Smoother.forward on this rank's shard of the sequence (see the module doc)."""
    valid = smoother._valid(x, attention_mask)
    keep = valid.unsqueeze(-1)
    x = x * keep
    if smoother.fourier:
        smoothed = smoother._fourier_smooth(x, shard.offset, partial(all_reduce_sum, shard=shard)) * keep
        if not smoother.conv_stem:
            return smoother._dropout_and_zero_padding(smoothed, keep)
        stem_in = torch.cat((smoothed.transpose(1, 2), x.transpose(1, 2)), dim=1)  # [B, 2 dim, n]
    else:
        stem_in = x.transpose(1, 2)
    if smoother.training and smoother.stem_norm.over == "features":
        raise AttentionError(
            "the sequence-parallel Smoother supports batchnorm_over='positions' while training "
            "('features' needs statistics over the whole sequence); eval mode works for both"
        )
    conv = smoother.stem_conv
    half = conv.kernel_size[0] // 2
    before, after = exchange_halos(stem_in, shard, half, dim=2)
    h = F.conv1d(torch.cat((before, stem_in, after), dim=2), conv.weight, conv.bias).transpose(1, 2)
    h = smoother.stem_norm(h, valid, offset=shard.offset)
    h = _ACTIVATIONS[smoother.activation](h)
    return smoother._dropout_and_zero_padding(h, keep)


@register_form("skeleton")
def skeleton_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    if layer.training and layer.resample_each_step:
        raise AttentionError(
            "resample_each_step has no sequence-parallel form (each rank would draw its own "
            "indices); resample on one rank and broadcast the layer's buffers instead"
        )
    if layer.smoother is not None:
        x = smoother_form(layer.smoother, x, attention_mask, shard)
    proj, n = layer.proj, x.shape[1]
    gemm_dtype = torch.bfloat16 if layer.precision == "bf16" and x.dtype == torch.float32 else None
    local_rows = features = None
    if layer.row_attention:
        rows = layer.row_indices.clamp(max=shard.total - 1)  # positions >= N count as padding
        local_rows = rows - shard.offset
        owned = (local_rows >= 0) & (local_rows < n)
        local_rows = local_rows.clamp(0, n - 1)
    if layer.column_attention:
        head_offsets = torch.arange(layer.heads, device=x.device)[:, None] * layer.head_dim
        features = (head_offsets + layer.column_indices).flatten()  # h*Dh + the P2 columns
    query, column_keys, column_values, local_samples = _SampledProjections.apply(
        x, proj.to_q.weight, proj.to_q.bias, proj.to_k.weight, proj.to_k.bias, proj.to_v.weight,
        proj.to_v.bias, features, local_rows, gemm_dtype,
    )
    row_keys = row_values = row_valid = None
    if layer.row_attention:
        real = owned & (layer.row_indices < shard.total)
        if attention_mask is not None:
            real = real & attention_mask[:, local_rows]
        real = real.expand(x.shape[0], -1).to(x.dtype)  # [B, s1]
        mine = local_samples * owned[None, :, None].to(x.dtype)  # [B, s1, dim]: my samples, zeros elsewhere
        gathered = all_reduce_sum(torch.cat((mine, real.unsqueeze(-1)), dim=-1), shard)
        sampled_tokens, row_valid = gathered[..., :-1], gathered[..., -1] > 0
        row_keys = split_heads(proj.to_k(sampled_tokens), layer.heads)
        row_values = split_heads(proj.to_v(sampled_tokens), layer.heads)
    out = layer.combine_samples(x, query, row_keys, row_values, column_keys, column_values, attention_mask,
                                sum_over_tokens=partial(all_reduce_sum, shard=shard), row_valid=row_valid)
    return _linear(proj.to_out, out, gemm_dtype)
