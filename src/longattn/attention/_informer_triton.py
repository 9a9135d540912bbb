"""Informer's query sparsity measure (eq. 4, on sampled keys) as a Triton kernel.

Every query i is scored against its own U sampled keys: M_i = max_u q_i . k_{s_iu} - sum_u q_i . k_{s_iu} / m.
Formed in PyTorch the sampled keys are gathered into a [B, N, U, H, Dh] tensor, U times the keys
(U = 5 ceil(ln N) = 60 at 64k tokens: 4 GB in bfloat16 at 64k tokens and dim 512). ``_sparsity_measure``
gathers each query's sampled keys into registers and keeps only the running maximum and sum.
The measure only ranks queries (no gradient), so there is no backward pass; the 1/sqrt(d) factor,
which does not change the ranking, is left out as in the PyTorch path.
:func:`sparsity_measure_reference` is the same computation in plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.attention._triton import launch, launches_on_input_device

__all__ = ["sparsity_measure", "sparsity_measure_reference"]


def sparsity_measure_reference(query: Tensor, key: Tensor, key_samples: Tensor, sample_counts: Tensor,
                               m: Tensor) -> Tensor:
    """M [B, H, N] with the sampled keys gathered ([B, H, N, U, Dh]); sequence b uses its first
    ``sample_counts[b]`` samples; float32 (float64 for float64)."""
    b, h, n, d = query.shape
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    index = key_samples[:, None, :, :, None].expand(b, h, n, key_samples.shape[-1], d)
    sampled = key.gather(2, index.reshape(b, h, -1, d)).view(b, h, n, -1, d)
    scores = (query[:, :, :, None, :].to(acc) * sampled.to(acc)).sum(-1)  # [B, H, N, U]
    valid = (torch.arange(key_samples.shape[-1], device=query.device) < sample_counts[:, None])[:, None, None, :]
    top = scores.masked_fill(~valid, float("-inf")).amax(-1)
    total = scores.masked_fill(~valid, 0.0).sum(-1)
    return top - total / m.clamp(min=1)[:, None, None].to(acc)


@triton.jit
def _sparsity_measure(q_ptr, k_ptr, samples_ptr, counts_ptr, real_ptr, out_ptr, N, H, P, U,
                      BN: tl.constexpr, BP: tl.constexpr, ACC: tl.constexpr):
    """M of queries [BN] of one (batch, head): their sampled keys gathered row by row, a running max and sum."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    offs_n = i_n * BN + tl.arange(0, BN)
    offs_p = tl.arange(0, BP)
    mask_n, mask_p = offs_n < N, offs_p < P
    tile = mask_n[:, None] & mask_p[None, :]
    q = tl.load(q_ptr + (i_bh * N + offs_n)[:, None] * P + offs_p[None, :], mask=tile, other=0.0).to(ACC)
    count = tl.load(counts_ptr + i_b)
    real = tl.load(real_ptr + i_b).to(ACC)
    top = tl.full([BN], float("-inf"), dtype=ACC)
    total = tl.zeros([BN], dtype=ACC)
    for u in range(0, count):
        rows = tl.load(samples_ptr + (i_b * N + offs_n) * U + u, mask=mask_n, other=0)
        k = tl.load(k_ptr + (i_bh * N + rows)[:, None] * P + offs_p[None, :], mask=tile, other=0.0).to(ACC)
        score = tl.sum(q * k, 1)
        top = tl.maximum(top, score)
        total += score
    tl.store(out_ptr + i_bh * N + offs_n, top - total / tl.maximum(real, 1.0), mask=mask_n)


@launches_on_input_device
def sparsity_measure(query: Tensor, key: Tensor, key_samples: Tensor, sample_counts: Tensor, m: Tensor) -> Tensor:
    """:func:`sparsity_measure_reference` by the kernel (inputs float16, bfloat16, float32, float64 in the
    interpreter; the result in float32, float64 for float64)."""
    b, h, n, d = query.shape
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = query.new_empty(b, h, n, dtype=acc)
    block_n = 64
    launch(_sparsity_measure, (triton.cdiv(n, block_n), b * h),
        query.contiguous(), key.contiguous(), key_samples.contiguous(), sample_counts.contiguous(), m.contiguous(),
        out, n, h, d, key_samples.shape[-1], BN=block_n, BP=triton.next_power_of_2(d),
        ACC=tl.float64 if acc == torch.float64 else tl.float32)
    return out
