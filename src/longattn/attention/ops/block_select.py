"""Data-dependent block selection: top-k key blocks per query, and attention over the selected blocks only.

The sparse attentions of NSA (Yuan et al., 2025) and MoBA (Lu et al., 2025) score key blocks for every query
with a cheap gate (NSA: the compressed attention probabilities, eq. 8-10; MoBA: q . mean-pooled block keys,
eq. 5-6), keep the top ones (:func:`top_blocks`) and run exact softmax attention over the keys of those blocks
(:func:`selected_block_attention`). Nothing of size N x N exists: the gate scores are [queries, N / block] and
the attention [queries, selected blocks x block].

:func:`selected_block_attention` is key-block-centric, as the FlashAttention-varlen formulations of both
papers are: every (query, selected block) pair is an entry; entries are sorted by (batch, head, block), each
block's entries are cut into tiles of ``QUERY_TILE`` queries, and every tile multiplies its queries with its
one key block in a dense [QUERY_TILE, block] product (a batched matmul, no Python loop). The softmax over all
of a query's selected keys is assembled from the tiles by a scattered log-sum-exp, so the result is exactly
softmax attention over the union of the selected keys; autograd differentiates it, and keys outside the
selection get no gradient because they are never gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import compute_dtype

__all__ = ["CHUNK_SCORES", "QUERY_TILE", "block_key_means", "query_chunk", "selected_block_attention", "top_blocks"]

# Queries per tile of selected_block_attention: the M of its [M, block] products; a block's queries are
# padded to a multiple of it, so a smaller tile wastes less on blocks few queries select.
QUERY_TILE = 64
# Selected scores per chunk of queries on the CPU path (about 8 MiB in float32): a chunk's scores, weights and
# masks are its only memory beyond the inputs, recomputed in backward.
CHUNK_SCORES = 2**21


def query_chunk(selected_keys: int) -> int:
    """Queries per chunk of the CPU path when each query scores ``selected_keys`` keys."""
    return max(1, CHUNK_SCORES // max(1, selected_keys))


def top_blocks(scores: Tensor, count: int, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """The ``count`` highest-scoring allowed blocks of each row of ``scores`` [..., blocks]: ``(indices, valid)``,
    both [..., min(count, blocks)]; ``valid`` is False where a row has fewer allowed blocks than slots (the
    index there is arbitrary). Blocks a caller always wants (NSA's initial and local blocks) carry a score of
    +inf. The selection is a discrete choice: no gradient flows through it."""
    k = min(count, scores.shape[-1])
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    indices = masked.topk(k, dim=-1, sorted=False).indices
    valid = allowed.expand_as(masked).gather(-1, indices)
    return indices, valid


def block_key_means(key: Tensor, block_size: int, key_real: Tensor | None) -> tuple[Tensor, Tensor]:
    """The mean of the real keys of each block of ``block_size`` positions (the last block may be shorter):
    ``(means [B, H, blocks, D], has_real [B, blocks])``; a block without a real key has a zero mean."""
    b, h, n, d = key.shape
    blocks = -(-n // block_size)
    pad = blocks * block_size - n
    real = torch.ones(b, n, dtype=torch.bool, device=key.device) if key_real is None else key_real
    real = F.pad(real, (0, pad), value=False).view(b, blocks, block_size)
    sums = F.pad(key.masked_fill(~real.flatten(1)[:, None, :n, None], 0.0), (0, 0, 0, pad))
    sums = sums.view(b, h, blocks, block_size, d).sum(3)
    counts = real.sum(-1)
    return sums / counts.clamp_min(1)[:, None, :, None].to(sums.dtype), counts > 0


def selected_block_attention(query: Tensor, key: Tensor, value: Tensor, blocks: Tensor, valid: Tensor, *,
                             block_size: int, query_positions: Tensor, key_real: Tensor | None, causal: bool,
                             scale: float) -> Tensor:
    """Softmax attention of each query over the keys of its selected blocks.

    ``query`` [B, H, Q, D] at key positions ``query_positions`` [Q]; ``key``, ``value`` [B, H, Nk, D(v)] from
    position 0; ``blocks`` [B, H, Q, S] the selected block indices (block ``c`` holds positions
    ``[c * block_size, (c + 1) * block_size)``), ``valid`` [B, H, Q, S] which slots hold a selection (a block
    must not be listed twice for one query). A key takes part when it exists, is real (``key_real`` [B, Nk])
    and, if ``causal``, is not after the query. Returns [B, H, Q, Dv]; a query that sees no key gets zeros.
    """
    b, h, q, d = query.shape
    n_keys, dv = key.shape[2], value.shape[-1]
    n_blocks = -(-n_keys // block_size)
    device = query.device
    heads = b * h
    groups_total = heads * n_blocks
    empty_row = heads * q  # padding slots and unselected entries read a zero query and see no key
    # one entry per (query, selection slot): its query row in [heads * Q] and its (head, block) group; a slot
    # without a selection goes to an extra last group whose rows are empty
    count = blocks.shape[-1]
    rows = torch.arange(heads * q, device=device).repeat_interleave(count)
    groups = (torch.arange(heads, device=device).view(b, h, 1, 1) * n_blocks + blocks).flatten()
    keep = valid.flatten()
    rows = torch.where(keep, rows, empty_row)
    groups = torch.where(keep, groups, groups_total)
    # sorted by group, each group's entries padded to whole tiles of QUERY_TILE; the slots are sized for the
    # worst case (every group a tile short) so that no shape depends on the selection (no host sync)
    groups, order = torch.sort(groups, stable=True)
    rows = rows[order]
    sizes = torch.zeros(groups_total + 1, dtype=torch.long, device=device).index_add(
        0, groups, torch.ones_like(groups))
    padded = torch.div(sizes + QUERY_TILE - 1, QUERY_TILE, rounding_mode="floor") * QUERY_TILE
    first_sorted = torch.cumsum(sizes, 0) - sizes
    first_padded = torch.cumsum(padded, 0) - padded
    slots = first_padded[groups] + torch.arange(groups.numel(), device=device) - first_sorted[groups]
    tiles = -(-(groups.numel() + (groups_total + 1) * (QUERY_TILE - 1)) // QUERY_TILE)
    total = tiles * QUERY_TILE
    slot_rows = torch.full((total,), empty_row, dtype=torch.long, device=device).index_put((slots,), rows)
    tile_groups = torch.zeros(tiles, dtype=torch.long, device=device).index_put((slots // QUERY_TILE,), groups)
    tile_groups = tile_groups.clamp_max(groups_total - 1)  # the extra group's tiles hold empty rows only

    # the scale folded into the queries (Q x D products, not T x M x block); the padding slots' zero queries
    # score 0 against every key and land in the dropped row, so they need no mask
    queries = F.pad(query.reshape(heads * q, d) * scale, (0, 0, 0, 1))[slot_rows].view(tiles, QUERY_TILE, d)
    pad = n_blocks * block_size - n_keys
    if pad:
        key, value = F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
    key_blocks = key.reshape(groups_total, block_size, d)
    value_blocks = value.reshape(groups_total, block_size, dv)
    tile_keys, tile_values = key_blocks[tile_groups], value_blocks[tile_groups]

    scores = (queries @ tile_keys.transpose(1, 2)).to(compute_dtype(query.dtype))  # [T, M, bs]
    key_pos = (tile_groups % n_blocks)[:, None] * block_size + torch.arange(block_size, device=device)  # [T, bs]
    allowed = None
    if key_real is not None or pad:
        real = torch.ones(b, n_keys, dtype=torch.bool, device=device) if key_real is None else key_real
        if pad:
            real = F.pad(real, (0, pad), value=False)  # positions past the keys do not exist
        allowed = real[(tile_groups // (h * n_blocks))[:, None], key_pos][:, None, :]
    if causal:
        query_pos = F.pad(query_positions, (0, 1))[torch.where(slot_rows == empty_row, q, slot_rows % q)]
        after = key_pos[:, None, :] <= query_pos.view(tiles, QUERY_TILE, 1)
        allowed = after if allowed is None else allowed & after
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # one softmax over every selected key of a query: the per-query maximum (any constant cancels, so it is
    # detached), the shifted exponentials, and their sums and weighted values scattered back to the queries
    slot_max = scores.detach().amax(-1).flatten()
    query_max = torch.full((heads * q + 1,), float("-inf"), dtype=scores.dtype, device=device)
    query_max = query_max.scatter_reduce(0, slot_rows, slot_max, reduce="amax")
    query_max = torch.where(torch.isfinite(query_max), query_max, 0.0)
    weights = torch.exp(scores - query_max[slot_rows].view(tiles, QUERY_TILE, 1))
    numerators = (weights.to(tile_values.dtype) @ tile_values).reshape(total, dv).to(weights.dtype)
    sums = torch.zeros(heads * q + 1, dtype=weights.dtype, device=device).index_add(
        0, slot_rows, weights.sum(-1).flatten())
    outputs = torch.zeros(heads * q + 1, dv, dtype=numerators.dtype, device=device).index_add(
        0, slot_rows, numerators)
    seen = sums > 0
    out = torch.where(seen[:, None], outputs / torch.where(seen, sums, 1.0)[:, None], 0.0)
    return out[:heads * q].view(b, h, q, dv)
