"""Nystromformer (Xiong et al., AAAI 2021): Nystrom approximation of softmax attention.

With m landmarks Q~, K~ = segment means of Q and K (Section 3.3, eq. 13-14 ``segment-means``)::

    S_hat V = softmax(Q K~^T / sqrt(d)) (softmax(Q~ K~^T / sqrt(d)))^+ softmax(Q~ K^T / sqrt(d)) V   (eq. 15)

The pseudo-inverse ^+ is the iterative Moore-Penrose approximation (eq. 16)::

    Z_0 = A^T / (||A||_1 ||A||_inf),   Z_{j+1} = 1/4 Z_j (13 I - A Z_j (15 I - A Z_j (7 I - A Z_j)))

run for ``pinv_iterations`` (6) steps, and the output adds a depth-wise convolution of V along the
sequence (the "skip connection of V", Section 4, kernel 33), switchable with ``conv_kernel=None``.

Any length: the sequence is padded at the end to a multiple of m internally; a sequence of n <= m
tokens uses n landmarks (one per token, the same output: the others would be empty). With padding, the
segments are taken over each sequence's real tokens (L of them: segments of ceil(L / m) real tokens,
wherever the padding sits), so a sequence has the same landmarks alone or padded to any length; a
segment with no real token is no landmark at all (its row and column of the m x m kernel are replaced by those of the identity, which keeps the
pseudo-inverse block-diagonal, so the real landmarks are unaffected). Padded keys are excluded from
every softmax and zeroed before the convolution.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    autocast_disabled,
    check_qkv,
    compute_dtype,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.chunked import Chunk, chunked_sequence_op


def iterative_pinv(a: Tensor, iterations: int) -> Tensor:
    """Eq. 16: Newton-Schulz-type iteration for the Moore-Penrose inverse of each [m, m] matrix in ``a``.

    Z_0 is normalised per matrix by ||A||_1 ||A||_inf (max column sum times max row sum), as in the paper.
    """
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    abs_a = a.abs()
    norm_1 = abs_a.sum(dim=-2).amax(dim=-1)[..., None, None]
    norm_inf = abs_a.sum(dim=-1).amax(dim=-1)[..., None, None]
    z = a.transpose(-1, -2) / (norm_1 * norm_inf)
    # Under autograd each step is recomputed in its own backward: only the Z_j are kept, not the
    # half dozen m x m products of every step.
    remember_steps_only = torch.is_grad_enabled() and (a.requires_grad or z.requires_grad)
    for _ in range(iterations):
        z = checkpoint(_pinv_step, a, z, eye, use_reentrant=False) if remember_steps_only else _pinv_step(a, z, eye)
    return z


def _pinv_step(a: Tensor, z: Tensor, eye: Tensor) -> Tensor:
    """One step of eq. 16."""
    az = a @ z
    return 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))


# Output positions per block of the value convolution's banded (Toeplitz) products
CONV_BLOCK = 32


def depthwise_value_conv(value: Tensor, weight: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Depth-wise conv of V along the sequence, one [kernel] filter per head: weight [H, 1, kernel, 1]
    (the layout of a grouped Conv2d(H, H, (kernel, 1), groups=H)), zero-padded by kernel // 2 on each side
    (odd kernels: the output has V's length); V is read as zero at the padded positions of ``attention_mask``
    (bool [B, N], True = real).

    Each head's filter is the same for all its (batch, feature) rows, so the convolution of a block of
    CONV_BLOCK outputs is one product of those rows' input windows (CONV_BLOCK + kernel - 1 positions) with a
    banded [CONV_BLOCK + kernel - 1, CONV_BLOCK] Toeplitz matrix of the filter: one batched product over the
    heads, ~3x less CPU forward + backward than the grouped convolution (one channel per (head, feature)) at
    the forecasters' sizes. The same sums, in another order (float rounding)."""
    b, h, n, d = value.shape
    kernel = weight.shape[-2]
    half = kernel // 2
    if attention_mask is not None:
        value = value.masked_fill(~attention_mask[:, None, :, None], 0.0)
    blocks = -(-n // CONV_BLOCK)
    span = CONV_BLOCK + kernel - 1
    rows = value.permute(1, 0, 3, 2).reshape(h, b * d, n)  # per head, one row per (batch, feature)
    padded = F.pad(rows, (half, kernel - 1 - half + blocks * CONV_BLOCK - n))
    windows = padded.unfold(-1, span, CONV_BLOCK).reshape(h, b * d * blocks, span)
    # toeplitz[h, i, o] = filter_h[i - o] for 0 <= i - o < kernel, else 0 (index kernel: the appended zero)
    lag = torch.arange(span, device=value.device)[:, None] - torch.arange(CONV_BLOCK, device=value.device)
    lag = torch.where((lag >= 0) & (lag < kernel), lag, kernel)
    toeplitz = F.pad(weight[:, 0, :, 0].to(value.dtype), (0, 1))[:, lag]
    out = torch.bmm(windows, toeplitz).view(h, b, d, blocks * CONV_BLOCK)[..., :n]
    return out.permute(1, 0, 3, 2)


def _masked_softmax(scores: Tensor, allowed: Tensor | None) -> Tensor:
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    # A finite fill keeps a row with nothing allowed finite (uniform) instead of NaN; such rows are
    # either replaced (invalid landmarks) or belong to a fully padded sequence (zeroed later).
    return torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)


