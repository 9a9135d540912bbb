"""MoBA, Mixture of Block Attention (Lu et al., 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs").

The keys are cut into blocks of ``block_size`` positions; every query scores each block by its gate, the dot
product with the block's mean-pooled key (eq. 6: s_i = <q, mean_pool(K[I_i])>), keeps the ``top_k`` blocks
(eq. 5: g_i = 1 for the top-k s_i, 0 otherwise) and runs one softmax over the keys of the kept blocks only
(eq. 2-3: Attn(q, K[I], V[I]) with I the union of the gated blocks). Causal, as the paper trains it (§2.2):
the query's own block is always kept (and masked causally inside), the other candidates are the blocks that
end at or before the query (a future block would leak through its mean), so ``top_k`` counts the own block.
The encoder form keeps the own block and the ``top_k - 1`` best other blocks of the whole sequence.

Cost: the gate is [N, N / block_size] (block granularity, no N x N tensor), the attention N x top_k x
block_size (:func:`longattn.attention.ops.block_select.selected_block_attention`, one dense product per
tile of queries that share a key block). The CPU path runs the queries in chunks (causal, a chunk reads no
block after its last query; the tiles' backward recomputes their scores); the GPU path all queries at once.
The float64 reference (:func:`moba_attention_reference`) builds the N x N mask of the selected keys; fla's ``parallel_moba`` (flash-attn varlen, CUDA only) is the same computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    output_dtype,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.decoding import KVState
from longattn.attention.ops.block_select import (BlockCacheState, block_key_means, completed_blocks, query_chunk,
                                                 selected_block_attention, top_blocks)

@dataclass(frozen=True)
class MobaOptions:
    block_size: int
    top_k: int
    is_causal: bool
    scale: float


def check_moba_options(block_size: int, top_k: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise AttentionError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise AttentionError(f"top_k must be a positive int (it counts the query's own block), got {top_k!r}")


def moba_select(query: Tensor, means: Tensor, mean_ok: Tensor, positions: Tensor,
                options: MobaOptions) -> tuple[Tensor, Tensor]:
    """The blocks each query attends to (eq. 5-6): its own block and the top_k - 1 other candidate blocks with
    the largest gate q . mean(K[block]); ``means`` [B, H, M, D] the block means (M blocks from position 0),
    ``mean_ok`` [B, M] the blocks with a real key. Returns (blocks, valid), [B, H, Q, top_k]."""
    b, h, q = query.shape[:3]
    own = torch.div(positions, options.block_size, rounding_mode="floor")  # [Q]
    candidates = torch.arange(means.shape[2], device=query.device)
    allowed = (candidates[None, :] != own[:, None])[None, None] & mean_ok[:, None, None, :]
    if options.is_causal:  # only blocks that end at or before the query: a later key would leak through the mean
        allowed = allowed & ((candidates[None, :] + 1) * options.block_size <= positions[:, None])
    own_slot = own.view(1, 1, q, 1).expand(b, h, q, 1)
    if options.top_k == 1 or means.shape[2] == 0:
        return own_slot, torch.ones_like(own_slot, dtype=torch.bool)
    gates = query @ means.transpose(-1, -2)  # [B, H, Q, M], eq. 6
    others, valid = top_blocks(gates, options.top_k - 1, allowed)
    return torch.cat([own_slot, others], -1), torch.cat([torch.ones_like(own_slot, dtype=torch.bool), valid], -1)


def moba_queries(query: Tensor, key: Tensor, value: Tensor, means: Tensor, mean_ok: Tensor, key_real: Tensor | None,
                 start: int, options: MobaOptions) -> Tensor:
    """MoBA for the queries at positions [start, start + Q) over every key: [B, H, Q, Dv]. Causal, the blocks
    after the last query's are not read (none of these queries can select them)."""
    positions = torch.arange(start, start + query.shape[2], device=query.device)
    if options.is_causal:
        blocks_seen = -(-(start + query.shape[2]) // options.block_size)
        key, value = key[:, :, :blocks_seen * options.block_size], value[:, :, :blocks_seen * options.block_size]
        key_real = None if key_real is None else key_real[:, :blocks_seen * options.block_size]
        means, mean_ok = means[:, :, :blocks_seen], mean_ok[:, :blocks_seen]
    with torch.no_grad():  # a discrete choice: no gradient flows through the gate
        blocks, valid = moba_select(query, means, mean_ok, positions, options)
    return selected_block_attention(query, key, value, blocks, valid, block_size=options.block_size,
                                    query_positions=positions, key_real=key_real, causal=options.is_causal,
                                    scale=options.scale)


@padding_safe
def moba_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    block_size: int = 64,
    top_k: int = 8,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """MoBA on [B, H, N, Dh]; ``attention_mask`` bool [B, N], True = real key. Returns [B, H, N, Dv] in the
    autocast dtype under autocast."""
    check_qkv(query, key, value, attention_mask)
    check_moba_options(block_size, top_k)
    options = MobaOptions(block_size, top_k, is_causal, 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
    dtype = output_dtype(query)
    pad = -key.shape[2] % block_size  # whole blocks once, not per chunk; the positions added are not keys
    key_real = attention_mask
    if pad:
        key_real = F.pad(torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
                         if attention_mask is None else attention_mask, (0, pad), value=False)
    key, value = F.pad(key, (0, 0, 0, pad)).contiguous(), F.pad(value, (0, 0, 0, pad)).contiguous()
    means, mean_ok = block_key_means(key, block_size, key_real)
    n = query.shape[2]
    # the CPU path's chunks keep nothing but their inputs for backward (its tiles' backward recomputes them)
    chunk = n if uses_gpu_path(query) else query_chunk(top_k * block_size)
    parts = [moba_queries(query[:, :, start:start + chunk], key, value, means, mean_ok, key_real, start, options)
             for start in range(0, n, chunk)]
    return torch.cat(parts, dim=2).to(dtype)


@padding_safe
def moba_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    block_size: int = 64,
    top_k: int = 8,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Dense N x N MoBA, eq. 2-6 as written: block means, gates, the top-k mask expanded to keys, one masked
    softmax. Tests only."""
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    real = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask
    blocks = -(-n // block_size)
    block_of = torch.arange(n) // block_size  # [N]
    members = F.one_hot(block_of, blocks).to(key.dtype) * real[..., None].to(key.dtype)  # [B, N, blocks]
    counts = members.sum(1)  # [B, blocks]
    means = torch.einsum("bnc,bhnd->bhcd", members, key) / counts.clamp_min(1)[:, None, :, None]
    gates = query @ means.transpose(-1, -2)  # [B, H, N, blocks]
    i = torch.arange(n)[:, None]
    c = torch.arange(blocks)[None, :]
    own = c == block_of[:, None]
    candidate = ~own & (counts > 0)[:, None, None, :]
    if is_causal:
        candidate = candidate & ((c + 1) * block_size <= i)
    chosen = own.expand(b, h, n, blocks).clone()
    k = min(top_k - 1, blocks)
    if k > 0:
        top = gates.masked_fill(~candidate, float("-inf")).topk(k, dim=-1).indices
        picked = torch.zeros_like(chosen).scatter(-1, top, True) & candidate
        chosen = chosen | picked
    allowed = chosen[..., block_of] & real[:, None, None, :]  # [B, H, N, N]
    if is_causal:
        allowed = allowed & (torch.arange(n)[None, :] <= i)
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ value


@register_attention(
    "moba",
    capabilities=Capabilities(causal=True),
    functional=moba_attention,
    reference=moba_attention_reference,
    paper="MoBA: Mixture of Block Attention for Long-Context LLMs (Lu et al., 2025)",
)
class MobaAttention(AttentionBase):
    """MoBA: each query attends to its top-k key blocks by a mean-pooled gate, plus its own block."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        block_size: int = 64,
        top_k: int = 8,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        check_moba_options(block_size, top_k)
        self.proj = QKVProjection(dim, heads)
        self.block_size = block_size
        self.top_k = top_k

    def _options(self) -> MobaOptions:
        return MobaOptions(self.block_size, self.top_k, self.causal, 1.0 / math.sqrt(self.head_dim))

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        return self.proj.out(moba_attention(q, k, v, attention_mask, block_size=self.block_size, top_k=self.top_k,
                                            is_causal=self.causal))

    # -- decoding: the key cache and the means of the completed blocks -------------------------------------
    decode_state = "kv_cache"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, BlockCacheState]:
        """The key cache and the mean keys of the completed blocks (the gate's candidates; the block being
        filled is the query's own and needs none)."""
        out = moba_attention(query, key, value, attention_mask, block_size=self.block_size, top_k=self.top_k,
                             is_causal=True)
        complete = completed_blocks(key.shape[2], self.block_size, self.block_size) * self.block_size
        real = None if attention_mask is None else attention_mask[:, :complete]
        means, mean_ok = block_key_means(key[:, :, :complete], self.block_size, real)
        return out, BlockCacheState(length=key.shape[2], cache=KVState.start(key, value, attention_mask),
                                    summaries=[means], summary_ok=mean_ok)

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: BlockCacheState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, BlockCacheState]:
        """The new query's own block and its top_k - 1 completed blocks: O(N / block + top_k x block)."""
        keys, values, key_real = state.append(key, value, real)
        (means,) = state.summaries
        out = moba_queries(query, keys, values, means, state.summary_ok, key_real if state.cache.padded else None,
                           state.length, self._options())
        first = state.completed_block(self.block_size, self.block_size)
        if first is not None:  # the new token completes a block: it becomes a candidate
            mean, ok = block_key_means(keys[:, :, first:], self.block_size, key_real[:, first:])
            state.add_block([mean], ok)
        return out.to(output_dtype(query)), state
