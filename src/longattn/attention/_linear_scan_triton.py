"""The causal scan of the linear-attention family (linear, performer, cosformer) as Triton kernels.

Given features ``q``, ``k`` [B, H, N, K] and values ``v`` [B, H, N, V], the causal sums are

    o_i = sum_{j <= i} (q_i . k_j) v_j      [B, H, N, V]        (linear transformer eq. 8-9)
    z_i = sum_{j <= i}  q_i . k_j           [B, H, N]

(the numerator and the normaliser; each mechanism divides them itself). Three forms of the same
computation, after flash-linear-attention's naive / chunk / recurrent:

* :func:`causal_scan_naive`: the masked N x N product (tests only);
* :func:`causal_scan_recurrent`: token by token with the running sums S = sum_j k_j v_j^T and
  s = sum_j k_j, the form a decoder steps through (tests only);
* the chunked form: chunks of ``chunk`` tokens, quadratic inside a chunk (in the input dtype, as
  the GEMMs of autocast), the running state across chunks accumulated in float32.
  :func:`longattn.attention.linear.causal_scan_chunked` is that computation in plain PyTorch (the
  GPU path without triton); :class:`CausalScan` runs it as Triton kernels, forward and backward
  (:func:`longattn.attention.linear.causal_scan` picks one).

The kernels: ``_chunk_states`` walks the chunks of one (batch, head) in order and writes each
chunk's exclusive state h_c = sum_{c' < c} k_c'^T v_c' (and sum of k); ``_chunk_output`` is
parallel over chunks: o_c = q_c h_c + tril(q_c k_c^T) v_c. The backward pass recomputes the
states, walks the chunks in reverse for dh_c = sum_{c' > c} q_c'^T do_c' (``_chunk_states`` again),
and ``_chunk_backward`` forms dq, dk, dv of each chunk from them (parallel over chunks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.attention._triton import check_backward, launch, launches_on_input_device
from longattn.attention.base import compute_dtype

__all__ = ["CausalScan", "causal_scan_naive", "causal_scan_recurrent"]


# ----------------------------------------------------------------------------- plain PyTorch


def causal_scan_naive(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The N x N form: A = tril(q k^T), o = A v, z = A 1. Tests only."""
    scores = (q @ k.transpose(-1, -2)).tril()
    return scores @ v, scores.sum(-1)