def _real_segment_sums(query: Tensor, key: Tensor, real: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Segment sums of eq. 13-14 over each sequence's real tokens: with L real tokens, the token of rank r
    among them falls in segment r // ceil(L / m), wherever the padding sits, so a sequence gets the same
    landmarks alone or padded to any length. Returns q and k sums [B, H, m, Dh] and counts [B, 1, m, 1]."""
    b, h, n, d = query.shape
    rank = real.long().cumsum(-1) - 1  # [B, N]
    segment = (real.sum(-1, keepdim=True) + m - 1).div(m, rounding_mode="floor").clamp(min=1)
    index = torch.where(real, rank.div(segment, rounding_mode="floor"), m)  # padding into a spare slot m
    spread = index[:, None, :, None].expand(b, h, n, d)
    q_sum = query.new_zeros(b, h, m + 1, d).scatter_add(2, spread, query)[:, :, :m]
    k_sum = key.new_zeros(b, h, m + 1, d).scatter_add(2, spread, key)[:, :, :m]
    counts = torch.zeros(b, m + 1, dtype=torch.long, device=real.device).scatter_add(1, index, real.long())
    return q_sum, k_sum, counts[:, None, :m, None]


# Query tokens per chunk of the output (kernel_1 times the mixed landmark values, plus the
# convolution of V): its SDPA and convolution buffers exist for one chunk at a time.
OUTPUT_CHUNK_TOKENS = 2048


def _output_rows(query: Tensor, value: Tensor, k_land: Tensor, mixed: Tensor, landmark_mask: Tensor | None,
                 conv_weight: Tensor | None, attention_mask: Tensor | None, scale: float) -> Tensor:
    """softmax(Q K~^T scale) mixed (eq. 15's left factor), plus the convolution of V. The CPU path goes
    chunk by chunk along the queries (nothing of size N is kept for backward but the inputs); the GPU path
    in one SDPA call and one batched convolution over the whole sequence."""
    if uses_gpu_path(query):
        out = F.scaled_dot_product_attention(query, k_land, mixed, attn_mask=landmark_mask, scale=scale)
        return out if conv_weight is None else out + depthwise_value_conv(value, conv_weight, attention_mask)
    n = query.shape[2]
    half = 0 if conv_weight is None else conv_weight.shape[-2] // 2
    chunks = [Chunk(rows=slice(start, min(n, start + OUTPUT_CHUNK_TOKENS)),
                    keys=slice(max(0, start - half), min(n, start + OUTPUT_CHUNK_TOKENS + half)),
                    info=(landmark_mask, attention_mask, scale))
              for start in range(0, n, OUTPUT_CHUNK_TOKENS)]
    params = [k_land, mixed] + ([] if conv_weight is None else [conv_weight])
    sources, reads = ([query], lambda c: [c.rows]) if conv_weight is None else ([query, value], lambda c: [c.rows, c.keys])
    return chunked_sequence_op(_output_chunk, chunks, sources, reads, params)


def _output_chunk(chunk: Chunk, leaves: list[Tensor], params: Sequence[Tensor]) -> Tensor:
    landmark_mask, attention_mask, scale = chunk.info
    out = F.scaled_dot_product_attention(leaves[0], params[0], params[1], attn_mask=landmark_mask, scale=scale)
    if len(params) == 2:
        return out
    value, weight = leaves[1], params[2]
    half = weight.shape[-2] // 2
    # the chunk's rows with kernel // 2 positions on each side, zeros beyond the sequence
    before, after = chunk.keys.start - (chunk.rows.start - half), chunk.rows.stop + half - chunk.keys.stop
    window = F.pad(value, (0, 0, before, after))
    real = None if attention_mask is None else F.pad(attention_mask[:, chunk.keys], (before, after), value=False)
    return out + depthwise_value_conv(window, weight, real)[:, :, half:window.shape[2] - half]


@padding_safe
def nystrom_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    num_landmarks: int = 256,
    pinv_iterations: int = 6,
    conv_weight: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Nystromformer eq. 15 on [B, H, N, Dh]; ``conv_weight`` [H, 1, kernel, 1] adds the V skip.

    The [N, m] products run in the inputs' dtype (the autocast dtype under autocast); the landmark means,
    the m x m kernel and its pseudo-inverse (eq. 16, an iteration that bfloat16 cannot carry) in float32
    for half inputs, with autocast off."""
    check_qkv(query, key, value, attention_mask)
    if query.shape[-2] != key.shape[-2]:
        raise AttentionError("Nystrom attention here is self-attention: queries and keys must have equal N")
    if not isinstance(num_landmarks, int) or num_landmarks <= 0:
        raise AttentionError(f"num_landmarks must be a positive int, got {num_landmarks!r}")
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    real = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask

    # With no more tokens than landmarks every real token is its own landmark (segments of one), and
    # the other landmarks are empty: identity blocks of a block-diagonal pseudo-inverse that no query
    # reads. Dropping them gives the same output without the m x m pseudo-inverse of eq. 16 (m = 256
    # by default: 6 x 4 products of 256 x 256 per head for a 25-token sentence).
    m = min(num_landmarks, n)
    work = compute_dtype(query.dtype)
    if attention_mask is None:
        pad = (-n) % m
        segment = (n + pad) // m
        # Segment sums (eq. 13-14), then the mean over the count.
        q_sum, k_sum = ((F.pad(t, (0, 0, 0, pad)) if pad else t).unflatten(2, (m, segment)).sum(dim=-2, dtype=work)
                        for t in (query, key))
        counts = F.pad(real, (0, pad), value=False).reshape(b, 1, m, segment).sum(dim=-1, keepdim=True)
    else:
        # padded tokens fall in a spare segment: no masked copy of q or k is needed
        q_sum, k_sum, counts = _real_segment_sums(query.to(work), key.to(work), real, m)
    q_land = q_sum / counts.clamp(min=1).to(work) * scale  # the scale on the small side
    k_land = k_sum / counts.clamp(min=1).to(work)
    valid = counts[..., 0] > 0  # [B, 1, m]: landmark has at least one real token
    landmark_mask = None if attention_mask is None and n % m == 0 else valid[:, :, None, :]
    key_mask = None if attention_mask is None else real[:, None, None, :]

    with autocast_disabled(query.device):
        kernel_2 = _masked_softmax(q_land @ k_land.transpose(-1, -2), landmark_mask)  # [B, H, m, m]
        if landmark_mask is not None:
            eye = torch.eye(m, dtype=kernel_2.dtype, device=kernel_2.device)
            kernel_2 = torch.where(valid[..., None], kernel_2, eye)  # invalid landmark: identity row
        pinv = iterative_pinv(kernel_2, pinv_iterations)
    # Right to left, and the two [N, m]-sized softmax products (kernel_3 V and kernel_1 W) through
    # SDPA's fused kernel, which keeps neither [B, H, N, m] matrix for the backward pass. Padded
    # keys are outside every softmax, so only the convolution needs V zeroed there.
    landmark_values = F.scaled_dot_product_attention(q_land.to(query.dtype), key, value, attn_mask=key_mask, scale=1.0)
    with autocast_disabled(query.device):
        mixed = (pinv @ landmark_values.to(work)).to(value.dtype)  # [B, H, m, Dh]
    return _output_rows(query, value, k_land.to(query.dtype), mixed, landmark_mask, conv_weight, attention_mask, scale)


@padding_safe
def nystrom_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    num_landmarks: int = 256,
    pinv_iterations: int = 6,
    conv_weight: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Plain eq. 15 per sequence: explicit segment assignment, only the real landmarks, the full
    N x N approximate attention matrix, and the convolution as a sum of shifted copies; for tests."""
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    m = num_landmarks
    outs = []
    for bi in range(b):
        real = torch.ones(n, dtype=torch.bool) if attention_mask is None else attention_mask[bi].cpu()
        v = value[bi] * real[None, :, None].to(value.dtype)
        # landmark j averages the real tokens of rank [j * segment, (j + 1) * segment) among the real ones
        segment = max(1, math.ceil(int(real.sum()) / m))
        assign = torch.zeros(m, n, dtype=query.dtype)
        for rank, pos in enumerate(torch.nonzero(real).flatten().tolist()):
            assign[rank // segment, pos] = 1.0
        nonempty = assign.sum(1) > 0
        assign = assign[nonempty] / assign[nonempty].sum(1, keepdim=True)
        q_land, k_land = assign @ query[bi], assign @ key[bi]  # [H, m', d]
        key_allowed = real[None, None, :]
        k1 = torch.softmax(query[bi] @ k_land.transpose(-1, -2) * scale, dim=-1)
        k2 = torch.softmax(q_land @ k_land.transpose(-1, -2) * scale, dim=-1)
        s3 = (q_land @ key[bi].transpose(-1, -2) * scale).masked_fill(~key_allowed, float("-inf"))
        k3 = torch.softmax(s3, dim=-1)
        approx = k1 @ iterative_pinv(k2, pinv_iterations) @ k3  # [H, N, N]
        out = approx @ v
        if conv_weight is not None:
            kernel = conv_weight.shape[-2]
            half = kernel // 2
            for t in range(kernel):
                shift = t - half  # output i reads v[i + shift]
                w = conv_weight[:, 0, t, 0].to(v.dtype)[:, None, None]
                shifted = torch.zeros_like(v)
                lo, hi = max(0, -shift), min(n, n - shift)
                if hi > lo:
                    shifted[:, lo:hi] = v[:, lo + shift : hi + shift]
                out = out + w * shifted
        outs.append(out)
    return torch.stack(outs)


@register_attention(
    "nystrom",
    capabilities=Capabilities(sequence_parallel=True),
    functional=nystrom_attention,
    reference=nystrom_attention_reference,
    paper="Nystromformer: A Nystrom-Based Algorithm for Approximating Self-Attention (Xiong et al., AAAI 2021)",
)
class NystromAttention(AttentionBase):
    """Nystromformer attention: segment-mean landmarks, iterative pseudo-inverse, conv skip on V."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        num_landmarks: int = 256,
        pinv_iterations: int = 6,
        conv_kernel: int | None = 33,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(num_landmarks, int) or num_landmarks <= 0:
            raise AttentionError(f"num_landmarks must be a positive int, got {num_landmarks!r}")
        if not isinstance(pinv_iterations, int) or pinv_iterations < 0:
            raise AttentionError(f"pinv_iterations must be an int >= 0, got {pinv_iterations!r}")
        if conv_kernel is not None and (not isinstance(conv_kernel, int) or conv_kernel <= 0 or conv_kernel % 2 == 0):
            raise AttentionError(f"conv_kernel must be a positive odd int or None, got {conv_kernel!r}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.num_landmarks = num_landmarks
        self.pinv_iterations = pinv_iterations
        self.conv_kernel = conv_kernel
        if conv_kernel is None:
            self.conv_weight = None
        else:
            # Same layout and init as a grouped Conv2d(heads, heads, (kernel, 1), groups=heads).
            conv = nn.Conv2d(heads, heads, (conv_kernel, 1), groups=heads, bias=False)
            self.conv_weight = nn.Parameter(conv.weight.detach().clone())

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        out = nystrom_attention(
            q, k, v, attention_mask,
            num_landmarks=self.num_landmarks,
            pinv_iterations=self.pinv_iterations,
            conv_weight=self.conv_weight,
        )
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_landmarks={self.num_landmarks}, "
            f"pinv_iterations={self.pinv_iterations}, conv_kernel={self.conv_kernel}"
        )
