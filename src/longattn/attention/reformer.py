"""Reformer's LSH attention (Kitaev et al., 2020).

Queries and keys are shared (shared-QK attention, keys unit-normalised). Each hash round draws a
random rotation R and assigns every vector to the bucket argmax([xR; -xR]) (angular LSH,
section 2). Tokens are sorted by (round, bucket, position), cut into chunks of ``bucket_size``,
and each chunk attends to itself and the chunk before it; by default only to keys of the same
bucket (the set P_i of eq. 3), optionally across buckets. A token attends to itself only when it
has no other valid target. The rounds are combined with weights proportional to
exp(logsumexp of each round's scores) (multi-round LSH attention, section 2).

The fast path works block by block over the sorted chunks (a block: any range of chunks, across
heads, gathering its queries, keys and values from the token-major rows) and recomputes scores in the
backward pass, so it keeps O(rounds * N * head_dim) and never holds more than a block of scores
(BLOCK_ELEMENTS on CPU, sized for the cache; GPU_BLOCK_ELEMENTS on GPUs, where fewer, larger
kernels pay off). Short sequences under autograd are the exception: when all blocks' softmax weights
(rounds * N * 2 * bucket_size per head, still linear in N) hold at most KEEP_WEIGHTS_ELEMENTS, the
forward pass keeps them for the backward pass instead of recomputing them.

Padding: padded tokens are put in a bucket of their own after all real buckets, so where real
tokens land in the sort never depends on padded content.

GPU path (:func:`~longattn.attention.base.uses_gpu_path`): the same hashing, sort and chunked
attention as a few batched programs with no loop over blocks, chunks or heads. With triton, the
kernels of ``_reformer_triton`` hash without the [N, n_buckets] projections and run the chunks'
attention (scores in registers, float32 softmax statistics, outputs and gradients added into token
rows); without it, :func:`lsh_chunks_torch` materialises every chunk's [m, 2m] scores at once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention._triton import float32_takes_pytorch_path, kernels_run_on, pytorch_path_where_kernels_do_not_fit
from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    check_qkv,
    compute_dtype,
    merge_heads,
    output_dtype,
    padding_safe,
    register_attention,
    split_heads,
    uses_gpu_path,
)
from longattn.attention.decoding import KVState

SELF_ATTENTION_SCORE = -5e4  # "attend to itself only if nothing else": large negative but finite
BLOCK_ELEMENTS = 1 << 18  # scores (or hash projections) computed at once: cache-sized, never [N, N]
GPU_BLOCK_ELEMENTS = 1 << 24
# under autograd, the forward pass keeps all blocks' softmax weights for the backward pass when they hold at
# most this many elements (R * N * 2m per head, linear in N; 6.7M for the Reformer forecaster's training step at
# horizon 720), instead of recomputing the scores, their masks and exp there
KEEP_WEIGHTS_ELEMENTS = 1 << 23
VECTOR_ARGMAX_MIN_HALF = 32  # hash projections per round from which _argmax_both_signs uses its float passes
EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38 is still a normal float32


def block_elements(device: torch.device) -> int:
    return BLOCK_ELEMENTS if device.type == "cpu" else GPU_BLOCK_ELEMENTS


def hash_buckets(vectors: Tensor, rotations: Tensor) -> Tensor:
    """Angular LSH: [B, H, N, D] x [D, rounds, n_buckets / 2] -> buckets [B, H, rounds, N]."""
    rotated = torch.einsum("bhnd,drk->bhrnk", vectors, rotations)
    return torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)


def hash_buckets_blocked(vectors: Tensor, rotations: Tensor) -> Tensor:
    """:func:`hash_buckets` without the [N, rounds, n_buckets] tensor: rows of all (batch, head) pairs in
    blocks of at most the block budget of projections (n_buckets grows with N, so a block of tokens of
    every head at once would not be bounded), and argmax([xR; -xR]) found by :func:`_argmax_both_signs`."""
    b, h, n, d = vectors.shape
    _, rounds, half = rotations.shape
    flat_rotations = rotations.reshape(d, rounds * half)
    rows = vectors.detach().reshape(-1, d)  # bucket ids carry no gradient: nothing for autograd to record
    rows_per_block = max(1, block_elements(vectors.device) // (rounds * half))
    buckets = torch.empty(rows.shape[0], rounds, dtype=torch.long, device=vectors.device)
    for start in range(0, rows.shape[0], rows_per_block):
        rotated = (rows[start:start + rows_per_block] @ flat_rotations).unflatten(-1, (rounds, half))
        _argmax_both_signs(rotated, out=buckets[start:start + rows_per_block])
    return buckets.view(b, h, n, rounds).transpose(2, 3)


def _argmax_both_signs(rotated: Tensor, out: Tensor) -> None:
    """argmax([xR; -xR]) over the last axis of ``rotated`` = xR [rows, rounds, half] into ``out`` [rows, rounds]
    (``rotated`` may be overwritten): the first position of the winning value, in xR when max(xR) >= -min(xR)
    (the first half wins ties), else half + its first position in xR as min(xR).

    torch's max / min with indices (and argmax) on a short last axis run element by element; from
    VECTOR_ARGMAX_MIN_HALF projections on, vectorised float passes are cheaper (~0.3-0.9x the CPU; below it
    they measured slower): the extremes, then the matches (1.0 / 0.0 in place) weighted half, ..., 1 by
    position, whose maximum is half - the first match. The same buckets as argmax, ties included; NaN (which
    equals nothing) and dtypes that do not hold the weights exactly take max / min with indices."""
    half = rotated.shape[-1]
    if half >= VECTOR_ARGMAX_MIN_HALF and rotated.dtype in (torch.float32, torch.float64):
        high, low = rotated.amax(dim=-1, keepdim=True), rotated.amin(dim=-1, keepdim=True)
        first_half = high >= -low
        winner = torch.where(first_half, high, low)
        if not torch.isnan(winner).any():
            by_position = torch.arange(half, 0, -1, dtype=rotated.dtype, device=rotated.device)
            first = half - rotated.eq_(winner).mul_(by_position).amax(dim=-1).long()
            torch.where(first_half.squeeze(-1), first, first + half, out=out)
            return
    high, arg_high = rotated.max(dim=-1)
    low, arg_low = rotated.min(dim=-1)
    torch.where(high >= -low, arg_high, arg_low + half, out=out)


class _SlotLayout:
    """Where every sorted slot came from, flattened over (batch, head): slots are [G = B*H*C, m] with C
    chunks per head; chunk g looks back to chunk g - 1 of the same head, cyclically.

    Holds what the masks need (token position, bucket-match id, validity) and the permutations between
    slot order and (round, token) order. A block is any range of chunks, across heads: its keys (each
    chunk, then the chunk it looks back to) are gathered with one index, so the number of blocks, and of
    Python-level steps, is set by the block budget alone, not by the number of heads.
    """

    def __init__(self, round_token_of: Tensor, bucket_size: int, heads_total: int, rounds: int, n_total: int,
                 causal: bool, for_backward: bool) -> None:
        self.round_token_of = round_token_of  # [G*m]: index (bh, round, token) of each slot
        self.slot_of = _inverse(round_token_of)  # [B*H*R*N]: slot holding (bh, round, token)
        self.token_row = round_token_of // (rounds * n_total) * n_total + round_token_of % n_total  # row bh*N + token
        self.position = (round_token_of % n_total).view(-1, bucket_size)  # [G, m]: token of each slot
        self.match_id: Tensor | None = None  # [G, m] bucket-match ids (same-bucket attention)
        self.key_valid: Tensor | None = None  # [G, m] real-token flags (attention across buckets)
        self.heads_total, self.rounds, self.n_total, self.causal = heads_total, rounds, n_total, causal
        self.for_backward = for_backward  # whether autograd will run the backward pass
        self.m = bucket_size
        self.chunks_per_head = rounds * n_total // bucket_size
        chunk = torch.arange(self.position.shape[0], device=round_token_of.device)
        first_of_head = chunk % self.chunks_per_head == 0
        # chunk g looks back to g - 1; a head's first chunk to the head's last
        self.previous = torch.where(first_of_head, chunk + self.chunks_per_head - 1, chunk - 1)

    @property
    def looks_back(self) -> bool:
        return self.chunks_per_head > 1

    @property
    def keys_per_chunk(self) -> int:
        return 2 * self.m if self.looks_back else self.m

    def blocks(self) -> list[tuple[int, int]]:
        per_block = max(1, block_elements(self.position.device) // (2 * self.m * self.m))
        chunks = self.position.shape[0]
        return [(start, min(start + per_block, chunks)) for start in range(0, chunks, per_block)]

    def head_groups(self, width: int) -> list[tuple[int, int]]:
        """Ranges of (batch, head) pairs whose slots of ``width`` values each hold at most the block budget."""
        per_group = max(1, block_elements(self.position.device) // (self.rounds * self.n_total * width))
        return [(first, min(first + per_group, self.heads_total)) for first in range(0, self.heads_total, per_group)]

    def key_slots(self, start: int, stop: int) -> Tensor:
        """Flat slot indices [(stop - start) * keys_per_chunk] of the keys of chunks [start, stop): each chunk's
        own m slots, then (when chunks look back) the m slots of the chunk before it."""
        chunks = torch.arange(start, stop, device=self.previous.device)
        if self.looks_back:
            chunks = torch.stack([chunks, self.previous[start:stop]], dim=1)
        return (chunks[..., None] * self.m + torch.arange(self.m, device=chunks.device)).flatten()

    def keys(self, t: Tensor, slots: Tensor) -> Tensor:
        """Key-side view [len(slots) / keys_per_chunk, keys_per_chunk, ...] of per-slot ``t`` [G, m, ...]."""
        return t.flatten(0, 1).index_select(0, slots).view(-1, self.keys_per_chunk, *t.shape[2:])

    @staticmethod
    def rows(t: Tensor, row_index: Tensor, per_chunk: int) -> Tensor:
        """Rows ``row_index`` of token-major ``t`` [B*H*N, D] as [chunks, per_chunk, D]."""
        return t.index_select(0, row_index).view(-1, per_chunk, t.shape[-1])

    def scores(self, q: Tensor, k: Tensor, start: int, stop: int, slots: Tensor, out: Tensor | None = None) -> Tensor:
        """Masked scores [stop - start, m, keys_per_chunk] of a block of chunks (eq. 3's P_i, causality, padding)
        from its queries [stop - start, m, D] and keys [stop - start, keys_per_chunk, D] (its :meth:`key_slots`),
        written into ``out`` if given."""
        scores = torch.bmm(q, k.transpose(1, 2), out=out)
        blocked = None
        if self.match_id is not None:  # same bucket and round; padded slots have ids of their own
            blocked = self.match_id[start:stop, :, None] != self.keys(self.match_id, slots)[:, None, :]
        elif self.key_valid is not None:
            blocked = ~self.keys(self.key_valid, slots)[:, None, :]
        query_position = self.position[start:stop, :, None]
        key_position = self.keys(self.position, slots)[:, None, :]
        if self.causal:
            future = key_position > query_position
            blocked = future if blocked is None else blocked | future
        if blocked is not None:
            scores.masked_fill_(blocked, -torch.finfo(scores.dtype).max)
        # a slot meets its own token on the chunk's diagonal and, when the look-back chunk belongs to the
        # previous round (each round's first chunk), wherever that chunk holds the same token; tokens are
        # distinct within a round, so equal positions mean exactly these pairs
        scores.masked_fill_(key_position == query_position, SELF_ATTENTION_SCORE)
        return scores


class _ChunkedLSHSoftmax(torch.autograd.Function):
    """Chunked attention of the sorted slots plus the multi-round combination, block by block.

    Combining rounds with weights softmax_r(lse_r) (section 2) is one softmax of query i over the
    union of its slots in all rounds: out_i = sum_{r,j} exp(s_rij - L_i) v_j, L_i = logsumexp_r lse_ri.
    The backward pass is that softmax's, with delta_i = g_i . out_i; it recomputes each block's scores
    (as flash attention does), so no [C, m, 2m] tensor is kept or allocated whole (but see below). Scores that a
    mask replaced by a constant need no explicit zero gradient: their weight underflows (at most
    exp(EXP_FLOOR)) unless the token sees only itself, and then out_i = v_i makes g_i . v_i - delta_i = 0.

    Inputs are token-major [B*H*N, D] rows: each block gathers its queries, keys and values from them
    (and scatters its gradients back), so no sorted copy of all rounds' slots, [B*H*R*N, D], is formed.
    Under autograd, when all blocks' weights [C, m, 2m] hold at most KEEP_WEIGHTS_ELEMENTS, the forward pass
    writes them into one tensor kept for the backward pass instead (the same numbers the recomputation gives).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, layout: _SlotLayout) -> Tensor:
        g, m = layout.position.shape
        d = v.shape[-1]
        per_chunk = layout.keys_per_chunk
        row_max, row_sum, out_slots = q.new_empty(g, m), q.new_empty(g, m), q.new_empty(g, m, d)
        keep = layout.for_backward and g * m * per_chunk <= KEEP_WEIGHTS_ELEMENTS
        kept = q.new_empty(g, m, per_chunk) if keep else None
        for start, stop in layout.blocks():
            slots = layout.key_slots(start, stop)
            key_rows, query_rows = layout.token_row[slots], layout.token_row[start * m:stop * m]
            scores = layout.scores(layout.rows(q, query_rows, m), layout.rows(k, key_rows, per_chunk),
                                   start, stop, slots, out=None if kept is None else kept[start:stop])
            block_max = torch.amax(scores, dim=-1, keepdim=True, out=row_max[start:stop, :, None])
            weights = _exp_shifted(scores, block_max)
            torch.sum(weights, dim=-1, out=row_sum[start:stop])
            torch.bmm(weights, layout.rows(v, key_rows, per_chunk), out=out_slots[start:stop])
        # scale each slot's exp(s - row_max) to exp(s - L_i): normalise rounds against each other
        bh, rounds, n_total = layout.heads_total, layout.rounds, layout.n_total
        lse_by_round = (row_max + row_sum.log()).flatten()[layout.slot_of].view(bh, rounds, n_total)
        round_weight = torch.softmax(lse_by_round, dim=1).flatten()
        scale = round_weight[layout.round_token_of].view(g, m) / row_sum
        # then each token's slots gathered back (un-sorted) and summed over rounds, a few heads at a time: a
        # head's slots are contiguous, so a group's are gathered while its scaling left them in cache (one
        # gather over all B*H*R*N slots missed the cache on nearly every row)
        out = q.new_empty(bh, n_total, d)
        slot_rows, slot_scale, per_head = out_slots.view(g * m, d), scale.view(g * m, 1), rounds * n_total
        for first, last in layout.head_groups(d):
            group = slice(first * per_head, last * per_head)
            slot_rows[group].mul_(slot_scale[group])
            by_round = slot_rows.index_select(0, layout.slot_of[group]).view(last - first, rounds, n_total, d)
            torch.sum(by_round, dim=1, out=out[first:last])
        ctx.layout = layout
        ctx.save_for_backward(q, k, v, row_max, scale, out, kept)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative raises instead of being wrong
    def backward(ctx, grad_out: Tensor):
        q, k, v, row_max, scale, out, kept = ctx.saved_tensors
        layout: _SlotLayout = ctx.layout
        g, m = layout.position.shape
        per_chunk = layout.keys_per_chunk
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        delta_rows = (grad_out * out).sum(-1).flatten()
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start, stop in layout.blocks():
            slots = layout.key_slots(start, stop)
            key_rows, query_rows = layout.token_row[slots], layout.token_row[start * m:stop * m]
            block_q, block_k = layout.rows(q, query_rows, m), layout.rows(k, key_rows, per_chunk)
            block_scale = scale[start:stop, :, None]
            if kept is None:
                weights = _exp_shifted(layout.scores(block_q, block_k, start, stop, slots), row_max[start:stop, :, None])
            else:
                weights = kept[start:stop]
            block_grad = layout.rows(grad_rows, query_rows, m).mul_(block_scale)
            grad_scores = torch.bmm(block_grad, layout.rows(v, key_rows, per_chunk).transpose(1, 2))
            grad_scores.sub_(delta_rows[query_rows].view(-1, m, 1).mul_(block_scale)).mul_(weights)
            grad_q.index_add_(0, query_rows, torch.bmm(grad_scores, block_k).flatten(0, 1))
            grad_k.index_add_(0, key_rows, torch.bmm(grad_scores.transpose(1, 2), block_q).flatten(0, 1))
            grad_v.index_add_(0, key_rows, torch.bmm(weights.transpose(1, 2), block_grad).flatten(0, 1))
        return grad_q, grad_k, grad_v, None


