"""Reformer's LSH hashing and its chunked attention within buckets as Triton kernels.

Hashing (section 2): bucket = argmax([xR; -xR]) per round, with R [Dh, rounds, n_buckets / 2]. The
number of buckets grows with N (one per chunk), so the projections of all tokens are N x N / (2 m)
numbers per round and head; ``_lsh_hash`` keeps a tile of them in registers with a running max and
min (the first position wins ties, as argmax).

Chunked attention: the slots of all rounds are sorted by (round, bucket, position) and cut into
chunks of m; each chunk's queries attend to the keys of the chunk and of the one before it (of the
same head, cyclically), masked to the same bucket (unless across buckets), to real keys, causally
if asked, and a token to itself only at score -5e4. The rounds combine as one softmax of each token
over its slots in all rounds (``_ChunkedLSHSoftmax`` of the PyTorch path):
out_i = sum_{r, j} exp(s_rij - L_i) v_j with L_i = logsumexp_r lse_ri. Three kernels, none of which
stores anything of size rounds x N x D:

* ``_lsh_chunk_lse``: lse of every slot over its 2m keys;
* ``_lsh_chunk_out``: with L of each token (logsumexp over rounds, in PyTorch), adds every slot's
  exp(s - L) v into its token's output row (float32, atomic adds: a token's rounds sit in different
  chunks);
* ``_lsh_chunk_backward``: the softmax's backward with delta_i = dO_i . out_i, recomputing each
  chunk's scores (as flash attention does), dq, dk, dv added into token rows the same way.

The plain PyTorch forms of the same computations are in ``reformer``: :func:`hash_buckets` (the
projections materialised) and :func:`lsh_chunks_torch` (all chunks' [m, 2m] scores materialised, the
GPU path without triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.attention._triton import check_backward, launch, launches_on_input_device

__all__ = ["LSHChunkAttention", "lsh_hash"]

SELF_SCORE = tl.constexpr(-5e4)  # reformer.SELF_ATTENTION_SCORE (a constexpr: a kernel reads no other global)


# ----------------------------------------------------------------------------- hashing


@triton.jit
def _lsh_hash(x_ptr, rot_ptr, out_ptr, ROWS, P, R, HALF, BM: tl.constexpr, BP: tl.constexpr, BW: tl.constexpr,
              ACC: tl.constexpr, PRECISION: tl.constexpr):
    """Buckets of rows [BM] for round r: a running max / min (first position) of x R_r over tiles of BW columns."""
    i_m, r = tl.program_id(0), tl.program_id(1)
    offs_m = i_m * BM + tl.arange(0, BM)
    offs_p = tl.arange(0, BP)
    mask_m, mask_p = offs_m < ROWS, offs_p < P
    x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * P + offs_p[None, :], mask=mask_m[:, None] & mask_p[None, :],
                other=0.0)
    best_max = tl.full([BM], float("-inf"), dtype=ACC)
    best_min = tl.full([BM], float("inf"), dtype=ACC)
    arg_max = tl.zeros([BM], dtype=tl.int32)
    arg_min = tl.zeros([BM], dtype=tl.int32)
    for start in range(0, HALF, BW):
        offs_w = start + tl.arange(0, BW)
        mask_w = offs_w < HALF
        w = tl.load(rot_ptr + (offs_p.to(tl.int64)[:, None] * R + r) * HALF + offs_w[None, :],  # 64-bit, as x's
                    mask=mask_p[:, None] & mask_w[None, :], other=0.0)
        projected = tl.dot(x, w, input_precision=PRECISION).to(ACC)  # [BM, BW]
        tile_max = tl.where(mask_w[None, :], projected, float("-inf"))
        tile_min = tl.where(mask_w[None, :], projected, float("inf"))
        value_max, index_max = tl.max(tile_max, 1, return_indices=True, return_indices_tie_break_left=True)
        value_min, index_min = tl.min(tile_min, 1, return_indices=True, return_indices_tie_break_left=True)
        better_max = value_max > best_max  # strictly: an earlier tile keeps a tie
        better_min = value_min < best_min
        arg_max = tl.where(better_max, start + index_max, arg_max)
        arg_min = tl.where(better_min, start + index_min, arg_min)
        best_max = tl.where(better_max, value_max, best_max)
        best_min = tl.where(better_min, value_min, best_min)
    # [xR; -xR]: the first half wins a tie between max(xR) and -min(xR)
    bucket = tl.where(best_max >= -best_min, arg_max, HALF + arg_min)
    tl.store(out_ptr + offs_m.to(tl.int64) * R + r, bucket.to(tl.int64), mask=mask_m)


@launches_on_input_device
def lsh_hash(vectors: Tensor, rotations: Tensor) -> Tensor:
    """:func:`~longattn.attention.reformer.hash_buckets` by the kernel: [B, H, N, D] -> [B, H, R, N] (long), no [.., n_buckets] tensor."""
    b, h, n, d = vectors.shape
    _, rounds, half = rotations.shape
    rows = vectors.reshape(b * h * n, d).contiguous()
    out = torch.empty(b * h * n, rounds, dtype=torch.long, device=vectors.device)
    acc = tl.float64 if vectors.dtype == torch.float64 else tl.float32
    precision = None if vectors.dtype in (torch.float16, torch.bfloat16) else "ieee"
    block_m = 64
    launch(_lsh_hash, (triton.cdiv(b * h * n, block_m), rounds),
        rows, rotations.to(vectors.dtype).contiguous(), out, b * h * n, d, rounds, half,
        BM=block_m, BP=max(16, triton.next_power_of_2(d)), BW=min(64, max(16, triton.next_power_of_2(half))),
        ACC=acc, PRECISION=precision)
    return out.view(b, h, n, rounds).transpose(2, 3)


# ----------------------------------------------------------------------------- chunked attention


@triton.jit
def _chunk_scores(q, k_ptr, tok_ptr, bkt_ptr, valid_ptr, pair, batch, chunk, tq, bq, offs_m, offs_d, N, D, scale,
                  M: tl.constexpr, ACROSS: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                  ACC: tl.constexpr):
    """Scores [BM, BM] of queries q (tokens tq, buckets bq) against the keys of sorted chunk ``chunk`` of
    ``pair``: masked to -inf, a token against itself -5e4; also the keys' tokens and which scores are free
    (neither masked nor the self score)."""
    mask_m = offs_m < M
    slots = chunk * M + offs_m
    tk = tl.load(tok_ptr + pair * (tl.num_programs(0) * M) + slots, mask=mask_m, other=0)
    bk = tl.load(bkt_ptr + pair * (tl.num_programs(0) * M) + slots, mask=mask_m, other=-1)
    real = tl.load(valid_ptr + batch * N + tk, mask=mask_m, other=0) != 0
    k = tl.load(k_ptr + (pair * N + tk)[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & (offs_d < D)[None, :],
                other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(ACC) * scale
    allowed = (real & mask_m)[None, :]
    if not ACROSS:
        allowed = allowed & (bq[:, None] == bk[None, :])
    if CAUSAL:
        allowed = allowed & (tk[None, :] <= tq[:, None])
    itself = (tk[None, :] == tq[:, None]) & mask_m[None, :]
    free = allowed & ~itself
    scores = tl.where(itself, SELF_SCORE, tl.where(allowed, scores, float("-inf")))
    return scores, tk, k, free


@triton.jit
def _chunk_queries(q_ptr, tok_ptr, bkt_ptr, N, H, D, M: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """This program's chunk (axis 0) of its (batch, head) pair (axis 1): the chunk's query rows q [BM, BD],
    their tokens and buckets, slot indices, and the indices and masks of the tile."""
    chunk, pair = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_m, offs_d = tl.arange(0, BM), tl.arange(0, BD)
    mask_m, mask_d = offs_m < M, offs_d < D
    slots = chunk * M + offs_m
    tq = tl.load(tok_ptr + pair * (tl.num_programs(0) * M) + slots, mask=mask_m, other=0)
    bq = tl.load(bkt_ptr + pair * (tl.num_programs(0) * M) + slots, mask=mask_m, other=-2)
    q = tl.load(q_ptr + (pair * N + tq)[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                other=0.0)
    return q, tq, bq, slots, chunk, pair, pair // H, offs_m, offs_d, mask_m, mask_d


@triton.jit
def _lsh_chunk_lse(q_ptr, k_ptr, tok_ptr, bkt_ptr, valid_ptr, lse_ptr, N, H, D, scale, M: tl.constexpr,
                   BM: tl.constexpr, BD: tl.constexpr, LOOKS_BACK: tl.constexpr, ACROSS: tl.constexpr,
                   CAUSAL: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """lse of the slots of one chunk over their keys (the chunk's own and, when chunks look back, the previous)."""
    q, tq, bq, slots, chunk, pair, batch, offs_m, offs_d, mask_m, _ = _chunk_queries(q_ptr, tok_ptr, bkt_ptr, N, H, D,
                                                                                    M, BM, BD)
    chunks = tl.num_programs(0)
    scores, _, _, _ = _chunk_scores(q, k_ptr, tok_ptr, bkt_ptr, valid_ptr, pair, batch, chunk, tq, bq, offs_m, offs_d,
                                    N, D, scale, M, ACROSS, CAUSAL, PRECISION, ACC)
    row_max = tl.maximum(tl.max(scores, 1), -1.0e30)
    if LOOKS_BACK:
        before, _, _, _ = _chunk_scores(q, k_ptr, tok_ptr, bkt_ptr, valid_ptr, pair, batch, (chunk + chunks - 1) % chunks,
                                        tq, bq, offs_m, offs_d, N, D, scale, M, ACROSS, CAUSAL, PRECISION, ACC)
        row_max = tl.maximum(row_max, tl.max(before, 1))
        row_sum = tl.sum(tl.exp(scores - row_max[:, None]), 1) + tl.sum(tl.exp(before - row_max[:, None]), 1)
    else:
        row_sum = tl.sum(tl.exp(scores - row_max[:, None]), 1)
    # the rows of a tile past the chunk (BM > M) see only -inf: their row_max is kept finite, and not stored
    tl.store(lse_ptr + pair * (chunks * M) + slots, row_max + tl.log(tl.maximum(row_sum, 1.0e-30)), mask=mask_m)


@triton.jit
def _lsh_chunk_out(q_ptr, k_ptr, v_ptr, tok_ptr, bkt_ptr, valid_ptr, total_ptr, out_ptr, N, H, D, scale,
                   M: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, LOOKS_BACK: tl.constexpr,
                   ACROSS: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """Adds exp(s - L) v of one chunk's slots into their tokens' output rows (L: logsumexp over rounds)."""
    q, tq, bq, _, chunk, pair, batch, offs_m, offs_d, mask_m, mask_d = _chunk_queries(q_ptr, tok_ptr, bkt_ptr, N, H,
                                                                                     D, M, BM, BD)
    chunks = tl.num_programs(0)
    total = tl.load(total_ptr + pair * N + tq, mask=mask_m, other=0.0)
    scores, tk, _, _ = _chunk_scores(q, k_ptr, tok_ptr, bkt_ptr, valid_ptr, pair, batch, chunk, tq, bq, offs_m,
                                     offs_d, N, D, scale, M, ACROSS, CAUSAL, PRECISION, ACC)
    v = tl.load(v_ptr + (pair * N + tk)[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                other=0.0)
    out = tl.dot(tl.exp(scores - total[:, None]).to(v.dtype), v, input_precision=PRECISION).to(ACC)
    if LOOKS_BACK:
        before, tk, _, _ = _chunk_scores(q, k_ptr, tok_ptr, bkt_ptr, valid_ptr, pair, batch,
                                         (chunk + chunks - 1) % chunks, tq, bq, offs_m, offs_d, N, D, scale, M, ACROSS,
                                         CAUSAL, PRECISION, ACC)
        v = tl.load(v_ptr + (pair * N + tk)[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                    other=0.0)
        out += tl.dot(tl.exp(before - total[:, None]).to(v.dtype), v, input_precision=PRECISION).to(ACC)
    tl.atomic_add(out_ptr + (pair * N + tq)[:, None] * D + offs_d[None, :], out, mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _key_gradients(q, do, delta, total, k_ptr, v_ptr, tok_ptr, bkt_ptr, valid_ptr, dk_ptr, dv_ptr, pair, batch, chunk,
                   tq, bq, offs_m, offs_d, N, D, scale, M: tl.constexpr, ACROSS: tl.constexpr, CAUSAL: tl.constexpr,
                   PRECISION: tl.constexpr, ACC: tl.constexpr):
    """The backward pass against the keys of one chunk: adds dk, dv into their rows, returns the part of dq."""
    mask_m, mask_d = offs_m < M, offs_d < D
    scores, tk, k, free = _chunk_scores(q, k_ptr, tok_ptr, bkt_ptr, valid_ptr, pair, batch, chunk, tq, bq, offs_m,
                                        offs_d, N, D, scale, M, ACROSS, CAUSAL, PRECISION, ACC)
    key_rows = (pair * N + tk)[:, None] * D + offs_d[None, :]
    key_tile = mask_m[:, None] & mask_d[None, :]
    v = tl.load(v_ptr + key_rows, mask=key_tile, other=0.0)
    weights = tl.exp(scores - total[:, None])  # [BM queries, BM keys]
    d_weights = tl.dot(do, tl.trans(v), input_precision=PRECISION).to(ACC)
    # a score that a mask replaced by a constant has no gradient
    d_scores = tl.where(free, weights * (d_weights - delta[:, None]), 0.0).to(q.dtype)
    tl.atomic_add(dv_ptr + key_rows, tl.dot(tl.trans(weights.to(do.dtype)), do, input_precision=PRECISION).to(ACC),
                  mask=key_tile)
    tl.atomic_add(dk_ptr + key_rows, tl.dot(tl.trans(d_scores), q, input_precision=PRECISION).to(ACC) * scale,
                  mask=key_tile)
    return tl.dot(d_scores, k, input_precision=PRECISION).to(ACC) * scale


@triton.jit
def _lsh_chunk_backward(q_ptr, k_ptr, v_ptr, tok_ptr, bkt_ptr, valid_ptr, total_ptr, do_ptr, delta_ptr, dq_ptr,
                        dk_ptr, dv_ptr, N, H, D, scale, M: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                        LOOKS_BACK: tl.constexpr, ACROSS: tl.constexpr, CAUSAL: tl.constexpr,
                        PRECISION: tl.constexpr, ACC: tl.constexpr):
    """The combined softmax's backward pass for one chunk's slots: ds = p (dO . v - delta), delta = dO . out."""
    q, tq, bq, _, chunk, pair, batch, offs_m, offs_d, mask_m, mask_d = _chunk_queries(q_ptr, tok_ptr, bkt_ptr, N, H,
                                                                                     D, M, BM, BD)
    chunks = tl.num_programs(0)
    query_rows = (pair * N + tq)[:, None] * D + offs_d[None, :]
    query_tile = mask_m[:, None] & mask_d[None, :]
    total = tl.load(total_ptr + pair * N + tq, mask=mask_m, other=0.0)
    delta = tl.load(delta_ptr + pair * N + tq, mask=mask_m, other=0.0)
    do = tl.load(do_ptr + query_rows, mask=query_tile, other=0.0)
    dq = _key_gradients(q, do, delta, total, k_ptr, v_ptr, tok_ptr, bkt_ptr, valid_ptr, dk_ptr, dv_ptr, pair, batch,
                        chunk, tq, bq, offs_m, offs_d, N, D, scale, M, ACROSS, CAUSAL, PRECISION, ACC)
    if LOOKS_BACK:
        dq += _key_gradients(q, do, delta, total, k_ptr, v_ptr, tok_ptr, bkt_ptr, valid_ptr, dk_ptr, dv_ptr, pair,
                             batch, (chunk + chunks - 1) % chunks, tq, bq, offs_m, offs_d, N, D, scale, M, ACROSS,
                             CAUSAL, PRECISION, ACC)
    tl.atomic_add(dq_ptr + query_rows, dq, mask=query_tile)


class LSHChunkAttention(torch.autograd.Function):
    """The chunked LSH attention with the rounds combined (see the module doc), forward and backward by the
    kernels. q (unscaled), k (unit length), v: token-major rows [P*N, D] of P = B*H (batch, head) pairs in one
    dtype; slot_token, slot_bucket [P, R*N] long: the token and bucket id (distinct across rounds) of each
    sorted slot, round r's slots being [r*N, (r+1)*N); valid [B, N] bool. Returns [P*N, D] in q's dtype (summed
    in float32, float64 for float64)."""

    @staticmethod
    @launches_on_input_device
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, slot_token: Tensor, slot_bucket: Tensor, valid: Tensor,
                heads: int, bucket_size: int, scale: float, across: bool, causal: bool) -> Tensor:
        pairs, slots = slot_token.shape
        n, d = q.shape[0] // pairs, q.shape[1]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        chunks = slots // bucket_size
        options = _options(q, bucket_size, chunks, across, causal)
        tokens, buckets, valid_ = slot_token.contiguous(), slot_bucket.contiguous(), valid.to(torch.int8).contiguous()
        lse = q.new_empty(pairs, slots, dtype=acc)
        launch(_lsh_chunk_lse, (chunks, pairs), q, k, tokens, buckets, valid_, lse, n, heads, d, scale, **options)
        # L of each token: logsumexp over its slots' lse in all rounds (slot s of a head is in round s // N)
        rounds = slots // n
        round_token = (torch.arange(slots, device=q.device) // n * n)[None, :] + tokens
        total = torch.empty_like(lse).scatter_(1, round_token, lse).view(pairs, rounds, n).logsumexp(1).contiguous()
        out = torch.zeros(pairs * n, d, dtype=acc, device=q.device)
        launch(_lsh_chunk_out, (chunks, pairs), q, k, v, tokens, buckets, valid_, total, out, n, heads, d, scale,
               **options)
        out = out.to(q.dtype)  # the float32 sums rounded once; the backward pass's delta = dO . out takes this
        ctx.save_for_backward(q, k, v, tokens, buckets, valid_, total, out)
        ctx.config = (heads, bucket_size, scale, across, causal)
        check_backward(LSHChunkAttention, ctx, (q, k, v, tokens, buckets, valid_, total, out), (out,))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @launches_on_input_device
    def backward(ctx, grad_out: Tensor):
        q, k, v, tokens, buckets, valid_, total, out = ctx.saved_tensors
        heads, bucket_size, scale, across, causal = ctx.config
        pairs, slots = tokens.shape
        n, d = q.shape[0] // pairs, q.shape[1]
        chunks = slots // bucket_size
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        do = grad_out.to(q.dtype).contiguous()
        delta = (do.to(acc) * out.to(acc)).sum(-1).contiguous()
        # float32 rows that the chunks' atomic adds accumulate into (a token's slots sit in several chunks)
        dq, dk, dv = (torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(3))
        launch(_lsh_chunk_backward, (chunks, pairs), q, k, v, tokens, buckets, valid_, total, do, delta, dq, dk, dv,
               n, heads, d, scale, **_options(q, bucket_size, chunks, across, causal))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


def _options(q: Tensor, bucket_size: int, chunks: int, across: bool, causal: bool) -> dict:
    return dict(M=bucket_size, BM=max(16, triton.next_power_of_2(bucket_size)),
                BD=max(16, triton.next_power_of_2(q.shape[1])), LOOKS_BACK=chunks > 1, ACROSS=across, CAUSAL=causal,
                PRECISION=None if q.dtype in (torch.float16, torch.bfloat16) else "ieee",
                ACC=tl.float64 if q.dtype == torch.float64 else tl.float32)
