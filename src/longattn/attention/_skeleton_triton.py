"""Triton kernels of skeleton attention's core (SKTformer Section 3.1, eq. 2, Algorithm 1).

One kernel computes, for a block of tokens of one sequence and every head, the row branch (the queries
against the s1 sampled keys: scores, masked softmax in float32, dropout, weighted sum of the s1 sampled
values), the column branch (the s2 sampled feature columns of V times the column weights) and the two
half LayerNorms over all heads' features, LN_1(V_1) / 2 + LN_2(V_2) / 2; its backward kernel recomputes
them and writes the gradients of the queries and of the sampled columns, with the gradients of the
sampled keys, values, column weights and LayerNorm parameters summed per program (the launcher adds the
programs' parts: deterministic, no atomics). Neither V_1, V_2 nor the scores ever reach memory.

The LayerNorm statistics are exact in float32: each head's block is centred on its own mean and the
blocks are merged with Chan's formula; the backward takes three passes over the heads (statistics, the
two LayerNorm sums, gradients), recomputing the small products instead of storing them. Products take
the queries' dtype with float32 accumulation (float32 queries: full float32, no TF32).

``core_reference`` is the plain PyTorch reference (head by head, the formulas as written); the tests
compare the kernels with it and with the batched PyTorch path ``longattn.attention.skeleton.gpu_core_torch``.
In Triton's interpreter (tests on a CPU) bfloat16 dot operands are converted to float32 first: the
interpreter's dot has no bfloat16 (numpy has none).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.attention._triton import check_backward, launch, launches_on_input_device

__all__ = ["skeleton_core", "core_reference"]

BLOCK_TOKENS = 32  # tokens per program (and per step of a backward program)
# 8 warps and no software pipelining of the loop over heads: compiled for sm_90, the forward then needs no
# spill and the backward, launched once per branch, hardly any (4 warps or pipelining spill heavily)
_LAUNCH = dict(num_warps=8, num_stages=1)
# the backward runs about this many programs in all (each over consecutive blocks of one sequence), so that
# the per-program parts of the sampled blocks' gradients stay few
BACKWARD_PROGRAMS = 512
_FLOAT32_MIN = tl.constexpr(-3.4028234663852886e38)  # torch.finfo(torch.float32).min: the row softmax's fill


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton's interpreter: its dot has no bfloat16
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _row_branch(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, b, h, t, N, H, S1, DH, q_sb, q_sn, keep_scale,
                MASK_SAMPLES: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                S1P: tl.constexpr, DHP: tl.constexpr):
    """Head h of the row branch for the tokens t: (q, k, v, valid, keep factor, softmax probabilities p,
    weights w after validity and dropout, output o = w P1 V [tokens, DHP] in float32)."""
    d = tl.arange(0, DHP)
    a = tl.arange(0, S1P)
    tokens, features, samples = t < N, d < DH, a < S1
    q = tl.load(q_ptr + b * q_sb + t[:, None].to(tl.int64) * q_sn + h * DH + d[None, :],
                mask=tokens[:, None] & features[None, :], other=0.0)
    offsets = ((b * H + h) * S1 + a[:, None]) * DH + d[None, :]
    k = tl.load(k_ptr + offsets, mask=samples[:, None] & features[None, :], other=0.0)
    v = tl.load(v_ptr + offsets, mask=samples[:, None] & features[None, :], other=0.0)
    scores = _dot(q, tl.trans(k), IEEE, UPCAST)  # [tokens, S1P], temperature folded into k
    valid = tl.load(valid_ptr + b * S1 + a, mask=samples, other=0.0)
    if MASK_SAMPLES:
        scores = tl.where(valid[None, :] > 0, scores, _FLOAT32_MIN)
    scores = tl.where(samples[None, :], scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    factor = tl.zeros([1, S1P], dtype=tl.float32) + 1.0
    if MASK_SAMPLES:
        factor = factor * valid[None, :]
    if DROPOUT:
        rows = b * N + t
        keep = tl.load(keep_ptr + (rows[:, None] * H + h) * S1 + a[None, :], mask=tokens[:, None] & samples[None, :],
                       other=0)
        factor = tl.where(keep != 0, factor * keep_scale, 0.0)
    w = p * factor
    o = _dot(w.to(v.dtype), v, IEEE, UPCAST)
    return q, k, v, factor, p, w, o


@triton.jit
def _column_branch(vc_ptr, wc_ptr, b, h, t, N, H, S2, DH, vc_sb, vc_sn, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   S2P: tl.constexpr, DHP: tl.constexpr):
    """Head h of the column branch: (sampled columns vc [tokens, S2P], column weights transposed [S2P, DHP],
    output o = vc W^T [tokens, DHP] in float32)."""
    d = tl.arange(0, DHP)
    c = tl.arange(0, S2P)
    tokens, features, samples = t < N, d < DH, c < S2
    vc = tl.load(vc_ptr + b * vc_sb + t[:, None].to(tl.int64) * vc_sn + h * S2 + c[None, :],
                 mask=tokens[:, None] & samples[None, :], other=0.0)
    wc = tl.load(wc_ptr + ((b * H + h) * DH + d[None, :]) * S2 + c[:, None], mask=samples[:, None] & features[None, :],
                 other=0.0)
    return vc, wc, _dot(vc, wc.to(vc.dtype), IEEE, UPCAST)


@triton.jit
def _merge(mean, m2, o, h, DH, DHP: tl.constexpr):
    """Chan's update of the per-token (mean, sum of squared deviations) over heads 0..h-1 with head h's block."""
    features = tl.arange(0, DHP) < DH
    head_mean = tl.sum(o, 1) / DH  # o is zero at padded feature columns
    deviation = tl.where(features[None, :], o - head_mean[:, None], 0.0)
    seen = h * DH * 1.0
    total = seen + DH
    delta = head_mean - mean
    return mean + delta * (DH / total), m2 + tl.sum(deviation * deviation, 1) + delta * delta * (seen * DH / total)


@triton.jit
def _statistics(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, vc_ptr, wc_ptr, b, t, N, H, S1, S2, DH, q_sb, q_sn, vc_sb,
                vc_sn, keep_scale, eps, ROW: tl.constexpr, COLUMN: tl.constexpr, MASK_SAMPLES: tl.constexpr,
                DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BT: tl.constexpr,
                S1P: tl.constexpr, S2P: tl.constexpr, DHP: tl.constexpr):
    """Per-token (mean, 1/std) of both branches' outputs over all heads' features (first pass over the heads)."""
    mean1 = tl.zeros([BT], dtype=tl.float32)
    m21 = tl.zeros([BT], dtype=tl.float32)
    mean2 = tl.zeros([BT], dtype=tl.float32)
    m22 = tl.zeros([BT], dtype=tl.float32)
    for h in range(H):
        h = tl.cast(h, tl.int64)  # 64-bit offsets (b, h and the tokens index everything: see _core_fwd_kernel)
        if ROW:
            _q, _k, _v, _f, _p, _w, o1 = _row_branch(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, b, h, t, N, H, S1, DH,
                                                     q_sb, q_sn, keep_scale, MASK_SAMPLES, DROPOUT, IEEE, UPCAST,
                                                     S1P, DHP)
            mean1, m21 = _merge(mean1, m21, o1, h, DH, DHP)
        if COLUMN:
            _vc, _wc, o2 = _column_branch(vc_ptr, wc_ptr, b, h, t, N, H, S2, DH, vc_sb, vc_sn, IEEE, UPCAST, S2P, DHP)
            mean2, m22 = _merge(mean2, m22, o2, h, DH, DHP)
    dim = H * DH
    return mean1, 1.0 / tl.sqrt(m21 / dim + eps), mean2, 1.0 / tl.sqrt(m22 / dim + eps)


@triton.jit
def _core_fwd_kernel(q_ptr, vc_ptr, k_ptr, v_ptr, wc_ptr, valid_ptr, keep_ptr, g1_ptr, b1_ptr, g2_ptr, b2_ptr, out_ptr,
                     N, H, S1, S2, DH, DIM, q_sb, q_sn, vc_sb, vc_sn, keep_scale, eps, ROW: tl.constexpr,
                     COLUMN: tl.constexpr, MASK_SAMPLES: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr, BT: tl.constexpr, S1P: tl.constexpr, S2P: tl.constexpr, DHP: tl.constexpr):
    # 64-bit offsets: every offset is built from the sequence b and the head h (b x N x H x Dh may pass 2^31)
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    t = pid * BT + tl.arange(0, BT)
    d = tl.arange(0, DHP)
    mean1, rstd1, mean2, rstd2 = _statistics(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, vc_ptr, wc_ptr, b, t, N, H, S1,
                                             S2, DH, q_sb, q_sn, vc_sb, vc_sn, keep_scale, eps, ROW, COLUMN,
                                             MASK_SAMPLES, DROPOUT, IEEE, UPCAST, BT, S1P, S2P, DHP)
    inside = (t < N)[:, None] & (d < DH)[None, :]
    rows = b * N + t
    for h in range(H):
        h = tl.cast(h, tl.int64)
        f = h * DH + d
        out = tl.zeros([BT, DHP], dtype=tl.float32)
        if ROW:
            _q, _k, _v, _f, _p, _w, o1 = _row_branch(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, b, h, t, N, H, S1, DH,
                                                     q_sb, q_sn, keep_scale, MASK_SAMPLES, DROPOUT, IEEE, UPCAST,
                                                     S1P, DHP)
            gamma = tl.load(g1_ptr + f, mask=d < DH, other=0.0)[None, :]
            out += (o1 - mean1[:, None]) * rstd1[:, None] * gamma + tl.load(b1_ptr + f, mask=d < DH, other=0.0)[None, :]
        if COLUMN:
            _vc, _wc, o2 = _column_branch(vc_ptr, wc_ptr, b, h, t, N, H, S2, DH, vc_sb, vc_sn, IEEE, UPCAST, S2P, DHP)
            gamma = tl.load(g2_ptr + f, mask=d < DH, other=0.0)[None, :]
            out += (o2 - mean2[:, None]) * rstd2[:, None] * gamma + tl.load(b2_ptr + f, mask=d < DH, other=0.0)[None, :]
        tl.store(out_ptr + rows[:, None] * DIM + f[None, :], out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _accumulate(ptr, value, mask):
    """Add to a part owned by this program (no other program writes it: no atomics needed). The same part is
    added to at every step of the program's loop, and the thread that stored an element at the previous step
    need not be the one that loads it now (the layouts of a sum and of a load differ): the barrier makes every
    thread's earlier stores visible before the load. (The dots between the steps synchronise the threads too,
    but only as a side effect of how they are compiled.)"""
    tl.debug_barrier()
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + value, mask=mask)


@triton.jit
def _add_to(ptr, value):
    """_accumulate for a whole (padded) block (the same barrier, for the same reason)."""
    tl.debug_barrier()
    tl.store(ptr, tl.load(ptr) + value)


@triton.jit
def _layer_norm_grad(o, mean, rstd, grad, gamma, sum_g, sum_gx, dim, inside):
    """(d o, xhat): LayerNorm backward with the per-token sums of gamma*grad and gamma*grad*xhat over all heads."""
    xhat = tl.where(inside, (o - mean[:, None]) * rstd[:, None], 0.0)
    scaled = grad * gamma
    do = rstd[:, None] * (scaled - sum_g[:, None] / dim - xhat * (sum_gx[:, None] / dim))
    return tl.where(inside, do, 0.0), xhat


@triton.jit
def _core_bwd_kernel(q_ptr, vc_ptr, k_ptr, v_ptr, wc_ptr, valid_ptr, keep_ptr, g1_ptr, g2_ptr, go_ptr, dq_ptr, dvc_ptr,
                     dk_ptr, dv_ptr, dwc_ptr, dnorm_ptr, N, H, S1, S2, DH, DIM, q_sb, q_sn, vc_sb, vc_sn, go_sb, go_sn,
                     keep_scale, eps, BLOCKS, ROW: tl.constexpr, COLUMN: tl.constexpr, MASK_SAMPLES: tl.constexpr,
                     DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BT: tl.constexpr,
                     S1P: tl.constexpr, S2P: tl.constexpr, DHP: tl.constexpr):
    # 64-bit offsets, as in _core_fwd_kernel (the program's first token pid x BLOCKS x BT included)
    pid, b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    programs = tl.num_programs(0)
    d = tl.arange(0, DHP)
    a = tl.arange(0, S1P)
    c = tl.arange(0, S2P)
    features = d < DH
    part = b * programs + pid  # this program's parts of the summed gradients
    for step in range(BLOCKS):
        t = (pid * BLOCKS + step) * BT + tl.arange(0, BT)
        tokens = t < N
        inside = tokens[:, None] & features[None, :]
        rows = b * N + t
        mean1, rstd1, mean2, rstd2 = _statistics(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, vc_ptr, wc_ptr, b, t, N, H,
                                                 S1, S2, DH, q_sb, q_sn, vc_sb, vc_sn, keep_scale, eps, ROW, COLUMN,
                                                 MASK_SAMPLES, DROPOUT, IEEE, UPCAST, BT, S1P, S2P, DHP)
        # second pass: per token, sum over all features of gamma*grad and gamma*grad*xhat, per branch
        sum_g1 = tl.zeros([BT], dtype=tl.float32)
        sum_gx1 = tl.zeros([BT], dtype=tl.float32)
        sum_g2 = tl.zeros([BT], dtype=tl.float32)
        sum_gx2 = tl.zeros([BT], dtype=tl.float32)
        for h in range(H):
            h = tl.cast(h, tl.int64)
            f = h * DH + d
            grad = tl.load(go_ptr + b * go_sb + t[:, None] * go_sn + f[None, :], mask=inside, other=0.0).to(tl.float32)
            if ROW:
                _q, _k, _v, _f, _p, _w, o1 = _row_branch(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, b, h, t, N, H, S1,
                                                         DH, q_sb, q_sn, keep_scale, MASK_SAMPLES, DROPOUT, IEEE,
                                                         UPCAST, S1P, DHP)
                scaled = grad * tl.load(g1_ptr + f, mask=features, other=0.0)[None, :]
                xhat = tl.where(inside, (o1 - mean1[:, None]) * rstd1[:, None], 0.0)
                sum_g1 += tl.sum(scaled, 1)
                sum_gx1 += tl.sum(scaled * xhat, 1)
            if COLUMN:
                _vc, _wc, o2 = _column_branch(vc_ptr, wc_ptr, b, h, t, N, H, S2, DH, vc_sb, vc_sn, IEEE, UPCAST, S2P,
                                              DHP)
                scaled = grad * tl.load(g2_ptr + f, mask=features, other=0.0)[None, :]
                xhat = tl.where(inside, (o2 - mean2[:, None]) * rstd2[:, None], 0.0)
                sum_g2 += tl.sum(scaled, 1)
                sum_gx2 += tl.sum(scaled * xhat, 1)
        # third pass: the gradients, head by head
        for h in range(H):
            h = tl.cast(h, tl.int64)
            f = h * DH + d
            grad = tl.load(go_ptr + b * go_sb + t[:, None] * go_sn + f[None, :], mask=inside, other=0.0).to(tl.float32)
            norm_part = dnorm_ptr + part * 4 * DIM + f
            if ROW:
                q, k, v, factor, p, w, o1 = _row_branch(q_ptr, k_ptr, v_ptr, valid_ptr, keep_ptr, b, h, t, N, H, S1, DH,
                                                        q_sb, q_sn, keep_scale, MASK_SAMPLES, DROPOUT, IEEE, UPCAST,
                                                        S1P, DHP)
                gamma = tl.load(g1_ptr + f, mask=features, other=0.0)[None, :]
                do1, xhat = _layer_norm_grad(o1, mean1, rstd1, grad, gamma, sum_g1, sum_gx1, DIM, inside)
                _accumulate(norm_part, tl.sum(grad * xhat, 0), features)  # LN_1 weight / 2
                _accumulate(norm_part + DIM, tl.sum(grad, 0), features)  # LN_1 bias / 2
                block = ((part * H + h) * S1P + a[:, None]) * DHP + d[None, :]
                _add_to(dv_ptr + block, _dot(tl.trans(w).to(v.dtype), do1.to(v.dtype), IEEE, UPCAST))
                # through dropout and validity, then the softmax; a filled (invalid) score has p = 0 unless every
                # sample is invalid, and then every factor is 0: its gradient is 0 either way
                dp = _dot(do1.to(v.dtype), tl.trans(v), IEEE, UPCAST) * factor
                ds = p * (dp - tl.sum(p * dp, 1)[:, None])
                dq = _dot(ds.to(k.dtype), k, IEEE, UPCAST)
                tl.store(dq_ptr + rows[:, None] * DIM + f[None, :], dq.to(dq_ptr.dtype.element_ty), mask=inside)
                _add_to(dk_ptr + block, _dot(tl.trans(ds).to(q.dtype), q, IEEE, UPCAST))
            if COLUMN:
                vc, wc, o2 = _column_branch(vc_ptr, wc_ptr, b, h, t, N, H, S2, DH, vc_sb, vc_sn, IEEE, UPCAST, S2P, DHP)
                gamma = tl.load(g2_ptr + f, mask=features, other=0.0)[None, :]
                do2, xhat = _layer_norm_grad(o2, mean2, rstd2, grad, gamma, sum_g2, sum_gx2, DIM, inside)
                _accumulate(norm_part + 2 * DIM, tl.sum(grad * xhat, 0), features)  # LN_2 weight / 2
                _accumulate(norm_part + 3 * DIM, tl.sum(grad, 0), features)  # LN_2 bias / 2
                dvc = _dot(do2.to(vc.dtype), tl.trans(wc.to(vc.dtype)), IEEE, UPCAST)  # [tokens, S2P]
                tl.store(dvc_ptr + rows[:, None] * H * S2 + h * S2 + c[None, :], dvc.to(dvc_ptr.dtype.element_ty),
                         mask=tokens[:, None] & (c < S2)[None, :])
                block = ((part * H + h) * DHP + d[:, None]) * S2P + c[None, :]
                _add_to(dwc_ptr + block, _dot(tl.trans(do2).to(vc.dtype), vc, IEEE, UPCAST))


def _launch_options(query: Tensor) -> dict:
    interpreted = query.device.type == "cpu"
    return dict(IEEE=query.dtype == torch.float32, UPCAST=interpreted and query.dtype == torch.bfloat16)


def _padded(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every dimension >= 16


def _rows(t: Tensor | None) -> Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


class _SkeletonCore(torch.autograd.Function):
    @staticmethod
    @launches_on_input_device
    def forward(ctx, query, column_values, row_keys, row_values, column_weights, g1, b1, g2, b2, row_valid, row_keep,
                keep_scale, eps, mask_padded_samples):  # type: ignore[override]
        query, column_values = _rows(query), _rows(column_values)
        batch, length, dim = query.shape
        rows, columns = row_keys is not None, column_weights is not None
        heads = row_keys.shape[1] if rows else column_weights.shape[1]
        head_dim = dim // heads
        s1 = row_keys.shape[2] if rows else 1
        s2 = column_weights.shape[-1] if columns else 1
        row_keys = row_keys.contiguous() if rows else query
        row_values = row_values.contiguous() if rows else query
        column_weights = column_weights.contiguous() if columns else g2
        column_values = column_values if columns else query
        valid = row_valid.to(torch.float32).contiguous() if rows else g1
        keep = row_keep.contiguous().view(torch.uint8) if row_keep is not None else valid
        tensors = (query, column_values, row_keys, row_values, column_weights, valid, keep)
        shape = dict(N=length, H=heads, S1=s1, S2=s2, DH=head_dim, DIM=dim, q_sb=query.stride(0), q_sn=query.stride(1),
                     vc_sb=column_values.stride(0), vc_sn=column_values.stride(1))
        flags = dict(ROW=rows, COLUMN=columns, MASK_SAMPLES=mask_padded_samples, DROPOUT=row_keep is not None,
                     BT=BLOCK_TOKENS, S1P=_padded(s1), S2P=_padded(s2), DHP=_padded(head_dim), **_launch_options(query))
        out = torch.empty(batch, length, dim, dtype=query.dtype, device=query.device)
        launch(_core_fwd_kernel, (triton.cdiv(length, BLOCK_TOKENS), batch),
            *tensors, g1, b1, g2, b2, out, keep_scale=keep_scale, eps=eps, **shape, **flags, **_LAUNCH)
        ctx.save_for_backward(*tensors, g1, g2)
        ctx.launch = (shape, flags, keep_scale, eps)
        check_backward(_SkeletonCore, ctx, (*tensors, g1, g2), (out,))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @launches_on_input_device
    def backward(ctx, grad):  # type: ignore[override]
        query, column_values, row_keys, row_values, column_weights, valid, keep, g1, g2 = ctx.saved_tensors
        shape, flags, keep_scale, eps = ctx.launch
        grad = _rows(grad)
        batch, length, dim = query.shape
        heads = shape["H"]
        blocks = triton.cdiv(length, BLOCK_TOKENS)
        per_program = max(1, triton.cdiv(batch * blocks, BACKWARD_PROGRAMS))
        programs = triton.cdiv(blocks, per_program)
        parts = batch * programs
        s1p, s2p, dhp = flags["S1P"], flags["S2P"], flags["DHP"]
        f32 = dict(dtype=torch.float32, device=query.device)
        grad_query = torch.empty(batch, length, dim, dtype=query.dtype, device=query.device) if flags["ROW"] else g1
        grad_columns = (torch.empty(column_values.shape, dtype=column_values.dtype, device=query.device)
                        if flags["COLUMN"] else g1)
        grad_keys = torch.zeros(parts, heads, s1p, dhp, **f32) if flags["ROW"] else g1
        grad_values = torch.zeros(parts, heads, s1p, dhp, **f32) if flags["ROW"] else g1
        grad_weights = torch.zeros(parts, heads, dhp, s2p, **f32) if flags["COLUMN"] else g1
        grad_norms = torch.zeros(parts, 4, dim, **f32)
        # one launch per branch (their LayerNorms are independent: each needs only its own statistics), which
        # halves the state a program keeps
        for branch in [name for name in ("ROW", "COLUMN") if flags[name]]:
            launch(_core_bwd_kernel, (programs, batch),
                query, column_values, row_keys, row_values, column_weights, valid, keep, g1, g2, grad, grad_query,
                grad_columns, grad_keys, grad_values, grad_weights, grad_norms, go_sb=grad.stride(0),
                go_sn=grad.stride(1), keep_scale=keep_scale, eps=eps, BLOCKS=per_program,
                **shape, **dict(flags, ROW=branch == "ROW", COLUMN=branch == "COLUMN"), **_LAUNCH)
        s1, s2, head_dim = shape["S1"], shape["S2"], shape["DH"]

        def summed(parts_grad: Tensor, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
            """The programs' parts summed per sequence, cut to the real block size."""
            total = parts_grad.view(batch, programs, *parts_grad.shape[1:]).sum(1)
            return total[..., :rows, :cols].to(dtype)

        grads = [None] * 14
        norms = grad_norms.sum(0)
        if flags["ROW"]:
            grads[0] = grad_query
            grads[2] = summed(grad_keys, s1, head_dim, row_keys.dtype)
            grads[3] = summed(grad_values, s1, head_dim, row_values.dtype)
            grads[5], grads[6] = norms[0], norms[1]
        if flags["COLUMN"]:
            grads[1] = grad_columns
            grads[4] = summed(grad_weights, head_dim, s2, column_weights.dtype)
            grads[7], grads[8] = norms[2], norms[3]
        return tuple(grads)