def _exp_shifted(scores: Tensor, row_max: Tensor) -> Tensor:
    """exp(scores - row_max) in place. Arguments are floored at EXP_FLOOR: below it exp adds under 1e-37
    next to the row's largest weight (1), and CPU exp is several times slower on far-negative input."""
    return scores.sub_(row_max).clamp_(min=EXP_FLOOR).exp_()


def _inverse(permutation: Tensor) -> Tensor:
    return torch.empty_like(permutation).scatter_(0, permutation, torch.arange(len(permutation), device=permutation.device))


@padding_safe
def lsh_attention(
    shared_qk: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    rotations: Tensor,
    bucket_size: int = 64,
    attend_across_buckets: bool = False,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """LSH attention on [B, H, N, Dh] with shared queries/keys; ``rotations`` [Dh, rounds, n_buckets / 2]
    where n_buckets = ceil(N / bucket_size) rounded up to even (see :func:`num_buckets`)."""
    check_qkv(shared_qk, shared_qk, value, attention_mask)
    b, h, n, d = shared_qk.shape
    if rotations.dim() != 3 or rotations.shape[0] != d or 0 in rotations.shape:
        raise AttentionError(f"rotations must be [Dh={d}, rounds, n_buckets / 2], got {list(rotations.shape)}")
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise AttentionError(f"bucket_size must be a positive int, got {bucket_size!r}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if uses_gpu_path(shared_qk):
        return _lsh_gpu(shared_qk, value, attention_mask, rotations, bucket_size, attend_across_buckets, is_causal,
                        scale)
    rounds, n_buckets = rotations.shape[1], 2 * rotations.shape[2]
    m = bucket_size
    pad = (-n) % m
    valid = attention_mask
    if pad:
        shared_qk, value = F.pad(shared_qk, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
        if valid is None:
            valid = torch.ones(b, n, dtype=torch.bool, device=shared_qk.device)
        valid = F.pad(valid, (0, pad), value=False)
    n_total = n + pad
    device = shared_qk.device

    buckets = hash_buckets_blocked(shared_qk, rotations)
    if valid is not None:
        buckets = buckets.masked_fill(~valid[:, None, None, :], n_buckets)  # padding: a bucket of its own
    # bucket ids are offset per round so the flattened sort keeps rounds apart
    buckets = buckets + torch.arange(rounds, device=device)[:, None] * (n_buckets + 1)
    order = (buckets * n_total + torch.arange(n_total, device=device)).flatten(2).argsort(dim=-1)  # [B, H, R*N]

    # flatten (batch, head): slot s of head-row bh is global slot bh*R*N + s
    bh = b * h
    order = order.view(bh, -1)
    head_offset = torch.arange(bh, device=device)[:, None] * (rounds * n_total)
    for_backward = torch.is_grad_enabled() and (shared_qk.requires_grad or value.requires_grad)
    layout = _SlotLayout((order + head_offset).flatten(), m, bh, rounds, n_total, is_causal, for_backward)

    slot_valid = None
    if valid is not None:
        slot_valid = valid.repeat_interleave(h, dim=0).gather(1, order % n_total).view(-1, m)
    if not attend_across_buckets:
        match_id = buckets.reshape(bh, -1).gather(1, order).view(-1, m)
        if slot_valid is not None:  # padded slots match nothing, so only themselves (as the reference)
            match_id = torch.where(slot_valid, match_id, -1 - torch.arange(match_id.numel(), device=device).view(-1, m))
        layout.match_id = match_id
    else:
        layout.key_valid = slot_valid
    # normalising and scaling the N token rows once, before the blocks gather them for all rounds
    # shared-QK: unit-length keys; half inputs are normalised in float32, where the norm's eps (1e-12)
    # does not round to zero and turn the padded (all-zero) rows into 0 / 0
    keys = F.normalize(shared_qk.to(compute_dtype(shared_qk.dtype)), dim=-1).to(shared_qk.dtype)
    token_major = (t.reshape(bh * n_total, t.shape[-1]) for t in (shared_qk * scale, keys, value))  # [B*H*N, D]
    out = _ChunkedLSHSoftmax.apply(*token_major, layout)
    return out.view(b, h, n_total, d)[:, :, :n]


# ----------------------------------------------------------------------------- GPU path


@pytorch_path_where_kernels_do_not_fit
def _hash_gpu(vectors: Tensor, rotations: Tensor) -> Tensor:
    """Buckets [B, H, R, N] on the GPU path: the Triton kernel where it runs, else the projections of all
    tokens at once ([B, H, N, R, n_buckets / 2] in the GEMM dtype) and their max / min with indices."""
    if kernels_run_on(vectors) and not float32_takes_pytorch_path(vectors):
        from longattn.attention._reformer_triton import lsh_hash

        return lsh_hash(vectors, rotations)
    b, h, n, d = vectors.shape
    _, rounds, half = rotations.shape
    rotated = (vectors @ rotations.to(vectors.dtype).reshape(d, rounds * half)).view(b, h, n, rounds, half)
    top, top_index = rotated.max(dim=-1)
    bottom, bottom_index = rotated.min(dim=-1)
    # argmax([xR; -xR]): the first half wins a tie (as argmax, the first position)
    return torch.where(top >= -bottom, top_index, half + bottom_index).transpose(2, 3)


def lsh_chunks_torch(q: Tensor, k: Tensor, v: Tensor, slot_token: Tensor, slot_bucket: Tensor, valid: Tensor,
                     heads: int, bucket_size: int, scale: float, across: bool, causal: bool) -> Tensor:
    """The chunked attention of the sorted slots with the rounds combined (one softmax of each token over its
    slots in all rounds, see :class:`_ChunkedLSHSoftmax`), all chunks at once: [chunks, m, 2m] scores in float32;
    autograd gives the backward pass. The GPU path without triton, and the Triton kernels' reference.

    q (unscaled), k (unit length), v: token-major rows [P*N, D] of P = B*H (batch, head) pairs; slot_token,
    slot_bucket [P, R*N]: the token and bucket id (distinct across rounds) of each sorted slot, round r's slots
    being [r*N, (r+1)*N); valid [B, N] bool. Returns [P*N, D] in the accumulation dtype."""
    pairs, slots = slot_token.shape
    n, d = q.shape[0] // pairs, q.shape[1]
    m = bucket_size
    chunks = slots // m
    acc = compute_dtype(q.dtype)
    rows = slot_token + n * torch.arange(pairs, device=q.device)[:, None]  # [P, R*N] token rows
    slot_valid = valid.repeat_interleave(heads, dim=0).gather(1, slot_token)

    def by_chunk(t: Tensor) -> Tensor:
        return t.reshape(pairs, chunks, m, *t.shape[2:])

    def with_previous(t: Tensor) -> Tensor:
        """[P, C, m, ...] -> [P, C, 2m, ...]: each chunk's own slots, then the previous chunk's (if any)."""
        return torch.cat([t, t.roll(1, dims=1)], dim=2) if chunks > 1 else t

    q_s = by_chunk(q[rows])
    k_keys, v_keys = (with_previous(by_chunk(t[rows])) for t in (k, v))
    token_q, bucket_q = by_chunk(slot_token)[..., :, None], by_chunk(slot_bucket)[..., :, None]
    token_k, bucket_k, valid_k = (with_previous(by_chunk(t))[..., None, :] for t in (slot_token, slot_bucket, slot_valid))
    scores = (q_s @ k_keys.transpose(-1, -2)).to(acc) * scale  # [P, C, m, 2m]
    allowed = valid_k if across else valid_k & (bucket_q == bucket_k)
    if causal:
        allowed = allowed & (token_k <= token_q)
    scores = torch.where(token_k == token_q, SELF_ATTENTION_SCORE, torch.where(allowed, scores, float("-inf")))
    # L of each token: logsumexp over its slots' lse in all rounds (slot s of a head is in round s // N)
    lse = scores.logsumexp(-1).reshape(pairs, slots)
    round_token = (torch.arange(slots, device=q.device) // n * n)[None, :] + slot_token
    total = torch.empty_like(lse).scatter(1, round_token, lse).view(pairs, slots // n, n).logsumexp(1)
    weights = torch.exp(scores - by_chunk(total.gather(1, slot_token))[..., None])
    slot_out = (weights.to(v.dtype) @ v_keys).to(acc).reshape(pairs, slots, d)
    out = torch.zeros(pairs, n, d, dtype=acc, device=q.device)
    return out.scatter_add(1, slot_token[..., None].expand(-1, -1, d), slot_out).view(pairs * n, d)


@pytorch_path_where_kernels_do_not_fit
def _lsh_gpu(shared_qk: Tensor, value: Tensor, attention_mask: Tensor | None, rotations: Tensor, bucket_size: int,
             across: bool, causal: bool, scale: float) -> Tensor:
    """LSH attention on the GPU path: hashing, sort and the chunks' attention as batched programs."""
    dtype = output_dtype(shared_qk)
    qk, value = shared_qk.to(dtype), value.to(dtype)
    b, h, n, d = qk.shape
    rounds, n_buckets = rotations.shape[1], 2 * rotations.shape[2]
    pad = (-n) % bucket_size
    valid = torch.ones(b, n, dtype=torch.bool, device=qk.device) if attention_mask is None else attention_mask
    if pad:
        qk, value = F.pad(qk, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
        valid = F.pad(valid, (0, pad), value=False)
    n_total = n + pad
    with torch.no_grad():
        buckets = _hash_gpu(qk.detach(), rotations).masked_fill(~valid[:, None, None, :], n_buckets)
        # bucket ids offset per round, so that the sort keeps rounds apart: round r holds slots [r*N, (r+1)*N)
        buckets = buckets + torch.arange(rounds, device=qk.device)[:, None] * (n_buckets + 1)
        order = (buckets * n_total + torch.arange(n_total, device=qk.device)).flatten(2).argsort(dim=-1)
        order = order.view(b * h, rounds * n_total)
        slot_token = order % n_total
        slot_bucket = buckets.reshape(b * h, -1).gather(1, order)
    # shared-QK: unit-length keys (normalised in float32: see lsh_attention)
    keys = F.normalize(qk.to(compute_dtype(dtype)), dim=-1).to(dtype)
    q_rows, k_rows, v_rows = (t.reshape(b * h * n_total, d) for t in (qk, keys, value))
    args = (slot_token, slot_bucket, valid, h, bucket_size, scale, across, causal)
    if kernels_run_on(qk) and not float32_takes_pytorch_path(qk):
        from longattn.attention._reformer_triton import LSHChunkAttention

        out = LSHChunkAttention.apply(q_rows.contiguous(), k_rows.contiguous(), v_rows.contiguous(), *args)
    else:
        out = lsh_chunks_torch(q_rows, k_rows, v_rows, *args)
    return out.view(b, h, n_total, d)[:, :, :n].to(dtype)


@padding_safe
def lsh_attention_reference(
    shared_qk: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    rotations: Tensor,
    bucket_size: int = 64,
    attend_across_buckets: bool = False,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Dense version: per round, an explicit N x N mask of the pairs the chunked sort allows. Tests only."""
    b, h, n, d = shared_qk.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rounds, n_buckets = rotations.shape[1], 2 * rotations.shape[2]
    m = bucket_size
    pad = (-n) % m
    valid = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask
    qk = F.pad(shared_qk, (0, 0, 0, pad))
    val = F.pad(value, (0, 0, 0, pad))
    valid = F.pad(valid, (0, pad), value=False)
    n_total = n + pad
    buckets = hash_buckets(qk, rotations).masked_fill(~valid[:, None, None, :], n_buckets)
    # every (round, token) slot of the flattened sort, as the fast path sees it
    ids = torch.cat([buckets[:, :, r] + r * (n_buckets + 1) for r in range(rounds)], dim=-1)  # [B, H, R*N]
    pos = torch.arange(n_total).repeat(rounds)
    chunk = (ids * n_total + pos).argsort(-1).argsort(-1) // m  # chunk of each slot
    total_chunks = rounds * n_total // m
    keys = F.normalize(qk, dim=-1).repeat(1, 1, rounds, 1)
    vals = val.repeat(1, 1, rounds, 1)
    key_valid = valid.repeat(1, rounds)[:, None, None, :]
    outs, lses = [], []
    for r in range(rounds):
        q_slots = slice(r * n_total, (r + 1) * n_total)
        cq, ck = chunk[..., q_slots, None], chunk[..., None, :]
        allowed = ((cq == ck) | (cq == (ck + 1) % total_chunks)) & key_valid
        if not attend_across_buckets:
            allowed = allowed & (ids[..., q_slots, None] == ids[..., None, :])
        if is_causal:
            allowed = allowed & (pos[None, :] <= torch.arange(n_total)[:, None])
        s = (qk @ keys.transpose(-1, -2) * scale).masked_fill(~allowed, -torch.finfo(qk.dtype).max)
        s = s.masked_fill(pos[None, :] == torch.arange(n_total)[:, None], SELF_ATTENTION_SCORE)
        lse = s.logsumexp(-1, keepdim=True)
        outs.append((s - lse).exp() @ vals)
        lses.append(lse)
    weights = torch.softmax(torch.stack(lses), dim=0)
    return (torch.stack(outs) * weights).sum(0)[:, :, :n]


def num_buckets(length: int, bucket_size: int) -> int:
    """Number of hash buckets for a sequence: about one bucket per chunk, at least 2, even."""
    n = max(2, -(-length // bucket_size))
    return n + n % 2


@register_attention(
    "reformer",
    capabilities=Capabilities(causal=True, stochastic_eval=True),
    functional=lsh_attention,
    reference=lsh_attention_reference,
    paper="Reformer: The Efficient Transformer (Kitaev et al., 2020)",
)
class ReformerAttention(AttentionBase):
    """LSH self-attention with shared QK; fresh random rotations at every call (as in the paper)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        bucket_size: int = 64,
        n_hashes: int = 4,
        attend_across_buckets: bool = False,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if bucket_size < 1 or n_hashes < 1:
            raise AttentionError(f"bucket_size and n_hashes must be >= 1, got {bucket_size}, {n_hashes}")
        self.to_qk = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        self.bucket_size = bucket_size
        self.n_hashes = n_hashes
        self.attend_across_buckets = attend_across_buckets

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        qk, v = split_heads(self.to_qk(x), self.heads), split_heads(self.to_v(x), self.heads)
        n_b = num_buckets(x.shape[1], self.bucket_size)
        # drawn in float32 whatever the input's dtype, so that one seed gives the same rotations (and buckets)
        # in float64, float32 and under autocast
        rotations = torch.randn(self.head_dim, self.n_hashes, n_b // 2, device=x.device).to(x.dtype)
        out = lsh_attention(qk, v, attention_mask, rotations=rotations, bucket_size=self.bucket_size,
                            attend_across_buckets=self.attend_across_buckets, is_causal=self.causal)
        return self.to_out(merge_heads(out))

    # -- decoding: no incremental form (fresh buckets at every call, their number following N): each token
    # recomputes the causal LSH attention over the cached shared-QK vectors and values, keeping the last row --
    decode_state = "recompute"

    def _lsh(self, qk: Tensor, v: Tensor, attention_mask: Tensor | None) -> Tensor:
        n_b = num_buckets(qk.shape[2], self.bucket_size)
        rotations = torch.randn(self.head_dim, self.n_hashes, n_b // 2, device=qk.device, dtype=qk.dtype)
        return lsh_attention(qk, v, attention_mask, rotations=rotations, bucket_size=self.bucket_size,
                             attend_across_buckets=self.attend_across_buckets, is_causal=True)

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, KVState]:
        qk, v = split_heads(self.to_qk(x), self.heads), split_heads(self.to_v(x), self.heads)
        return self.to_out(merge_heads(self._lsh(qk, v, attention_mask))), KVState.start(qk, v, attention_mask)

    def step_attend(self, x: Tensor, state: KVState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, KVState]:
        state.append(split_heads(self.to_qk(x), self.heads), split_heads(self.to_v(x), self.heads), real)
        qk, v, visible = state.view()
        out = self._lsh(qk, v, visible if state.padded else None)[:, :, -1:]
        return self.to_out(merge_heads(out)), state
