"""Block-sparse flash attention in Triton: the GPU kernels of local, BigBird, Longformer and Transformer-LS.

One kernel family serves the four mechanisms. A pattern (:class:`~longattn.attention.chunked.SparsePattern`)
says which keys each query row sees, by rules evaluated tile by tile, so nothing of size N x N (nor
any [N, window] score buffer) is ever stored:

* a **band** of key positions around each query (a sliding window, or the blocked window of a
  segment), with optional dilation;
* per-head **lists of key blocks** per query block (BigBird's random blocks);
* **extra keys** held apart from the sequence (global tokens, Transformer-LS's projected tokens),
  each seen when valid and, if causal, once the query has reached its position;

with padded keys and, if causal, keys after the query masked. Each program takes one tile of query
rows (forward, and dQ in backward) or one tile of keys (dK, dV in backward) and visits only the
tiles of the other side that the pattern can reach: the band's tile range, computed from the band
in the kernel (its inverse for the key tiles), the listed blocks (their inverse list, built once on
the host, for the key tiles) and the extra keys. The softmax is online (flash attention): scores
and running maxima in float32, one pass, the output and the row's log-sum-exp kept for backward,
which recomputes the scores (FlashAttention-2's backward). The GEMMs run in the inputs' dtype
(fp16/bf16 on tensor cores; float32 inputs as true float32, not TF32). The extra keys, which
nearly every query sees, get their gradients from a kernel of their own: each program sums a run
of query tiles in registers and adds the sum to float32 buffers atomically (the order of those few
additions, and so the last bits of the extra keys' gradients, may vary between runs on a GPU).

Attention dropout is drawn in the kernel (Philox, one number per (batch, head, query, key) from a
seed drawn from torch's CPU generator), and redrawn identically in backward.

:func:`blocksparse_attention_reference` is the same computation written plainly (an explicit mask,
a dense softmax) for the tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.attention._triton import (check_backward, float32_takes_pytorch_path, launch,
                                       launches_on_input_device)
from longattn.attention.chunked import SparsePattern

__all__ = ["TILE", "blocksparse_attention", "blocksparse_attention_reference", "kernel_supports"]

# Query and key rows per tile on the GPU (the tests lower it to 16 for Triton's interpreter).
TILE = 64
# Query tiles summed in registers by one program of the extra keys' backward before its one atomic add.
EXTRA_TILES_PER_PROGRAM = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


def kernel_supports(query: Tensor, pattern: SparsePattern) -> bool:
    """Whether the kernels take this input and pattern: fp16, bf16 or float32 (float32 in the interpreter
    only: :func:`float32_takes_pytorch_path`), head dims up to 256, block lists (if any) in blocks of a power
    of two of at least 16 rows."""
    if query.dtype not in _DTYPES or query.shape[-1] > 256 or float32_takes_pytorch_path(query):
        return False
    bs = pattern.block_size
    return pattern.blocks is None or (bs >= 16 and bs & (bs - 1) == 0)


def _tile(pattern: SparsePattern) -> int:
    return TILE if pattern.blocks is None else min(TILE, pattern.block_size)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _band_mask(pos_i, cols, row_ok, n_keys, kvalid_ptr, STEP, START, STOP, DIL,
               CAUSAL: tl.constexpr, HAS_KVALID: tl.constexpr, IN_BAND: tl.constexpr):
    """[rows, cols] mask of sequence keys: inside the band (``IN_BAND``), real, not after the query."""
    ok = row_ok[:, None] & (cols < n_keys)[None, :]
    if IN_BAND:
        segment = (pos_i // STEP) * STEP
        ok = ok & (cols[None, :] >= (segment + START)[:, None]) & (cols[None, :] < (segment + STOP)[:, None])
        if DIL > 1:
            ok = ok & ((cols[None, :] - pos_i[:, None]) % DIL == 0)
    if CAUSAL:
        ok = ok & (cols[None, :] <= pos_i[:, None])
    if HAS_KVALID:
        ok = ok & (tl.load(kvalid_ptr + cols, mask=cols < n_keys, other=0) != 0)[None, :]
    return ok


@triton.jit
def _extra_mask(pos_i, cols, row_ok, n_extra, epos_ptr, evalid_ptr, CAUSAL: tl.constexpr, HAS_EVALID: tl.constexpr):
    ok = row_ok[:, None] & (cols < n_extra)[None, :]
    if CAUSAL:
        epos = tl.load(epos_ptr + cols, mask=cols < n_extra, other=0)
        ok = ok & (epos[None, :] <= pos_i[:, None])
    if HAS_EVALID:
        ok = ok & (tl.load(evalid_ptr + cols, mask=cols < n_extra, other=0) != 0)[None, :]
    return ok


@triton.jit
def _keep(seed, bh, rows, cols, n_rows, n_cols, dropout_p):
    """The dropout draw of (batch-head, row, col): True = kept."""
    offsets = (bh * n_rows + rows.to(tl.int64))[:, None] * n_cols + cols.to(tl.int64)[None, :]
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_ptr, v_ptr, stride_kn, stride_vn, cols, n_cols, ok, offs_d, offs_dv, D, DV,
              qk_scale, seed, bh, rows, n_rows, drop_cols, n_drop_cols, dropout_p,
              DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax: scores in float32 (log2 units), running max and sum."""
    col_ok = cols < n_cols
    keys = cols.to(tl.int64)  # 64-bit offsets: key x stride may pass 2^31
    k = tl.load(k_ptr + keys[None, :] * stride_kn + offs_d[:, None], mask=col_ok[None, :] & (offs_d[:, None] < D),
                other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_keep(seed, bh, rows, drop_cols, n_rows, n_drop_cols, dropout_p), p / (1.0 - dropout_p), 0.0)
    v = tl.load(v_ptr + keys[:, None] * stride_vn + offs_dv[None, :], mask=col_ok[:, None] & (offs_dv[None, :] < DV),
                other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(Q, K, V, KE, VE, O, LSE, KVALID, EPOS, EVALID, EEND, BLOCKS,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_keb, stride_keh, stride_ken, stride_veb, stride_veh, stride_ven,
                stride_ob, stride_oh, stride_on, stride_kvalid, stride_evalid, stride_blh, stride_blm,
                H, NQ, NK, NE, D, DV, Q_OFFSET, N_LIST, STEP, START, STOP, DIL,
                qk_scale, dropout_p, seed,
                CAUSAL: tl.constexpr, HAS_KVALID: tl.constexpr, HAS_EXTRA: tl.constexpr,
                HAS_EVALID: tl.constexpr, HAS_EEND: tl.constexpr, HAS_LIST: tl.constexpr,
                LIST_BLOCK: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x stride may pass 2^31
    b = bh // H
    h = bh % H
    rows = tile * BM + tl.arange(0, BM)
    row_ok = rows < NQ
    pos_i = rows + Q_OFFSET
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    kvalid_ptr = KVALID + b * stride_kvalid
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    n_drop_cols = NK + NE

    # the band: key tiles between the first row's lowest key and the last row's highest
    first = tile * BM + Q_OFFSET
    last = tl.minimum(tile * BM + BM, NQ) - 1 + Q_OFFSET
    lo = tl.maximum((first // STEP) * STEP + START, 0)
    hi = tl.minimum((last // STEP) * STEP + STOP, NK)
    if CAUSAL:
        hi = tl.minimum(hi, last + 1)
    for start_n in range((lo // BN) * BN, hi, BN):
        cols = start_n + tl.arange(0, BN)
        ok = _band_mask(pos_i, cols, row_ok, NK, kvalid_ptr, STEP, START, STOP, DIL, CAUSAL, HAS_KVALID, True)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_ptr, v_ptr, stride_kn, stride_vn, cols, NK, ok, offs_d, offs_dv,
                                  D, DV, qk_scale, seed, bh, rows, NQ, cols, n_drop_cols, dropout_p, DROPOUT, PRECISION)
    if HAS_LIST:
        list_ptr = BLOCKS + h * stride_blh + ((tile * BM) // LIST_BLOCK).to(tl.int64) * stride_blm
        for slot in range(N_LIST):
            block = tl.load(list_ptr + slot)
            if block >= 0:
                for sub in range(0, LIST_BLOCK, BN):
                    cols = block * LIST_BLOCK + sub + tl.arange(0, BN)
                    ok = _band_mask(pos_i, cols, row_ok, NK, kvalid_ptr, STEP, START, STOP, DIL, CAUSAL, HAS_KVALID,
                                    False)
                    acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_ptr, v_ptr, stride_kn, stride_vn, cols, NK, ok,
                                              offs_d, offs_dv, D, DV, qk_scale, seed, bh, rows, NQ, cols, n_drop_cols,
                                              dropout_p, DROPOUT, PRECISION)
    if HAS_EXTRA:
        e_hi = NE
        if HAS_EEND:
            e_hi = tl.load(EEND + tile)
        ke_ptr = KE + b * stride_keb + h * stride_keh
        ve_ptr = VE + b * stride_veb + h * stride_veh
        for start_e in range(0, e_hi, BN):
            cols = start_e + tl.arange(0, BN)
            ok = _extra_mask(pos_i, cols, row_ok, NE, EPOS, EVALID + b * stride_evalid, CAUSAL, HAS_EVALID)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, ke_ptr, ve_ptr, stride_ken, stride_ven, cols, NE, ok, offs_d,
                                      offs_dv, D, DV, qk_scale, seed, bh, rows, NQ, NK + cols, n_drop_cols, dropout_p,
                                      DROPOUT, PRECISION)

    seen = l_i > 0.0  # a row that sees no key outputs zeros
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rows.to(tl.int64)[:, None] * stride_on + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + bh * NQ + rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), 0.0), mask=row_ok)


@triton.jit
def _rows_used(SKIP, rows, NQ, HAS_SKIP: tl.constexpr):
    """Rows whose output is this kernel's (not replaced by other rows after it ran)."""
    ok = rows < NQ
    if HAS_SKIP:
        ok = ok & (tl.load(SKIP + rows, mask=rows < NQ, other=1) == 0)
    return ok


@triton.jit
def _delta_kernel(O, DO, DELTA, SKIP, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
                  H, NQ, DV, HAS_SKIP: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr):
    """delta = rowsum(dO * O), the softmax backward's correction term (float32)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x stride may pass 2^31
    b = bh // H
    h = bh % H
    rows = tile * BM + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)  # 64-bit offsets: row x stride may pass 2^31
    offs = tl.arange(0, BDV)
    mask = _rows_used(SKIP, rows, NQ, HAS_SKIP)[:, None] & (offs < DV)[None, :]
    o = tl.load(O + b * stride_ob + h * stride_oh + rows64[:, None] * stride_on + offs[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows64[:, None] * stride_don + offs[None, :], mask=mask,
                 other=0.0)
    tl.store(DELTA + bh * NQ + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < NQ)


@triton.jit
def _bwd_dq_tile(dq, q, do, lse, delta, k_ptr, v_ptr, stride_kn, stride_vn, cols, n_cols, ok, offs_d, offs_dv, D, DV,
                 qk_scale, seed, bh, rows, n_rows, drop_cols, n_drop_cols, dropout_p,
                 DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile's share of dQ."""
    col_ok = cols < n_cols
    keys = cols.to(tl.int64)  # 64-bit offsets: key x stride may pass 2^31
    k = tl.load(k_ptr + keys[:, None] * stride_kn + offs_d[None, :], mask=col_ok[:, None] & (offs_d[None, :] < D),
                other=0.0)
    v = tl.load(v_ptr + keys[:, None] * stride_vn + offs_dv[None, :], mask=col_ok[:, None] & (offs_dv[None, :] < DV),
                other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        dp = tl.where(_keep(seed, bh, rows, drop_cols, n_rows, n_drop_cols, dropout_p), dp / (1.0 - dropout_p), 0.0)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, KE, VE, DO, LSE, DELTA, DQ, KVALID, EPOS, EVALID, EEND, BLOCKS, SKIP,
                   stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                   stride_keb, stride_keh, stride_ken, stride_veb, stride_veh, stride_ven,
                   stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
                   stride_kvalid, stride_evalid, stride_blh, stride_blm,
                   H, NQ, NK, NE, D, DV, Q_OFFSET, N_LIST, STEP, START, STOP, DIL,
                   qk_scale, sm_scale, dropout_p, seed,
                   CAUSAL: tl.constexpr, HAS_KVALID: tl.constexpr, HAS_EXTRA: tl.constexpr,
                   HAS_EVALID: tl.constexpr, HAS_EEND: tl.constexpr, HAS_LIST: tl.constexpr,
                   LIST_BLOCK: tl.constexpr, HAS_SKIP: tl.constexpr, DROPOUT: tl.constexpr,
                   PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                   BDV: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x stride may pass 2^31
    b = bh // H
    h = bh % H
    rows = tile * BM + tl.arange(0, BM)
    row_ok = rows < NQ
    pos_i = rows + Q_OFFSET
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows.to(tl.int64)[:, None] * stride_don + offs_dv[None, :],
                 mask=_rows_used(SKIP, rows, NQ, HAS_SKIP)[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + bh * NQ + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * NQ + rows, mask=row_ok, other=0.0)
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    kvalid_ptr = KVALID + b * stride_kvalid
    dq = tl.zeros([BM, BD], tl.float32)
    n_drop_cols = NK + NE

    first = tile * BM + Q_OFFSET
    last = tl.minimum(tile * BM + BM, NQ) - 1 + Q_OFFSET
    lo = tl.maximum((first // STEP) * STEP + START, 0)
    hi = tl.minimum((last // STEP) * STEP + STOP, NK)
    if CAUSAL:
        hi = tl.minimum(hi, last + 1)
    for start_n in range((lo // BN) * BN, hi, BN):
        cols = start_n + tl.arange(0, BN)
        ok = _band_mask(pos_i, cols, row_ok, NK, kvalid_ptr, STEP, START, STOP, DIL, CAUSAL, HAS_KVALID, True)
        dq = _bwd_dq_tile(dq, q, do, lse, delta, k_ptr, v_ptr, stride_kn, stride_vn, cols, NK, ok, offs_d, offs_dv,
                          D, DV, qk_scale, seed, bh, rows, NQ, cols, n_drop_cols, dropout_p, DROPOUT, PRECISION)
    if HAS_LIST:
        list_ptr = BLOCKS + h * stride_blh + ((tile * BM) // LIST_BLOCK).to(tl.int64) * stride_blm
        for slot in range(N_LIST):
            block = tl.load(list_ptr + slot)
            if block >= 0:
                for sub in range(0, LIST_BLOCK, BN):
                    cols = block * LIST_BLOCK + sub + tl.arange(0, BN)
                    ok = _band_mask(pos_i, cols, row_ok, NK, kvalid_ptr, STEP, START, STOP, DIL, CAUSAL, HAS_KVALID,
                                    False)
                    dq = _bwd_dq_tile(dq, q, do, lse, delta, k_ptr, v_ptr, stride_kn, stride_vn, cols, NK, ok,
                                      offs_d, offs_dv, D, DV, qk_scale, seed, bh, rows, NQ, cols, n_drop_cols,
                                      dropout_p, DROPOUT, PRECISION)
    if HAS_EXTRA:
        e_hi = NE
        if HAS_EEND:
            e_hi = tl.load(EEND + tile)
        ke_ptr = KE + b * stride_keb + h * stride_keh
        ve_ptr = VE + b * stride_veb + h * stride_veh
        for start_e in range(0, e_hi, BN):
            cols = start_e + tl.arange(0, BN)
            ok = _extra_mask(pos_i, cols, row_ok, NE, EPOS, EVALID + b * stride_evalid, CAUSAL, HAS_EVALID)
            dq = _bwd_dq_tile(dq, q, do, lse, delta, ke_ptr, ve_ptr, stride_ken, stride_ven, cols, NE, ok, offs_d,
                              offs_dv, D, DV, qk_scale, seed, bh, rows, NQ, NK + cols, n_drop_cols, dropout_p,
                              DROPOUT, PRECISION)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows.to(tl.int64)[:, None] * stride_dqn + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _bwd_dkv_tile(dk, dv, k, v, q_ptr, do_ptr, stride_qn, stride_don, lse_ptr, delta_ptr, skip_ptr, rows, n_rows,
                  drop_cols, okT, offs_d, offs_dv, D, DV, qk_scale, seed, bh, n_drop_cols, dropout_p,
                  HAS_SKIP: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile's share of dK and dV (transposed: rows of the tile are keys); ``drop_cols``
    are the keys' columns in the dropout draws."""
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)  # 64-bit offsets: row x stride may pass 2^31
    q = tl.load(q_ptr + rows64[:, None] * stride_qn + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D),
                other=0.0)
    do = tl.load(do_ptr + rows64[:, None] * stride_don + offs_dv[None, :],
                 mask=_rows_used(skip_ptr, rows, n_rows, HAS_SKIP)[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [keys, rows]
    pT = tl.where(okT, tl.exp2(sT - lse[None, :]), 0.0)
    dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    p_used = pT
    if DROPOUT:
        keepT = tl.trans(_keep(seed, bh, rows, drop_cols, n_rows, n_drop_cols, dropout_p))
        dpT = tl.where(keepT, dpT / (1.0 - dropout_p), 0.0)
        p_used = tl.where(keepT, pT / (1.0 - dropout_p), 0.0)
    dv += tl.dot(p_used.to(do.dtype), do, input_precision=PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_, KVALID, BLOCKS_T, SKIP,
                    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn,
                    stride_dvb, stride_dvh, stride_dvn, stride_kvalid, stride_bth, stride_btm,
                    H, NQ, NK, NE, D, DV, Q_OFFSET, N_LIST_T, STEP, START, STOP, DIL,
                    qk_scale, sm_scale, dropout_p, seed,
                    CAUSAL: tl.constexpr, HAS_KVALID: tl.constexpr, HAS_LIST: tl.constexpr,
                    LIST_BLOCK: tl.constexpr, HAS_SKIP: tl.constexpr, DROPOUT: tl.constexpr,
                    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    BDV: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x stride may pass 2^31
    b = bh // H
    h = bh % H
    cols = tile * BN + tl.arange(0, BN)
    col_ok = cols < NK
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    k = tl.load(K + b * stride_kb + h * stride_kh + cols.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols.to(tl.int64)[:, None] * stride_vn + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh
    lse_ptr = LSE + bh * NQ
    delta_ptr = DELTA + bh * NQ
    kvalid_ptr = KVALID + b * stride_kvalid
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    n_drop_cols = NK + NE

    # the query positions whose band reaches keys [first, last]: the band's inverse
    first = tile * BN
    last = tl.minimum(tile * BN + BN, NK) - 1
    reach = first - STOP + 1
    lo = tl.where(reach > 0, ((reach + STEP - 1) // STEP) * STEP, 0)
    if CAUSAL:
        lo = tl.maximum(lo, first)
    hi = ((last - START) // STEP + 1) * STEP
    lo = tl.maximum(lo - Q_OFFSET, 0)
    hi = tl.minimum(hi - Q_OFFSET, NQ)
    for start_m in range((lo // BM) * BM, hi, BM):
        rows = start_m + tl.arange(0, BM)
        okT = tl.trans(_band_mask(rows + Q_OFFSET, cols, rows < NQ, NK, kvalid_ptr, STEP, START, STOP, DIL, CAUSAL,
                                  HAS_KVALID, True))
        dk, dv = _bwd_dkv_tile(dk, dv, k, v, q_ptr, do_ptr, stride_qn, stride_don, lse_ptr, delta_ptr, SKIP, rows, NQ,
                               cols, okT, offs_d, offs_dv, D, DV, qk_scale, seed, bh, n_drop_cols, dropout_p, HAS_SKIP,
                               DROPOUT, PRECISION)
    if HAS_LIST:
        list_ptr = BLOCKS_T + h * stride_bth + ((tile * BN) // LIST_BLOCK).to(tl.int64) * stride_btm
        for slot in range(N_LIST_T):
            block = tl.load(list_ptr + slot)
            if block >= 0:
                for sub in range(0, LIST_BLOCK, BM):
                    rows = block * LIST_BLOCK + sub + tl.arange(0, BM)
                    okT = tl.trans(_band_mask(rows + Q_OFFSET, cols, rows < NQ, NK, kvalid_ptr, STEP, START, STOP,
                                              DIL, CAUSAL, HAS_KVALID, False))
                    dk, dv = _bwd_dkv_tile(dk, dv, k, v, q_ptr, do_ptr, stride_qn, stride_don, lse_ptr, delta_ptr,
                                           SKIP, rows, NQ, cols, okT, offs_d, offs_dv, D, DV, qk_scale, seed, bh,
                                           n_drop_cols, dropout_p, HAS_SKIP, DROPOUT, PRECISION)
    tl.store(DK + b * stride_dkb + h * stride_dkh + cols.to(tl.int64)[:, None] * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None] & (offs_d[None, :] < D))
    tl.store(DV_ + b * stride_dvb + h * stride_dvh + cols.to(tl.int64)[:, None] * stride_dvn + offs_dv[None, :],
             dv.to(DV_.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _bwd_extra_kernel(Q, KE, VE, DO, LSE, DELTA, DKE, DVE, EPOS, EVALID, SKIP,
                      stride_qb, stride_qh, stride_qn, stride_keb, stride_keh, stride_ken, stride_veb, stride_veh,
                      stride_ven, stride_dob, stride_doh, stride_don, stride_evalid,
                      H, NQ, NK, NE, D, DV, Q_OFFSET, TILES_PER_PROGRAM, qk_scale, sm_scale, dropout_p, seed,
                      CAUSAL: tl.constexpr, HAS_EVALID: tl.constexpr, HAS_SKIP: tl.constexpr, DROPOUT: tl.constexpr,
                      PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                      BDV: tl.constexpr):
    """dK and dV of the extra keys, which every query may see: each program sums a run of
    TILES_PER_PROGRAM query tiles in registers and adds its share to float32 buffers once."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    cols = tile * BN + tl.arange(0, BN)
    col_ok = cols < NE
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    ke = tl.load(KE + b * stride_keb + h * stride_keh + cols.to(tl.int64)[:, None] * stride_ken + offs_d[None, :],
                 mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    ve = tl.load(VE + b * stride_veb + h * stride_veh + cols.to(tl.int64)[:, None] * stride_ven + offs_dv[None, :],
                 mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    evalid_ptr = EVALID + b * stride_evalid
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    lo = tl.program_id(2) * TILES_PER_PROGRAM * BM
    hi = tl.minimum(lo + TILES_PER_PROGRAM * BM, NQ)
    if CAUSAL:  # rows before the tile's first extra key's position see none of it
        first = tl.min(tl.load(EPOS + cols, mask=col_ok, other=2147483647))
        lo = tl.maximum(lo, ((first - Q_OFFSET) // BM) * BM)
    for start_m in range(lo, hi, BM):
        rows = start_m + tl.arange(0, BM)
        okT = tl.trans(_extra_mask(rows + Q_OFFSET, cols, rows < NQ, NE, EPOS, evalid_ptr, CAUSAL, HAS_EVALID))
        dk, dv = _bwd_dkv_tile(dk, dv, ke, ve, Q + b * stride_qb + h * stride_qh, DO + b * stride_dob + h * stride_doh,
                               stride_qn, stride_don, LSE + bh * NQ, DELTA + bh * NQ, SKIP, rows, NQ, NK + cols, okT,
                               offs_d, offs_dv, D, DV, qk_scale, seed, bh, NK + NE, dropout_p, HAS_SKIP, DROPOUT,
                               PRECISION)
    tl.atomic_add(DKE + bh * NE * D + cols.to(tl.int64)[:, None] * D + offs_d[None, :], dk * sm_scale,
                  mask=col_ok[:, None] & (offs_d[None, :] < D))
    tl.atomic_add(DVE + bh * NE * DV + cols.to(tl.int64)[:, None] * DV + offs_dv[None, :], dv,
                  mask=col_ok[:, None] & (offs_dv[None, :] < DV))


# ----------------------------------------------------------------------------- launchers

def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _strides4(t: Tensor) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ValueError("the kernels read rows with a unit stride on the last dim")
    return t.stride(0), t.stride(1), t.stride(2)


class _Prepared:
    """The kernels' view of a pattern: the int32 tables, the flags and the extra keys' visible ends."""

    def __init__(self, pattern: SparsePattern, query: Tensor, n_extra: int) -> None:
        device = query.device
        self.pattern = pattern
        self.tile = _tile(pattern)
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        self.kvalid = dummy if pattern.key_valid is None else _rows_unit_stride(pattern.key_valid)
        self.blocks = dummy if pattern.blocks is None else pattern.blocks.to(device=device, dtype=torch.int32)
        self.blocks_t = dummy if pattern.blocks_by_key is None else pattern.blocks_by_key.to(device=device,
                                                                                                 dtype=torch.int32)
        self.epos = dummy if pattern.extra_pos is None else pattern.extra_pos.to(device=device, dtype=torch.int32)
        self.evalid = dummy if pattern.extra_valid is None else _rows_unit_stride(pattern.extra_valid)
        self.has_eend = bool(n_extra and pattern.causal)
        self.eend = dummy
        n_q = query.shape[2]
        if self.has_eend:  # causal: a query tile visits only the extra keys placed at or before its last row
            last = torch.arange(self.tile, n_q + self.tile, self.tile, device=device).clamp(max=n_q) - 1
            self.eend = torch.searchsorted(self.epos, (last + pattern.query_offset).to(torch.int32), right=True)
            self.eend = self.eend.to(torch.int32)
        band = pattern.band
        self.band = (band.step, band.start, band.stop, band.dilation)
        self.flags = dict(CAUSAL=pattern.causal, HAS_KVALID=pattern.key_valid is not None,
                          HAS_LIST=pattern.blocks is not None, LIST_BLOCK=max(pattern.block_size, 1))
        self.n_list = 0 if pattern.blocks is None else pattern.blocks.shape[-1]
        self.n_list_t = 0 if pattern.blocks_by_key is None else pattern.blocks_by_key.shape[-1]
        self.list_strides = (0, 0) if pattern.blocks is None else self.blocks.stride()[:2]
        self.list_t_strides = (0, 0) if pattern.blocks_by_key is None else self.blocks_t.stride()[:2]
        self.kvalid_stride = 0 if pattern.key_valid is None else self.kvalid.stride(0)
        self.evalid_stride = 0 if pattern.extra_valid is None else self.evalid.stride(0)


def _rows_unit_stride(mask: Tensor) -> Tensor:
    """A [B, N] mask whose rows the kernels can read with a unit stride (a batch stride of 0 is fine)."""
    return mask if mask.stride(-1) == 1 else mask.contiguous()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    @launches_on_input_device
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, extra_key: Tensor | None,  # type: ignore[override]
                extra_value: Tensor | None, replace_index: Tensor | None, replace_value: Tensor | None,
                pattern: SparsePattern, scale: float, dropout_p: float, output_length: int) -> Tensor:
        b, h, n_q, d = query.shape
        n_k, dv = key.shape[2], value.shape[-1]
        n_e = 0 if extra_key is None else extra_key.shape[2]
        offset = pattern.query_offset
        prep = _Prepared(pattern, query, n_e)
        seed = int(torch.randint(0, 2**31 - 1, ()).item()) if dropout_p > 0 else 0  # CPU generator: no device sync
        covered = offset == 0 and output_length == n_q  # else rows outside the kernel's come from replace_value
        out = (torch.empty if covered else torch.zeros)(b, output_length, h, dv, dtype=query.dtype,
                                                        device=query.device)  # token-major
        o4 = out[:, offset:offset + n_q].transpose(1, 2)
        lse = torch.empty(b, h, n_q, dtype=torch.float32, device=query.device)
        ke = query if extra_key is None else extra_key
        ve = value if extra_value is None else extra_value
        tile = prep.tile
        launch(_fwd_kernel, (triton.cdiv(n_q, tile), b * h),
            query, key, value, ke, ve, o4, lse, prep.kvalid, prep.epos, prep.evalid, prep.eend, prep.blocks,
            *_strides4(query), *_strides4(key), *_strides4(value), *_strides4(ke), *_strides4(ve), *_strides4(o4),
            prep.kvalid_stride, prep.evalid_stride, *prep.list_strides,
            h, n_q, n_k, n_e, d, dv, offset, prep.n_list, *prep.band,
            scale * _LOG2E, dropout_p, seed,
            HAS_EXTRA=n_e > 0, HAS_EVALID=pattern.extra_valid is not None, HAS_EEND=prep.has_eend,
            DROPOUT=dropout_p > 0, PRECISION=_precision(query.dtype), BM=tile, BN=tile, BD=_pow2(d), BDV=_pow2(dv),
            **prep.flags)
        skip = None
        if replace_index is not None:
            out.index_copy_(1, replace_index, replace_value.transpose(1, 2).to(out.dtype))
            # the replaced rows inside the kernel's range pass no gradient to its inputs
            skip = torch.zeros(output_length, dtype=torch.bool, device=query.device).index_fill_(0, replace_index, True)
            skip = skip[offset:offset + n_q]
        ctx.save_for_backward(query, key, value, extra_key, extra_value, out, lse, replace_index, skip)
        ctx.prep, ctx.scale, ctx.dropout_p, ctx.seed = prep, scale, dropout_p, seed
        ctx.replace_dtype = None if replace_value is None else replace_value.dtype
        check_backward(_BlockSparseAttention, ctx, (query, key, value, extra_key, extra_value, out, lse, replace_index,
                                                    skip), (out,))
        return out

    @staticmethod
    @launches_on_input_device
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        query, key, value, extra_key, extra_value, out, lse, replace_index, skip = ctx.saved_tensors
        prep: _Prepared = ctx.prep
        pattern = prep.pattern
        b, h, n_q, d = query.shape
        n_k, dv = key.shape[2], value.shape[-1]
        n_e = 0 if extra_key is None else extra_key.shape[2]
        offset, tile = pattern.query_offset, prep.tile
        o4 = out[:, offset:offset + n_q].transpose(1, 2)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        do4 = grad_out[:, offset:offset + n_q].transpose(1, 2)
        has_skip = skip is not None
        skip_rows = skip if has_skip else lse
        delta = torch.empty_like(lse)
        launch(_delta_kernel, (triton.cdiv(n_q, tile), b * h), o4, do4, delta, skip_rows, *_strides4(o4),
               *_strides4(do4), h, n_q, dv, HAS_SKIP=has_skip, BM=tile, BDV=_pow2(dv))
        dq = torch.empty_like(query)
        dk = torch.empty_like(key)
        dvalue = torch.empty_like(value)
        ke = query if extra_key is None else extra_key
        ve = value if extra_value is None else extra_value
        common = dict(HAS_SKIP=has_skip, DROPOUT=ctx.dropout_p > 0, PRECISION=_precision(query.dtype), BM=tile,
                      BN=tile, BD=_pow2(d), BDV=_pow2(dv), **prep.flags)
        scales = (ctx.scale * _LOG2E, ctx.scale, ctx.dropout_p, ctx.seed)
        launch(_bwd_dq_kernel, (triton.cdiv(n_q, tile), b * h),
            query, key, value, ke, ve, do4, lse, delta, dq, prep.kvalid, prep.epos, prep.evalid, prep.eend,
            prep.blocks, skip_rows,
            *_strides4(query), *_strides4(key), *_strides4(value), *_strides4(ke), *_strides4(ve), *_strides4(do4),
            *_strides4(dq), prep.kvalid_stride, prep.evalid_stride, *prep.list_strides,
            h, n_q, n_k, n_e, d, dv, offset, prep.n_list, *prep.band, *scales,
            HAS_EXTRA=n_e > 0, HAS_EVALID=pattern.extra_valid is not None, HAS_EEND=prep.has_eend, **common)
        flags_t = dict(common, HAS_LIST=pattern.blocks_by_key is not None)
        launch(_bwd_dkv_kernel, (triton.cdiv(n_k, tile), b * h),
            query, key, value, do4, lse, delta, dk, dvalue, prep.kvalid, prep.blocks_t, skip_rows,
            *_strides4(query), *_strides4(key), *_strides4(value), *_strides4(do4), *_strides4(dk),
            *_strides4(dvalue), prep.kvalid_stride, *prep.list_t_strides,
            h, n_q, n_k, n_e, d, dv, offset, prep.n_list_t, *prep.band, *scales, **flags_t)
        grad_ke = grad_ve = None
        if n_e:
            dke = torch.zeros(b, h, n_e, d, dtype=torch.float32, device=query.device)
            dve = torch.zeros(b, h, n_e, dv, dtype=torch.float32, device=query.device)
            q_tiles = triton.cdiv(n_q, tile)
            launch(_bwd_extra_kernel, (triton.cdiv(n_e, tile), b * h, triton.cdiv(q_tiles, EXTRA_TILES_PER_PROGRAM)),
                query, extra_key, extra_value, do4, lse, delta, dke, dve, prep.epos, prep.evalid, skip_rows,
                *_strides4(query), *_strides4(extra_key), *_strides4(extra_value), *_strides4(do4),
                prep.evalid_stride, h, n_q, n_k, n_e, d, dv, offset, EXTRA_TILES_PER_PROGRAM, *scales,
                CAUSAL=pattern.causal, HAS_EVALID=pattern.extra_valid is not None, HAS_SKIP=has_skip,
                DROPOUT=ctx.dropout_p > 0, PRECISION=_precision(query.dtype), BM=tile, BN=tile, BD=_pow2(d),
                BDV=_pow2(dv))
            grad_ke, grad_ve = dke.to(extra_key.dtype), dve.to(extra_value.dtype)
        grad_replace = None
        if replace_index is not None:
            grad_replace = grad_out.index_select(1, replace_index).transpose(1, 2).to(ctx.replace_dtype)
        return dq, dk, dvalue, grad_ke, grad_ve, None, grad_replace, None, None, None, None


def blocksparse_attention(query: Tensor, key: Tensor, value: Tensor, pattern: SparsePattern, *,
                          extra_key: Tensor | None = None, extra_value: Tensor | None = None,
                          scale: float | None = None, dropout_p: float = 0.0,
                          replace_rows: tuple[Tensor, Tensor] | None = None, output_length: int | None = None) -> Tensor:
    """Attention of ``query`` [B, H, N_q, D] over the keys ``pattern`` lets each row see, among
    ``key``/``value`` [B, H, N_k, D / Dv] and the extra ``extra_key``/``extra_value`` [B, H, E, *]
    (all of one dtype: fp16, bf16 or float32). Rows that see no key are zeros.

    Returns [B, L, H, Dv], token-major (transpose(1, 2) for [B, H, L, Dv]), L = ``output_length``
    (default ``query_offset + N_q``): query row r is output row ``r + pattern.query_offset``. Output
    rows ``replace_rows[0]`` are ``replace_rows[1]`` ([B, H, R, Dv], computed elsewhere: global
    rows) instead, written into the same buffer (no copy of the output); rows neither computed nor
    replaced are zeros."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    length = pattern.query_offset + query.shape[2] if output_length is None else output_length
    index, values = (None, None) if replace_rows is None else replace_rows
    return _BlockSparseAttention.apply(query, key, value, extra_key, extra_value, index, values, pattern, scale,
                                       dropout_p, length)


def blocksparse_attention_reference(query: Tensor, key: Tensor, value: Tensor, pattern: SparsePattern, *,
                                    extra_key: Tensor | None = None, extra_value: Tensor | None = None,
                                    scale: float | None = None, keep: Tensor | None = None,
                                    dropout_p: float = 0.0) -> Tensor:
    """The kernels' computation written plainly: the pattern as an explicit mask, a dense softmax
    (rows that see nothing give zeros), ``keep`` ([B, H, N_q, N_k + E] bool) the dropout draws.
    Returns [B, H, N_q, Dv]. Tests only (N x N)."""
    b, h, n_q, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n_e = 0 if extra_key is None else extra_key.shape[2]
    keys = key if extra_key is None else torch.cat([key, extra_key], dim=2)
    values = value if extra_value is None else torch.cat([value, extra_value], dim=2)
    seen = pattern.dense_mask(b, h, n_q, key.shape[2], n_e)
    scores = (query @ keys.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if keep is not None:
        weights = weights * keep / (1.0 - dropout_p)
    return weights @ values