def skeleton_core(query: Tensor, column_values: Tensor | None, row_keys: Tensor | None, row_values: Tensor | None,
                  column_weights: Tensor | None, norms: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
                  row_valid: Tensor | None, row_keep: Tensor | None, keep_scale: float, eps: float,
                  mask_padded_samples: bool) -> Tensor:
    """The kernels behind ``longattn.attention.skeleton.skeleton_core`` (same arguments)."""
    (g1, b1), (g2, b2) = ((w.float().contiguous(), bias.float().contiguous()) for w, bias in norms)
    return _SkeletonCore.apply(query, column_values, row_keys, row_values, column_weights, g1, b1, g2, b2, row_valid,
                               row_keep, keep_scale, eps, mask_padded_samples)


def core_reference(query: Tensor, column_values: Tensor | None, row_keys: Tensor | None, row_values: Tensor | None,
                   column_weights: Tensor | None, norms: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
                   row_valid: Tensor | None, row_keep: Tensor | None, keep_scale: float, eps: float,
                   mask_padded_samples: bool) -> Tensor:
    """``skeleton_core`` written out head by head in the inputs' dtype (tests; run it in float64)."""
    batch, length, dim = query.shape
    out = torch.zeros_like(query)

    def half_layer_norm(x: Tensor, norm: tuple[Tensor, Tensor]) -> Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).square().mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * norm[0].to(x.dtype) + norm[1].to(x.dtype)

    if row_keys is not None:
        heads, s1, head_dim = row_keys.shape[1:]
        q = query.view(batch, length, heads, head_dim)
        scores = torch.einsum("bnhd,bhad->bnha", q, row_keys)
        valid = row_valid[:, None, None, :]
        if mask_padded_samples:  # softmax over the valid samples; none valid: zero weights
            scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
            weights = torch.softmax(scores, -1) * valid.to(scores.dtype)
        else:
            weights = torch.softmax(scores, -1)
        if row_keep is not None:
            weights = weights * row_keep.to(query.dtype) * keep_scale
        out = out + half_layer_norm(torch.einsum("bnha,bhad->bnhd", weights, row_values).reshape(batch, length, dim),
                                    norms[0])
    if column_weights is not None:
        heads, head_dim, s2 = column_weights.shape[1:]
        sampled = column_values.view(batch, length, heads, s2)
        mixed = torch.einsum("bnhc,bhdc->bnhd", sampled, column_weights.to(query.dtype)).reshape(batch, length, dim)
        out = out + half_layer_norm(mixed, norms[1])
    return out

