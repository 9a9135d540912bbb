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
softmax attention over the union of the selected keys, and keys outside the selection get no gradient because
they are never gathered. On the GPU path autograd differentiates it; on the CPU path a hand-written backward
(FlashAttention's, on the tiles) recomputes the scores from the queries, the key blocks and each query's
log-sum-exp, so a call keeps only its inputs, its output and one number per query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from longattn.attention.base import compute_dtype, output_dtype, uses_gpu_path
from longattn.attention.decoding import DecodingState, KVState

__all__ = ["CHUNK_SCORES", "FLASH_CPU", "FLASH_CPU_BACKWARD", "QUERY_TILE", "BlockCacheState", "additive_mask",
           "block_key_means", "completed_blocks", "query_chunk", "selected_block_attention", "top_blocks"]

# Queries per tile of selected_block_attention: the M of its [M, block] products; a block's queries are
# padded to a multiple of it, so a smaller tile wastes less on blocks few queries select.
QUERY_TILE = 64
# Selected scores per chunk of queries on the CPU path (about 8 MiB in float32 per head): a chunk's scores,
# weights and masks are its only memory beyond the inputs, recomputed in backward.
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

    The GPU path runs every tile through autograd with shapes that do not depend on the selection; the CPU
    path lays out exactly the tiles the selection fills, masks only the tiles that hold a query before the
    end of its block or a padded key, and runs :class:`_SelectedTiles`, whose backward recomputes the
    scores instead of keeping them.
    """
    b, h, q, d = query.shape
    n_keys, dv = key.shape[2], value.shape[-1]
    n_blocks = -(-n_keys // block_size)
    gpu = uses_gpu_path(query)
    if key_real is not None and not gpu and bool(key_real.all()):
        key_real = None  # every key real: no mask to build (the CPU path may read the value)
    layout = _tile_layout(blocks, valid, n_blocks, exact=not gpu)
    pad = n_blocks * block_size - n_keys
    if pad:
        key, value = F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
    real = None
    if key_real is not None or pad:
        real = torch.ones(b, n_keys, dtype=torch.bool, device=query.device) if key_real is None else key_real
        real = F.pad(real, (0, pad), value=False)  # positions past the keys do not exist
    # a padding slot's position is past every key: it sees them all, so it never asks for a tile's mask
    positions = F.pad(query_positions, (0, 1), value=n_blocks * block_size) if causal else None
    masks = _TileMasks(layout, block_size, n_blocks, h, real, positions)
    # the scale folded into the queries (Q x D products, not T x M x block); the padding slots' zero queries
    # score 0 against every key and land in the dropped last row, so they need no mask
    queries = F.pad(query.reshape(b * h * q, d) * scale, (0, 0, 0, 1))
    key_blocks = key.reshape(b * h * n_blocks, block_size, d)
    value_blocks = value.reshape(b * h * n_blocks, block_size, dv)
    if gpu or query.device.type != "cpu":  # the CPU path forced on another device: its kernel is the CPU's
        out = _tiles_through_autograd(queries, key_blocks, value_blocks, layout, masks)
    else:  # under autocast the tiles' products in the autocast dtype, as the GPU path's
        dtype = output_dtype(query)
        out = _SelectedTiles.apply(queries.to(dtype), key_blocks.to(dtype), value_blocks.to(dtype), layout, masks)
    return out[:b * h * q].view(b, h, q, dv)


@dataclass(frozen=True)
class _TileLayout:
    """Every (query, selection slot) entry in a tile of ``QUERY_TILE`` query rows against one key block:
    ``slot_rows`` [tiles * QUERY_TILE] the row of each slot in the flattened [B * H * Q] queries (the extra
    last row for a padding slot), ``tile_groups`` [tiles] the (batch-head, block) group of each tile's keys."""

    slot_rows: Tensor
    tile_groups: Tensor
    rows_per_head: int
    empty_row: int

    @property
    def tiles(self) -> int:
        return self.tile_groups.numel()


def _tile_layout(blocks: Tensor, valid: Tensor, n_blocks: int, *, exact: bool) -> _TileLayout:
    """Entries sorted by group, each group's entries padded to whole tiles. ``exact`` (CPU) keeps only the
    valid entries and the tiles they fill; otherwise (GPU) the slots are sized for the worst case (every
    group a tile short) so that no shape depends on the selection (no host sync)."""
    b, h, q, count = blocks.shape
    device = blocks.device
    heads_total = b * h
    groups_total = heads_total * n_blocks
    empty_row = heads_total * q
    rows = torch.arange(heads_total * q, device=device).repeat_interleave(count)
    groups = (torch.arange(heads_total, device=device).view(b, h, 1, 1) * n_blocks + blocks).flatten()
    keep = valid.flatten()
    if exact:
        rows, groups = rows[keep], groups[keep]
    else:  # a slot without a selection goes to an extra last group whose rows are empty
        rows = torch.where(keep, rows, empty_row)
        groups = torch.where(keep, groups, groups_total)
    groups, order = torch.sort(groups, stable=True)
    rows = rows[order]
    sizes = torch.zeros(groups_total + 1, dtype=torch.long, device=device).index_add(
        0, groups, torch.ones_like(groups))
    padded = torch.div(sizes + QUERY_TILE - 1, QUERY_TILE, rounding_mode="floor") * QUERY_TILE
    first_sorted = torch.cumsum(sizes, 0) - sizes
    first_padded = torch.cumsum(padded, 0) - padded
    slots = first_padded[groups] + torch.arange(groups.numel(), device=device) - first_sorted[groups]
    if exact:
        tiles = int(padded.sum()) // QUERY_TILE
    else:
        tiles = -(-(groups.numel() + (groups_total + 1) * (QUERY_TILE - 1)) // QUERY_TILE)
    slot_rows = torch.full((tiles * QUERY_TILE,), empty_row, dtype=torch.long, device=device).index_put((slots,), rows)
    tile_groups = torch.zeros(tiles, dtype=torch.long, device=device).index_put((slots // QUERY_TILE,), groups)
    tile_groups = tile_groups.clamp_max(groups_total - 1)  # the extra group's tiles hold empty rows only
    return _TileLayout(slot_rows, tile_groups, q, empty_row)


@dataclass(frozen=True)
class _TileMasks:
    """Which keys of a tile each of its slots may see: the real ones (``real`` [B, n_blocks * block_size], None:
    every key) and, where ``positions`` [Q + 1] is given (causal; the padding slot's last), those at or before
    the slot's query."""

    layout: _TileLayout
    block_size: int
    n_blocks: int
    heads: int
    real: Tensor | None
    positions: Tensor | None

    def _key_positions(self, groups: Tensor) -> Tensor:
        return (groups % self.n_blocks)[:, None] * self.block_size + torch.arange(self.block_size,
                                                                                   device=groups.device)

    def _query_positions(self, tiles: Tensor | None) -> Tensor:
        rows = self.layout.slot_rows.view(-1, QUERY_TILE)
        rows = rows if tiles is None else rows[tiles]
        q = self.layout.rows_per_head
        return self.positions[torch.where(rows == self.layout.empty_row, q, rows % q)]

    def build(self, tiles: Tensor | None = None) -> Tensor | None:
        """The [tiles, QUERY_TILE, block_size] mask of ``tiles`` (None: every tile); None where nothing is masked."""
        groups = self.layout.tile_groups if tiles is None else self.layout.tile_groups[tiles]
        key_pos = self._key_positions(groups)  # [t, bs]
        allowed = None
        if self.real is not None:
            allowed = self.real[(groups // (self.heads * self.n_blocks))[:, None], key_pos][:, None, :]
        if self.positions is not None:
            after = key_pos[:, None, :] <= self._query_positions(tiles)[:, :, None]
            allowed = after if allowed is None else allowed & after
        return allowed

    def masked_tiles(self) -> Tensor | None:
        """The tiles whose mask hides a key (CPU): a slot's query before the end of the tile's block, or a
        padded key in it; None when no tile has one."""
        groups = self.layout.tile_groups
        need = torch.zeros(groups.numel(), dtype=torch.bool, device=groups.device)
        if self.real is not None:
            padded = ~self.real.view(-1, self.n_blocks, self.block_size).all(-1)  # [B, n_blocks]
            need |= padded[groups // (self.heads * self.n_blocks), groups % self.n_blocks]
        if self.positions is not None:
            last_key = (groups % self.n_blocks + 1) * self.block_size - 1
            need |= self._query_positions(None).amin(-1) < last_key
        tiles = need.nonzero().flatten()
        return tiles if tiles.numel() else None


def _tiles_through_autograd(queries: Tensor, key_blocks: Tensor, value_blocks: Tensor, layout: _TileLayout,
                            masks: _TileMasks) -> Tensor:
    """The GPU path: every tile masked, one softmax over every selected key of a query assembled by a scattered
    log-sum-exp; autograd differentiates it. Returns [B * H * Q + 1, Dv] (the last row: padding slots)."""
    slot_rows, tile_groups = layout.slot_rows, layout.tile_groups
    tiles, rows = layout.tiles, layout.empty_row + 1
    dv = value_blocks.shape[-1]
    tile_queries = queries[slot_rows].view(tiles, QUERY_TILE, -1)
    tile_keys, tile_values = key_blocks[tile_groups], value_blocks[tile_groups]
    scores = (tile_queries @ tile_keys.transpose(1, 2)).to(compute_dtype(queries.dtype))  # [T, M, bs]
    allowed = masks.build()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # the per-query maximum (any constant cancels, so it is detached), the shifted exponentials, and their sums
    # and weighted values scattered back to the queries
    slot_max = scores.detach().amax(-1).flatten()
    query_max = torch.full((rows,), float("-inf"), dtype=scores.dtype, device=scores.device)
    query_max = query_max.scatter_reduce(0, slot_rows, slot_max, reduce="amax")
    query_max = torch.where(torch.isfinite(query_max), query_max, 0.0)
    weights = torch.exp(scores - query_max[slot_rows].view(tiles, QUERY_TILE, 1))
    numerators = (weights.to(tile_values.dtype) @ tile_values).reshape(-1, dv).to(weights.dtype)
    sums = torch.zeros(rows, dtype=weights.dtype, device=weights.device).index_add(
        0, slot_rows, weights.sum(-1).flatten())
    outputs = torch.zeros(rows, dv, dtype=numerators.dtype, device=weights.device).index_add(
        0, slot_rows, numerators)
    seen = sums > 0
    return torch.where(seen[:, None], outputs / torch.where(seen, sums, 1.0)[:, None], 0.0)


# SDPA's CPU flash kernel with its log-sum-exp (the op F.scaled_dot_product_attention runs on a CPU; an additive
# mask of the inputs' dtype), and its backward: the fused products of the CPU paths, about twice as fast on one
# thread as bmm, softmax and bmm
FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed``, -inf elsewhere: the mask the flash kernel takes."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True)
class _TileSet:
    """Tiles run in one call of the flash kernel: their slots' query rows [tiles, QUERY_TILE], key groups [tiles]
    and, for the tiles that hide a key, their mask [tiles, QUERY_TILE, block] (None: every key seen)."""

    rows: Tensor
    groups: Tensor
    allowed: Tensor | None

    def inputs(self, queries: Tensor, key_blocks: Tensor, value_blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return queries[self.rows][:, None], key_blocks[self.groups][:, None], value_blocks[self.groups][:, None]

    def additive_mask(self, dtype: torch.dtype) -> Tensor | None:
        return None if self.allowed is None else additive_mask(self.allowed, dtype)[:, None]


def _tile_sets(layout: _TileLayout, masks: _TileMasks) -> list[_TileSet]:
    """The tiles without a hidden key in one set, those with one (with their masks) in another."""
    rows = layout.slot_rows.view(-1, QUERY_TILE)
    masked = masks.masked_tiles()
    if masked is None:
        return [_TileSet(rows, layout.tile_groups, None)]
    plain = torch.ones(layout.tiles, dtype=torch.bool, device=rows.device).index_fill_(0, masked, False)
    sets = [_TileSet(rows[masked], layout.tile_groups[masked], masks.build(masked))]
    if bool(plain.any()):
        plain = plain.nonzero().flatten()
        sets.append(_TileSet(rows[plain], layout.tile_groups[plain], None))
    return sets


class _SelectedTiles(torch.autograd.Function):
    """The CPU path of :func:`selected_block_attention`: every tile through SDPA's CPU flash kernel, which returns
    the tile's softmax output and log-sum-exp; the tiles of a query are merged by their log-sum-exps into its
    softmax over all of its selected keys. The backward runs the kernel's backward on each tile with the query's
    merged output and log-sum-exp, so its probabilities are the query's over the union of its keys: the scores
    are recomputed, never kept. Inputs in one dtype (the queries scaled already); returns [B * H * Q + 1, Dv]
    in the accumulation dtype (the last row: padding slots)."""

    @staticmethod
    def forward(ctx: Any, queries: Tensor, key_blocks: Tensor, value_blocks: Tensor, layout: _TileLayout,
                masks: _TileMasks) -> Tensor:
        accumulate = compute_dtype(queries.dtype)
        sets = _tile_sets(layout, masks)
        rows, outs, log_sums = [], [], []
        for tile_set in sets:
            out, log_sum = FLASH_CPU(*tile_set.inputs(queries, key_blocks, value_blocks),
                                  attn_mask=tile_set.additive_mask(queries.dtype), scale=1.0)
            if tile_set.allowed is not None:  # a row that sees no key of its tile: the kernel says 0, not -inf
                log_sum = log_sum.masked_fill(~tile_set.allowed.any(-1)[:, None], float("-inf"))
            rows.append(tile_set.rows.flatten())
            outs.append(out.reshape(-1, out.shape[-1]).to(accumulate))
            log_sums.append(log_sum.flatten().to(accumulate))
        slot_rows, slot_out, slot_log_sum = torch.cat(rows), torch.cat(outs), torch.cat(log_sums)
        n_rows = layout.empty_row + 1
        top = torch.full((n_rows,), float("-inf"), dtype=accumulate, device=queries.device).scatter_reduce(
            0, slot_rows, slot_log_sum, reduce="amax")
        top = torch.where(torch.isfinite(top), top, 0.0)
        weights = torch.exp(slot_log_sum - top[slot_rows])  # each tile's share of its query's softmax mass
        sums = torch.zeros(n_rows, dtype=accumulate, device=queries.device).index_add_(0, slot_rows, weights)
        merged = torch.zeros(n_rows, slot_out.shape[-1], dtype=accumulate, device=queries.device).index_add_(
            0, slot_rows, slot_out * weights[:, None])
        seen = sums > 0
        out = torch.where(seen[:, None], merged / torch.where(seen, sums, 1.0)[:, None], 0.0)
        # a query that sees no key: +inf, so that its probabilities in backward are exp(-inf) = 0
        log_sum = torch.where(seen, top + torch.log(torch.where(seen, sums, 1.0)), float("inf"))
        ctx.save_for_backward(queries, key_blocks, value_blocks, out, log_sum)
        ctx.sets = sets
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        queries, key_blocks, value_blocks, out, log_sum = ctx.saved_tensors
        dtype = queries.dtype
        grad_out, out = grad_out.to(dtype), out.to(dtype)
        grad_queries, grad_keys, grad_values = (torch.zeros_like(t) for t in (queries, key_blocks, value_blocks))
        for tile_set in ctx.sets:
            tile_queries, tile_keys, tile_values = tile_set.inputs(queries, key_blocks, value_blocks)
            grads = FLASH_CPU_BACKWARD(grad_out[tile_set.rows][:, None], tile_queries, tile_keys, tile_values,
                                    out[tile_set.rows][:, None], log_sum[tile_set.rows][:, None], 0.0, False,
                                    attn_mask=tile_set.additive_mask(dtype), scale=1.0)
            grad_queries.index_add_(0, tile_set.rows.flatten(), grads[0].reshape(-1, queries.shape[-1]))
            grad_keys.index_add_(0, tile_set.groups, grads[1][:, 0])
            grad_values.index_add_(0, tile_set.groups, grads[2][:, 0])
        return grad_queries, grad_keys, grad_values, None, None


def completed_blocks(length: int, block: int, stride: int) -> int:
    """How many blocks of ``block`` positions, one starting every ``stride``, lie wholly in the first ``length``."""
    return max(0, (length - block) // stride + 1)


@dataclass
class BlockCacheState(DecodingState):
    """The decoding state of a block-selecting mechanism: every key and value so far (:class:`KVState`: what the
    selection and the window read) and the summaries of the completed blocks that the next token scores (MoBA:
    the mean keys; NSA: the compressed keys and values), ``summaries`` [B, H, blocks, D] each, and which
    blocks hold a real key, ``summary_ok`` [B, blocks]."""

    cache: KVState | None = None
    summaries: list[Tensor] = field(default_factory=list)
    summary_ok: Tensor | None = None

    def append(self, key: Tensor, value: Tensor, real: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Adds the new token (at position ``length``) to the cache: (keys, values, real) so far."""
        self.cache.append(key, value, real)
        keys, values, key_real = self.cache.view()
        return keys, values, key_real

    def completed_block(self, block: int, stride: int) -> int | None:
        """The first position of the block that the token at ``length`` completes (blocks of ``block`` positions,
        one every ``stride``), None if it completes none."""
        done = completed_blocks(self.length + 1, block, stride)
        return (done - 1) * stride if done > completed_blocks(self.length, block, stride) else None

    def add_block(self, summaries: list[Tensor], ok: Tensor) -> None:
        """The summaries ([B, H, 1, D] each) of one more completed block, and whether it holds a real key ([B, 1])."""
        self.summaries = [torch.cat([old, new], dim=2) for old, new in zip(self.summaries, summaries)]
        self.summary_ok = torch.cat([self.summary_ok, ok], dim=1)
