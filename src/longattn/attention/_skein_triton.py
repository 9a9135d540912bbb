"""Skeinformer's pilot statistics (Algorithm 1, lines 3-4) as Triton kernels.

Column importance sampling (eq. 5) needs, for every key column i, the sum over the d pilot rows of
the squared pilot attention b_{j_k i}^2, where B_J = softmax(Q_J K^T * scale) over the real keys.
Formed in PyTorch that is a [B, H, d, N] tensor (d = 256: 256 numbers per token and head, 512 MB
in float32 at 64k tokens and 8 heads) for a [B, H, N] result. Two kernels keep B_J in registers:

* ``_pilot_log_sums``: for a block of pilot rows, the row log-normaliser
  lse_k = log sum_i exp(s_ki) over the real keys, with an online maximum (flash attention's forward
  pass without the values);
* ``_pilot_column_squares``: for a block of key columns, sum_k [slot k used] exp(2 (s_ki - lse_k)).

No gradient flows through the sampling probabilities, so there is no backward pass.
:func:`pilot_square_sums_reference` is the same computation in plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.attention._triton import launch, launches_on_input_device

__all__ = ["pilot_square_sums", "pilot_square_sums_reference"]


def pilot_square_sums_reference(query: Tensor, key: Tensor, real: Tensor, pilot_indices: Tensor, used: Tensor,
                                scale: float) -> Tensor:
    """sum_k used_k b_{j_k i}^2, [B, H, N] in float32 (float64 stays float64): B_J materialised, [B, H, D, N].
    ``used`` bool [B, 1, D] (or [B, H, D]): the slots that hold a draw; zero at padded columns."""
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    pilot_rows = query.gather(2, pilot_indices[..., None].expand(-1, -1, -1, query.shape[-1]))
    scores = (pilot_rows @ key.transpose(-1, -2)).to(acc) * scale
    scores = scores.masked_fill(~real[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a sequence without real keys: zeros
    return (weights.square() * used[..., None].to(acc)).sum(2)


@triton.jit
def _pilot_log_sums(q_ptr, k_ptr, real_ptr, pilot_ptr, lse_ptr, scale, N, D, H, P,
                    BD: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """lse of pilot rows [BD] of one (batch, head) over its real keys."""
    i_d, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    offs_d = i_d * BD + tl.arange(0, BD)
    offs_p = tl.arange(0, BP)
    mask_d, mask_p = offs_d < D, offs_p < P
    rows = tl.load(pilot_ptr + i_bh * D + offs_d, mask=mask_d, other=0)
    q = tl.load(q_ptr + (i_bh * N + rows)[:, None] * P + offs_p[None, :], mask=mask_d[:, None] & mask_p[None, :],
                other=0.0)
    row_max = tl.full([BD], -1.0e30, dtype=ACC)
    row_sum = tl.zeros([BD], dtype=ACC)
    for start in range(0, N, BN):
        offs_n = start + tl.arange(0, BN)
        mask_n = offs_n < N
        k = tl.load(k_ptr + (i_bh * N + offs_n)[:, None] * P + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :],
                    other=0.0)
        real = tl.load(real_ptr + i_b * N + offs_n, mask=mask_n, other=0) != 0
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(ACC) * scale
        scores = tl.where(real[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(scores - new_max[:, None]), 1)
        row_max = new_max
    # a sequence without real keys: row_sum = 0, and lse stays about -1e30 (its columns are all masked below)
    tl.store(lse_ptr + i_bh * D + offs_d, row_max + tl.log(tl.maximum(row_sum, 1.0e-30)), mask=mask_d)


@triton.jit
def _pilot_column_squares(q_ptr, k_ptr, real_ptr, pilot_ptr, used_ptr, lse_ptr, out_ptr, scale, N, D, H, P,
                          BD: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """sum over the used pilot slots k of exp(2 (s_ki - lse_k)) for key columns [BN] of one (batch, head)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    offs_n = i_n * BN + tl.arange(0, BN)
    offs_p = tl.arange(0, BP)
    mask_n, mask_p = offs_n < N, offs_p < P
    k = tl.load(k_ptr + (i_bh * N + offs_n)[:, None] * P + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :],
                other=0.0)
    real = tl.load(real_ptr + i_b * N + offs_n, mask=mask_n, other=0) != 0
    squares = tl.zeros([BN], dtype=ACC)
    for start in range(0, D, BD):
        offs_d = start + tl.arange(0, BD)
        mask_d = offs_d < D
        rows = tl.load(pilot_ptr + i_bh * D + offs_d, mask=mask_d, other=0)
        used = tl.load(used_ptr + i_b * D + offs_d, mask=mask_d, other=0) != 0
        lse = tl.load(lse_ptr + i_bh * D + offs_d, mask=mask_d, other=0.0)
        q = tl.load(q_ptr + (i_bh * N + rows)[:, None] * P + offs_p[None, :], mask=mask_d[:, None] & mask_p[None, :],
                    other=0.0)
        scores = tl.dot(k, tl.trans(q), input_precision=PRECISION).to(ACC) * scale  # [BN, BD]
        keep = real[:, None] & used[None, :]
        weights = tl.exp(tl.where(keep, scores - lse[None, :], float("-inf")))
        squares += tl.sum(weights * weights, 1)
    tl.store(out_ptr + i_bh * N + offs_n, squares, mask=mask_n)


@launches_on_input_device
def pilot_square_sums(query: Tensor, key: Tensor, real: Tensor, pilot_indices: Tensor, used: Tensor,
                      scale: float) -> Tensor:
    """:func:`pilot_square_sums_reference` by the kernels (inputs float16, bfloat16 or float32, and float64 in
    the interpreter; the result in float32, float64 for float64)."""
    b, h, n, p = query.shape
    slots = pilot_indices.shape[-1]
    q, k = query.contiguous(), key.contiguous()
    real_ = real.to(torch.int8).contiguous()
    pilot = pilot_indices.contiguous()
    used_ = used.expand(b, 1, slots).to(torch.int8).contiguous()
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_empty(b, h, slots, dtype=acc)
    out = q.new_empty(b, h, n, dtype=acc)
    block_p = max(16, triton.next_power_of_2(p))
    precision = None if q.dtype in (torch.float16, torch.bfloat16) else "ieee"
    acc_tl = tl.float64 if acc == torch.float64 else tl.float32
    block_d, block_n = 32, 64
    launch(_pilot_log_sums, (triton.cdiv(slots, block_d), b * h),
        q, k, real_, pilot, lse, scale, n, slots, h, p, BD=block_d, BN=block_n, BP=block_p, ACC=acc_tl, PRECISION=precision)
    launch(_pilot_column_squares, (triton.cdiv(n, block_n), b * h),
        q, k, real_, pilot, used_, lse, out, scale, n, slots, h, p, BD=block_d, BN=block_n, BP=block_p,
        ACC=acc_tl, PRECISION=precision)
    return out