def causal_scan_recurrent(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Token by token: S += k_t v_t^T, s += k_t, o_t = q_t S, z_t = q_t . s (a decoder's step).
    Tests only (a Python loop over tokens)."""
    acc = compute_dtype(q.dtype)
    state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1], dtype=acc)
    key_sum = q.new_zeros(*q.shape[:2], q.shape[-1], dtype=acc)
    outputs, normalisers = [], []
    for t in range(q.shape[2]):
        state = state + k[:, :, t, :, None].to(acc) * v[:, :, t, None, :].to(acc)
        key_sum = key_sum + k[:, :, t].to(acc)
        outputs.append((q[:, :, t, None, :].to(acc) @ state)[:, :, 0])
        normalisers.append((q[:, :, t].to(acc) * key_sum).sum(-1))
    return torch.stack(outputs, dim=2), torch.stack(normalisers, dim=2)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _chunk_states(a_ptr, b_ptr, w_ptr, s_ptr, sw_ptr, N, NC, K, V,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                  HAS_W: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """Exclusive running state per chunk of one (batch*head, K block): s_c = sum_{c' before c} a_c'^T b_c' and
    sw_c = sum_{c' before c} a_c'^T w_c' (w = 1 unless HAS_W); "before" is "after" when REVERSE."""
    i_k, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    offs_t = tl.arange(0, BT)
    mask_k, mask_v = offs_k < K, offs_v < V
    state = tl.zeros([BK, BV], dtype=ACC)
    state_w = tl.zeros([BK], dtype=ACC)
    for i in range(NC):
        if REVERSE:
            c = NC - 1 - i
        else:
            c = i
        s_rows = (i_bh * NC + c) * K + offs_k
        tl.store(s_ptr + s_rows[:, None] * V + offs_v[None, :], state.to(s_ptr.dtype.element_ty),
                 mask=mask_k[:, None] & mask_v[None, :])
        tl.store(sw_ptr + s_rows, state_w, mask=mask_k)
        t = c * BT + offs_t
        mask_t = t < N
        rows = i_bh * N + t
        a = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + rows[:, None] * V + offs_v[None, :], mask=mask_t[:, None] & mask_v[None, :], other=0.0)
        state += tl.dot(tl.trans(a), b, input_precision=PRECISION).to(ACC)
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=mask_t, other=0.0).to(ACC)
            state_w += tl.sum(a.to(ACC) * w[:, None], 0)
        else:
            state_w += tl.sum(a.to(ACC), 0)


@triton.jit
def _chunk_output(q_ptr, k_ptr, v_ptr, h_ptr, hk_ptr, o_ptr, z_ptr, N, NC, K, V,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
                  ACC: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk: o_c = q_c h_c + tril(q_c k_c^T) v_c, z_c = q_c hk_c + tril(q_c k_c^T) 1."""
    c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_t = c * BT + tl.arange(0, BT)
    offs_v = tl.arange(0, BV)
    mask_t, mask_v = offs_t < N, offs_v < V
    rows = i_bh * N + offs_t
    out = tl.zeros([BT, BV], dtype=ACC)
    scores = tl.zeros([BT, BT], dtype=ACC)
    z = tl.zeros([BT], dtype=ACC)
    for i_k in range(NK):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        tile = mask_t[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + rows[:, None] * K + offs_k[None, :], mask=tile, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * K + offs_k[None, :], mask=tile, other=0.0)
        s_rows = (i_bh * NC + c) * K + offs_k
        h = tl.load(h_ptr + s_rows[:, None] * V + offs_v[None, :], mask=mask_k[:, None] & mask_v[None, :], other=0.0)
        hk = tl.load(hk_ptr + s_rows, mask=mask_k, other=0.0)
        out += tl.dot(q, h, input_precision=PRECISION).to(ACC)
        scores += tl.dot(q, tl.trans(k), input_precision=PRECISION).to(ACC)
        z += tl.sum(q.to(ACC) * hk[None, :], 1)
    causal = offs_t[:, None] >= offs_t[None, :]
    scores = tl.where(causal, scores, 0.0)
    v = tl.load(v_ptr + rows[:, None] * V + offs_v[None, :], mask=mask_t[:, None] & mask_v[None, :], other=0.0)
    out += tl.dot(scores.to(v.dtype), v, input_precision=PRECISION).to(ACC)
    z += tl.sum(scores, 1)
    tl.store(o_ptr + rows[:, None] * V + offs_v[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_v[None, :])
    tl.store(z_ptr + rows, z, mask=mask_t)


@triton.jit
def _chunk_backward(q_ptr, k_ptr, v_ptr, do_ptr, dz_ptr, h_ptr, hk_ptr, dh_ptr, dhz_ptr, dq_ptr, dk_ptr, dv_ptr,
                    N, NC, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
                    ACC: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk's gradients, with dA = tril(do_c v_c^T + dz_c 1^T) and A = tril(q_c k_c^T):
    dq = dA k_c + do_c h_c^T + dz_c hk_c^T, dk = dA^T q_c + v_c dh_c^T + 1 dhz_c^T, dv = A^T do_c + k_c dh_c."""
    c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_t = c * BT + tl.arange(0, BT)
    offs_v = tl.arange(0, BV)
    mask_t, mask_v = offs_t < N, offs_v < V
    rows = i_bh * N + offs_t
    value_tile = mask_t[:, None] & mask_v[None, :]
    causal = offs_t[:, None] >= offs_t[None, :]
    scores = tl.zeros([BT, BT], dtype=ACC)
    for i_k in range(NK):
        offs_k = i_k * BK + tl.arange(0, BK)
        tile = mask_t[:, None] & (offs_k < K)[None, :]
        q = tl.load(q_ptr + rows[:, None] * K + offs_k[None, :], mask=tile, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * K + offs_k[None, :], mask=tile, other=0.0)
        scores += tl.dot(q, tl.trans(k), input_precision=PRECISION).to(ACC)
    scores = tl.where(causal, scores, 0.0)
    v = tl.load(v_ptr + rows[:, None] * V + offs_v[None, :], mask=value_tile, other=0.0)
    do = tl.load(do_ptr + rows[:, None] * V + offs_v[None, :], mask=value_tile, other=0.0)
    dz = tl.load(dz_ptr + rows, mask=mask_t, other=0.0).to(ACC)
    d_scores = tl.dot(do, tl.trans(v), input_precision=PRECISION).to(ACC) + dz[:, None]
    d_scores = tl.where(causal, d_scores, 0.0).to(q_ptr.dtype.element_ty)
    dv = tl.dot(tl.trans(scores.to(do.dtype)), do, input_precision=PRECISION).to(ACC)
    for i_k in range(NK):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        tile = mask_t[:, None] & mask_k[None, :]
        state_tile = mask_k[:, None] & mask_v[None, :]
        q = tl.load(q_ptr + rows[:, None] * K + offs_k[None, :], mask=tile, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * K + offs_k[None, :], mask=tile, other=0.0)
        s_rows = (i_bh * NC + c) * K + offs_k
        h = tl.load(h_ptr + s_rows[:, None] * V + offs_v[None, :], mask=state_tile, other=0.0)
        dh = tl.load(dh_ptr + s_rows[:, None] * V + offs_v[None, :], mask=state_tile, other=0.0)
        hk = tl.load(hk_ptr + s_rows, mask=mask_k, other=0.0)
        dhz = tl.load(dhz_ptr + s_rows, mask=mask_k, other=0.0)
        dq = (tl.dot(d_scores, k, input_precision=PRECISION).to(ACC)
              + tl.dot(do, tl.trans(h), input_precision=PRECISION).to(ACC) + dz[:, None] * hk[None, :])
        dk = (tl.dot(tl.trans(d_scores), q, input_precision=PRECISION).to(ACC)
              + tl.dot(v, tl.trans(dh), input_precision=PRECISION).to(ACC) + dhz[None, :])
        dv += tl.dot(k, dh, input_precision=PRECISION).to(ACC)
        tl.store(dq_ptr + rows[:, None] * K + offs_k[None, :], dq.to(dq_ptr.dtype.element_ty), mask=tile)
        tl.store(dk_ptr + rows[:, None] * K + offs_k[None, :], dk.to(dk_ptr.dtype.element_ty), mask=tile)
    tl.store(dv_ptr + rows[:, None] * V + offs_v[None, :], dv.to(dv_ptr.dtype.element_ty), mask=value_tile)


# ----------------------------------------------------------------------------- launchers


# The chunk backward's launch: its state is the largest of the three kernels (scores, their gradient, dv and the
# tiles of q, k, v, do, h, dh). Compiled for sm_80 in bf16 at its default 4 warps and 3 stages it spilled 16-21 KB
# at 128-256 features (ptxas then kept 32 registers); 8 warps without software pipelining of its short loops over
# the K blocks spill at most 1.3 KB there and nothing on sm_90 (``longattn bench compile``, docs/performance.md).
_BACKWARD_LAUNCH = dict(num_warps=8, num_stages=1)


def _tiles(k_dim: int, v_dim: int) -> tuple[int, int, int]:
    """(BK, BV, NK): K in blocks of at most 64, the values in one block (at least 16: tl.dot's minimum)."""
    block_k = max(16, min(64, triton.next_power_of_2(k_dim)))
    block_v = max(16, triton.next_power_of_2(v_dim))
    return block_k, block_v, triton.cdiv(k_dim, block_k)


def _kernel_dtypes(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The accumulator dtype and tl.dot's input precision: float32 inputs are multiplied in full float32
    ("ieee", not TF32), float64 (the interpreter) in float64; half inputs on tensor cores, accumulated in float32."""
    if dtype == torch.float64:
        return tl.float64, "ieee"
    return tl.float32, "ieee" if dtype == torch.float32 else None


def _states(a: Tensor, b: Tensor, w: Tensor | None, chunk: int, reverse: bool) -> tuple[Tensor, Tensor]:
    """[P, N, K], [P, N, V] (and w [P, N]) -> exclusive chunk states [P, C, K, V] (in a's dtype) and [P, C, K]."""
    pairs, n, k_dim = a.shape
    v_dim = b.shape[-1]
    count = triton.cdiv(n, chunk)
    block_k, block_v, blocks_k = _tiles(k_dim, v_dim)
    acc, precision = _kernel_dtypes(a.dtype)
    states = a.new_empty(pairs, count, k_dim, v_dim)
    weighted = a.new_empty(pairs, count, k_dim, dtype=compute_dtype(a.dtype))
    launch(_chunk_states, (blocks_k, pairs),
        a, b, a if w is None else w, states, weighted, n, count, k_dim, v_dim,
        BT=chunk, BK=block_k, BV=block_v, REVERSE=reverse, HAS_W=w is not None, ACC=acc, PRECISION=precision)
    return states, weighted


class CausalScan(torch.autograd.Function):
    """(o, z) of the causal scan by the Triton kernels, forward and backward; inputs [B, H, N, K|V] of one
    dtype (float16, bfloat16, float32; float64 in the interpreter); o in that dtype (accumulated in float32,
    rounded once), z in the accumulation dtype.
    The backward pass recomputes the chunk states (nothing of size N x K x V is kept)."""

    @staticmethod
    @launches_on_input_device
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        b, h, n, k_dim = q.shape
        v_dim = v.shape[-1]
        q_, k_, v_ = (t.reshape(b * h, n, t.shape[-1]).contiguous() for t in (q, k, v))
        states, key_sums = _states(k_, v_, None, chunk, reverse=False)
        out = torch.empty_like(v_)  # in the input dtype (the GEMM dtype), rounded once from float32
        normaliser = q.new_empty(b * h, n, dtype=compute_dtype(q.dtype))
        block_k, block_v, blocks_k = _tiles(k_dim, v_dim)
        acc_tl, precision = _kernel_dtypes(q.dtype)
        count = triton.cdiv(n, chunk)
        launch(_chunk_output, (count, b * h),
            q_, k_, v_, states, key_sums, out, normaliser, n, count, k_dim, v_dim,
            BT=chunk, BK=block_k, BV=block_v, NK=blocks_k, ACC=acc_tl, PRECISION=precision)
        ctx.save_for_backward(q_, k_, v_)
        ctx.chunk, ctx.shape = chunk, (b, h)
        out, normaliser = out.view(b, h, n, v_dim), normaliser.view(b, h, n)
        check_backward(CausalScan, ctx, (q_, k_, v_), (out, normaliser))
        return out, normaliser

    @staticmethod
    @torch.autograd.function.once_differentiable
    @launches_on_input_device
    def backward(ctx, grad_out: Tensor | None, grad_normaliser: Tensor | None):
        q, k, v = ctx.saved_tensors
        b, h = ctx.shape
        pairs, n, k_dim = q.shape
        v_dim = v.shape[-1]
        chunk = ctx.chunk
        acc = compute_dtype(q.dtype)
        do = (torch.zeros_like(v) if grad_out is None else grad_out.reshape(pairs, n, v_dim).to(v.dtype)).contiguous()
        dz = (q.new_zeros(pairs, n, dtype=acc) if grad_normaliser is None
              else grad_normaliser.reshape(pairs, n).to(acc)).contiguous()
        states, key_sums = _states(k, v, None, chunk, reverse=False)
        d_states, d_query_sums = _states(q, do, dz, chunk, reverse=True)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        block_k, block_v, blocks_k = _tiles(k_dim, v_dim)
        acc_tl, precision = _kernel_dtypes(q.dtype)
        launch(_chunk_backward, (triton.cdiv(n, chunk), pairs),
            q, k, v, do, dz, states, key_sums, d_states, d_query_sums, dq, dk, dv, n, triton.cdiv(n, chunk),
            k_dim, v_dim, BT=chunk, BK=block_k, BV=block_v, NK=blocks_k, ACC=acc_tl, PRECISION=precision,
            **_BACKWARD_LAUNCH)
        return (dq.view(b, h, n, k_dim), dk.view(b, h, n, k_dim), dv.view(b, h, n, v_dim), None)
