"""Sequence-parallel linear, Performer and cosFormer attention: exchange the key sums K^T V and sum K.

Non-causal (eq. 5-6 of "Transformers are RNNs"): each rank sums phi(K)^T V and phi(K) over its
keys; one all-reduce of these [B, H, F, Dv + 1] sums (independent of N) gives every rank the whole
sequence's, and its queries need nothing else. Causal (eq. 8-9): each rank adds to its own
chunked prefix sums the total state of the ranks before it (an all-gather of the per-rank states,
the LASP-style state passing), still independent of N. cosFormer's re-weighting (eq. 10) takes the
tokens' positions in the whole sequence (and M = the whole N by default).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from longattn.attention.base import AttentionBase
from longattn.attention.cosformer import cosformer_features
from longattn.attention.ops.linear_scan import CAUSAL_CHUNK, causal_kernel_sums, elu_feature_map, kernel_sums, mask_keys
from longattn.attention.performer import favor_features
from longattn.parallel.api import register_form
from longattn.parallel.comm import Shard, _nbytes, _record, all_gather, all_reduce_max, all_reduce_sum, broadcast


def _causal_sums_across_shards(phi_q: Tensor, phi_k: Tensor, value: Tensor, shard: Shard, chunk: int = CAUSAL_CHUNK) -> tuple[Tensor, Tensor]:
    """Causal numerator and normaliser of this shard's queries: the local chunked prefix sums plus
    the states sum_j phi(K_j) V_j^T and sum_j phi(K_j) of all earlier ranks."""
    numerator, normaliser = causal_kernel_sums(phi_q, phi_k, value, chunk)
    state = torch.cat((phi_k.transpose(-1, -2) @ value, phi_k.sum(-2).unsqueeze(-1)), dim=-1)  # [B, H, F, Dv+1]
    states = all_gather(state, shard, "all_gather states")
    _record("all_gather states", _nbytes(state) * shard.world_size, state)
    # every rank reads every gathered state (weight 0 for later ranks), so that every rank runs the
    # all-gather's backward collective
    before = (torch.arange(shard.world_size, device=state.device) < shard.rank).to(state.dtype)
    earlier = (torch.stack(states) * before.view(-1, 1, 1, 1, 1)).sum(0)
    carried = phi_q @ earlier  # [B, H, n, Dv+1]
    return numerator + carried[..., :-1], normaliser + carried[..., -1:]


def _kernel_sums(layer: AttentionBase, phi_q: Tensor, phi_k: Tensor, value: Tensor, shard: Shard,
                 chunk: int = CAUSAL_CHUNK) -> tuple[Tensor, Tensor]:
    if layer.causal:
        return _causal_sums_across_shards(phi_q, phi_k, value, shard, chunk)
    return kernel_sums(phi_q, phi_k, value, partial(all_reduce_sum, shard=shard))


def _kernel_form(layer: AttentionBase, phi_q: Tensor, phi_k: Tensor, value: Tensor, eps: float, shard: Shard) -> Tensor:
    numerator, normaliser = _kernel_sums(layer, phi_q, phi_k, value, shard)
    return numerator / (normaliser + eps)


@register_form("linear")
def linear_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    q, k, v = layer.proj.qkv(x)
    phi_k, v = mask_keys(elu_feature_map(k), v, attention_mask)
    return layer.proj.out(_kernel_form(layer, elu_feature_map(q), phi_k, v, layer.eps, shard))


@register_form("performer")
def performer_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    if layer.training and layer.redraw_interval is not None:
        if int(layer.calls_since_redraw) >= layer.redraw_interval:
            layer.redraw_features()
            # every rank must use the same features: the group's first rank draws them
            broadcast(layer.projection, shard, "broadcast features")
        layer.calls_since_redraw += 1
    q, k, v = layer.proj.qkv(x)
    phi_q, phi_k = favor_features(q, k, layer.projection, attention_mask, partial(all_reduce_max, shard=shard))
    if attention_mask is not None:
        v = v * attention_mask[:, None, :, None].to(v.dtype)
    eps = torch.finfo(q.dtype).tiny  # as performer_attention: turns a fully padded 0/0 into 0
    return layer.proj.out(_kernel_form(layer, phi_q, phi_k, v, eps, shard))


@register_form("cosformer")
def cosformer_form(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None, shard: Shard) -> Tensor:
    q, k, v = layer.proj.qkv(x)
    # the cos re-weighting at the tokens' positions in the whole sequence; M = N by default, the sequence's own
    # length (not counting the padding token of a rank that holds none)
    max_positions = shard.sequence_length if layer.max_positions is None else layer.max_positions
    # the padding token of a rank without tokens is masked: any position inside the sequence will do
    offset = min(shard.offset, shard.sequence_length - x.shape[1])
    features = partial(cosformer_features, max_positions=max_positions, reweight=layer.reweight,
                       feature_map=layer.feature_map, offset=offset)
    phi_q, phi_k = features(q), features(k)
    if attention_mask is not None:
        phi_k = phi_k * attention_mask[:, None, :, None].to(phi_k.dtype)  # padded keys contribute 0
    numerator, denominator = _kernel_sums(layer, phi_q, phi_k, v, shard, layer.chunk_size)
    return layer.proj.out(numerator / denominator.clamp_min(layer.eps))
