"""Triton kernels of the Smoother's GPU path (SKTformer Section 3.2, Algorithm 2).

``TritonStemSteps`` has the signatures of ``longattn.attention.smoother.TorchStemSteps``, the plain PyTorch
reference of every kernel here (the tests compare them, forward and backward, in Triton's interpreter).
Each kernel replaces a chain of whole-sequence passes by one:

* ``segment_mean``: zero padding, the segment means of eq. (6) in float32 (and their backward);
* ``stem_input``: the stem's input [X^smooth, X] in the GEMM dtype, zero at padded tokens (and its backward,
  which writes both gradients, masked, in their own dtypes);
* ``shift_sum``: the Conv1d output from every tap's GEMM product (sum of k row-shifted blocks, plus bias),
  stored in the GEMM dtype, with the BatchNorm moments of each row (or block of rows) exact in float32
  (the caller merges them with Chan's formula);
* ``normalise``: BatchNorm with the given statistics, activation, dropout and zero padding;
* ``backward_sums`` and ``backward_input``: the backward of the last two steps, the second writing the
  gradient of the conv output straight into the k row-shifted blocks the input-gradient GEMM reads.

Programs own whole rows (all features of ``rows`` tokens of one sequence); statistics are float32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from longattn.attention._triton import check_backward, kernels_or_pytorch_path, launch, launches_on_input_device
from longattn.attention.smoother import StemConfig, TorchStemSteps

__all__ = ["TritonStemSteps"]

_ACTIVATION_CODES = {"relu": 0, "elu": 1, "gelu": 2}
_TILE_ELEMENTS = 4096  # entries of a program's tile
_TRANSPOSE_TILE = 64  # square tiles of the stem input's kernels: one operand is channel-first, the other token-major


def _tile(dim: int) -> tuple[int, int]:
    """(rows, columns) of a program's tile: whole rows of ``dim`` features."""
    columns = triton.next_power_of_2(dim)
    return max(1, min(64, _TILE_ELEMENTS // columns)), columns


def _mask_bytes(mask: Tensor | None, like: Tensor) -> Tensor:
    """The key-padding mask as contiguous uint8 (a placeholder pointer without a mask)."""
    return like if mask is None else mask.contiguous().view(torch.uint8)


def _rows(t: Tensor) -> Tensor:
    """``t`` with unit stride along its last axis (the kernels take strides for the others)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _real_rows(mask_ptr, b, n, N, HAS_MASK: tl.constexpr):
    """bool [rows]: the row exists and is a real token."""
    real = n < N
    if HAS_MASK:
        real = real & (tl.load(mask_ptr + b * N + n, mask=n < N, other=0) != 0)
    return real


@triton.jit
def _channel(ptr, n, f, N, D, PER_POSITION: tl.constexpr):
    """A per-channel float32 vector broadcast over a [rows, features] tile (channels = positions or features)."""
    if PER_POSITION:
        values = tl.load(ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None] + tl.zeros_like(f)[None, :]
    else:
        values = tl.load(ptr + f, mask=f < D, other=0.0).to(tl.float32)[None, :] + tl.zeros_like(n)[:, None]
    return values


@triton.jit
def _activation(y, ACT: tl.constexpr):
    if ACT == 0:
        return tl.maximum(y, 0.0)
    elif ACT == 1:
        return tl.where(y > 0, y, tl.exp(y) - 1.0)
    else:
        return 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))


@triton.jit
def _activation_grad(y, ACT: tl.constexpr):
    if ACT == 0:
        return (y > 0).to(tl.float32)
    elif ACT == 1:
        return tl.where(y > 0, 1.0, tl.exp(y))
    else:
        return 0.5 * (1.0 + tl.math.erf(y * 0.7071067811865476)) + y * tl.exp(-0.5 * y * y) * 0.3989422804014327


@triton.jit
def _segment_mean_fwd(x_ptr, mask_ptr, u_ptr, N, R, W, x_sb, x_sn, HAS_MASK: tl.constexpr, BR: tl.constexpr,
                      RP: tl.constexpr, WP: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets: b x N x D may pass 2^31
    n = pid * BR + tl.arange(0, BR)
    g, i = tl.arange(0, RP), tl.arange(0, WP)
    real = _real_rows(mask_ptr, b, n, N, HAS_MASK)
    offsets = b * x_sb + n[:, None, None].to(tl.int64) * x_sn + g[None, :, None].to(tl.int64) * W + i[None, None, :]
    inside = real[:, None, None] & (g < R)[None, :, None] & (i < W)[None, None, :]
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)  # padded tokens never read: NaN-safe
    rows = b * N + n
    tl.store(u_ptr + rows[:, None] * R + g[None, :], tl.sum(x, 2) / W, mask=(n < N)[:, None] & (g < R)[None, :])


@triton.jit
def _segment_mean_bwd(du_ptr, mask_ptr, dx_ptr, N, R, W, HAS_MASK: tl.constexpr, BR: tl.constexpr, RP: tl.constexpr,
                      WP: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets: b x N x D may pass 2^31
    n = pid * BR + tl.arange(0, BR)
    g, i = tl.arange(0, RP), tl.arange(0, WP)
    real = _real_rows(mask_ptr, b, n, N, HAS_MASK)
    rows = b * N + n
    du = tl.load(du_ptr + rows[:, None] * R + g[None, :], mask=real[:, None] & (g < R)[None, :], other=0.0)
    dx = tl.broadcast_to((du.to(tl.float32) / W)[:, :, None], (BR, RP, WP))
    offsets = (rows[:, None, None] * R + g[None, :, None]) * W + i[None, None, :]
    inside = (n < N)[:, None, None] & (g < R)[None, :, None] & (i < W)[None, None, :]
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=inside)


class _SegmentMean(torch.autograd.Function):
    @staticmethod
    @launches_on_input_device
    def forward(ctx, x, mask, segments, dtype):  # type: ignore[override]
        x = _rows(x)
        batch, length, dim = x.shape
        width = dim // segments
        means = torch.empty(batch, length, segments, dtype=dtype, device=x.device)
        rows, _ = _tile(triton.next_power_of_2(segments) * triton.next_power_of_2(width))
        grid = (triton.cdiv(length, rows), batch)
        launch(_segment_mean_fwd, grid, x, _mask_bytes(mask, x), means, length, segments, width, x.stride(0),
               x.stride(1), HAS_MASK=mask is not None, BR=rows, RP=triton.next_power_of_2(segments),
               WP=triton.next_power_of_2(width))
        ctx.save_for_backward(mask)
        ctx.meta = (x.shape, x.dtype, rows)
        check_backward(_SegmentMean, ctx, (mask,), (means,))
        return means

    @staticmethod
    @torch.autograd.function.once_differentiable
    @launches_on_input_device
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        shape, dtype, rows = ctx.meta
        batch, length, dim = shape
        segments = grad.shape[-1]
        width = dim // segments
        grad = grad.contiguous()
        grad_x = torch.empty(shape, dtype=dtype, device=grad.device)
        launch(_segment_mean_bwd, (triton.cdiv(length, rows), batch),
            grad, _mask_bytes(mask, grad), grad_x, length, segments, width, HAS_MASK=mask is not None, BR=rows,
            RP=triton.next_power_of_2(segments), WP=triton.next_power_of_2(width))
        return grad_x, None, None, None


@triton.jit
def _stem_input_fwd(s_ptr, x_ptr, mask_ptr, inp_ptr, N, D, s_sb, s_sn, s_sf, x_sb, x_sn, HAS_SMOOTHED: tl.constexpr,
                    HAS_MASK: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """X^smooth may be channel-first (the FFT's layout: unit stride along the tokens), X token-major."""
    pid, pid_f, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)  # 64-bit offsets
    n = pid * BR + tl.arange(0, BR)
    f = pid_f * BD + tl.arange(0, BD)
    real = _real_rows(mask_ptr, b, n, N, HAS_MASK)
    load = real[:, None] & (f < D)[None, :]
    write = (n < N)[:, None] & (f < D)[None, :]
    n64 = n[:, None].to(tl.int64)
    C = 2 * D if HAS_SMOOTHED else D
    out = inp_ptr + (b * N + n64) * C + f[None, :]
    x = tl.load(x_ptr + b * x_sb + n64 * x_sn + f[None, :], mask=load, other=0.0)
    if HAS_SMOOTHED:
        s = tl.load(s_ptr + b * s_sb + n64 * s_sn + f[None, :].to(tl.int64) * s_sf, mask=load, other=0.0)
        tl.store(out, s.to(inp_ptr.dtype.element_ty), mask=write)
        tl.store(out + D, x.to(inp_ptr.dtype.element_ty), mask=write)
    else:
        tl.store(out, x.to(inp_ptr.dtype.element_ty), mask=write)


@triton.jit
def _stem_input_bwd(g_ptr, mask_ptr, ds_ptr, dx_ptr, N, D, ds_sb, ds_sn, ds_sf, HAS_SMOOTHED: tl.constexpr,
                    HAS_MASK: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """The gradient of X^smooth written with the given strides (channel-first for the FFT), that of X token-major."""
    pid, pid_f, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)  # 64-bit offsets
    n = pid * BR + tl.arange(0, BR)
    f = pid_f * BD + tl.arange(0, BD)
    real = _real_rows(mask_ptr, b, n, N, HAS_MASK)
    load = real[:, None] & (f < D)[None, :]
    write = (n < N)[:, None] & (f < D)[None, :]
    rows = (b * N + n)[:, None]
    C = 2 * D if HAS_SMOOTHED else D
    grad = g_ptr + rows * C + f[None, :]
    if HAS_SMOOTHED:
        smoothed = ds_ptr + b * ds_sb + n[:, None].to(tl.int64) * ds_sn + f[None, :].to(tl.int64) * ds_sf
        tl.store(smoothed, tl.load(grad, mask=load, other=0.0).to(ds_ptr.dtype.element_ty), mask=write)
        grad += D
    tl.store(dx_ptr + rows * D + f[None, :], tl.load(grad, mask=load, other=0.0).to(dx_ptr.dtype.element_ty),
             mask=write)


@triton.jit
def _shift_sum_kernel(y_ptr, bias_ptr, mask_ptr, h_ptr, mean_ptr, m2_ptr, count_ptr, N, D, K, HALF, P,
                      HAS_MASK: tl.constexpr, TRAINING: tl.constexpr, PER_POSITION: tl.constexpr, BR: tl.constexpr,
                      BD: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets: b x N x D may pass 2^31
    n = pid * BR + tl.arange(0, BR)
    f = tl.arange(0, BD)
    inside, features = n < N, f < D
    acc = tl.zeros([BR, BD], dtype=tl.float32) + tl.load(bias_ptr + f, mask=features, other=0.0).to(tl.float32)[None, :]
    for j in range(K):  # h[n] += Y_j[n + j - k//2]
        source = n + j - HALF
        ok = inside & (source >= 0) & (source < N)
        rows = (b * N + source)[:, None]
        acc += tl.load(y_ptr + (rows * K + j) * D + f[None, :], mask=ok[:, None] & features[None, :],
                       other=0.0).to(tl.float32)
    stored = acc.to(h_ptr.dtype.element_ty)
    rows = (b * N + n)[:, None]
    tl.store(h_ptr + rows * D + f[None, :], stored, mask=inside[:, None] & features[None, :])
    if TRAINING:  # moments of the stored values over the real entries, exact (centred) in float32
        h = stored.to(tl.float32)
        real = _real_rows(mask_ptr, b, n, N, HAS_MASK)
        weight = (real[:, None] & features[None, :]).to(tl.float32)
        if PER_POSITION:  # one row = one channel's entries of one sequence
            mean = tl.sum(h * weight, 1) / D
            deviation = (h - mean[:, None]) * weight
            tl.store(mean_ptr + b * N + n, mean, mask=inside)
            tl.store(m2_ptr + b * N + n, tl.sum(deviation * deviation, 1), mask=inside)
        else:  # per feature, over this program's rows
            count = tl.sum(weight, 0)
            mean = tl.sum(h * weight, 0) / tl.maximum(count, 1.0)
            deviation = (h - mean[None, :]) * weight
            tl.store(mean_ptr + (b * P + pid) * D + f, mean, mask=features)
            tl.store(m2_ptr + (b * P + pid) * D + f, tl.sum(deviation * deviation, 0), mask=features)
            tl.store(count_ptr + b * P + pid, tl.sum(real.to(tl.float32), 0))


@triton.jit
def _normalise_kernel(h_ptr, mean_ptr, rstd_ptr, w_ptr, bias_ptr, keep_ptr, mask_ptr, out_ptr, N, D, keep_scale,
                      ACT: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_MASK: tl.constexpr, PER_POSITION: tl.constexpr,
                      BR: tl.constexpr, BD: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets: b x N x D may pass 2^31
    n = pid * BR + tl.arange(0, BR)
    f = tl.arange(0, BD)
    inside = (n < N)[:, None] & (f < D)[None, :]
    offsets = (b * N + n)[:, None] * D + f[None, :]
    h = tl.load(h_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    scale = _channel(rstd_ptr, n, f, N, D, PER_POSITION) * _channel(w_ptr, n, f, N, D, PER_POSITION)
    y = (h - _channel(mean_ptr, n, f, N, D, PER_POSITION)) * scale + _channel(bias_ptr, n, f, N, D, PER_POSITION)
    out = _activation(y, ACT)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + offsets, mask=inside, other=0)
        out = tl.where(keep != 0, out * keep_scale, 0.0)
    if HAS_MASK:
        out = tl.where(_real_rows(mask_ptr, b, n, N, HAS_MASK)[:, None], out, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _output_grad(g_ptr, h_ptr, mean_ptr, rstd_ptr, w_ptr, bias_ptr, keep_ptr, mask_ptr, b, n, f, N, D, keep_scale,
                 ACT: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_MASK: tl.constexpr, PER_POSITION: tl.constexpr):
    """(dy, xhat, real rows): the gradient of the BatchNorm output and the normalised conv output of a tile."""
    inside = (n < N)[:, None] & (f < D)[None, :]
    offsets = (b * N + n)[:, None] * D + f[None, :]
    h = tl.load(h_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    xhat = (h - _channel(mean_ptr, n, f, N, D, PER_POSITION)) * _channel(rstd_ptr, n, f, N, D, PER_POSITION)
    y = xhat * _channel(w_ptr, n, f, N, D, PER_POSITION) + _channel(bias_ptr, n, f, N, D, PER_POSITION)
    real = _real_rows(mask_ptr, b, n, N, HAS_MASK)
    dy = tl.load(g_ptr + offsets, mask=inside & real[:, None], other=0.0).to(tl.float32) * _activation_grad(y, ACT)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + offsets, mask=inside, other=0)
        dy = tl.where(keep != 0, dy * keep_scale, 0.0)
    return dy, tl.where(inside, xhat, 0.0), real


@triton.jit
def _backward_sums_kernel(g_ptr, h_ptr, mean_ptr, rstd_ptr, w_ptr, bias_ptr, keep_ptr, mask_ptr, s1_ptr, s2_ptr, N, D,
                          P, keep_scale, ACT: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_MASK: tl.constexpr,
                          PER_POSITION: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets: b x N x D may pass 2^31
    n = pid * BR + tl.arange(0, BR)
    f = tl.arange(0, BD)
    dy, xhat, real = _output_grad(g_ptr, h_ptr, mean_ptr, rstd_ptr, w_ptr, bias_ptr, keep_ptr, mask_ptr, b, n, f, N,
                                  D, keep_scale, ACT, HAS_KEEP, HAS_MASK, PER_POSITION)
    if PER_POSITION:
        tl.store(s1_ptr + b * N + n, tl.sum(dy, 1), mask=n < N)
        tl.store(s2_ptr + b * N + n, tl.sum(dy * xhat, 1), mask=n < N)
    else:
        tl.store(s1_ptr + (b * P + pid) * D + f, tl.sum(dy, 0), mask=f < D)
        tl.store(s2_ptr + (b * P + pid) * D + f, tl.sum(dy * xhat, 0), mask=f < D)


@triton.jit
def _backward_input_kernel(g_ptr, h_ptr, mean_ptr, rstd_ptr, w_ptr, bias_ptr, keep_ptr, mask_ptr, s1_ptr, s2_ptr,
                           count_ptr, shifted_ptr, dbias_ptr, N, D, K, HALF, P, keep_scale, ACT: tl.constexpr,
                           HAS_KEEP: tl.constexpr, HAS_MASK: tl.constexpr, PER_POSITION: tl.constexpr,
                           TRAINING: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets: b x N x D may pass 2^31
    n = pid * BR + tl.arange(0, BR)
    f = tl.arange(0, BD)
    dy, xhat, real = _output_grad(g_ptr, h_ptr, mean_ptr, rstd_ptr, w_ptr, bias_ptr, keep_ptr, mask_ptr, b, n, f, N,
                                  D, keep_scale, ACT, HAS_KEEP, HAS_MASK, PER_POSITION)
    scale = _channel(w_ptr, n, f, N, D, PER_POSITION) * _channel(rstd_ptr, n, f, N, D, PER_POSITION)
    if TRAINING:  # through the batch statistics
        count = tl.maximum(_channel(count_ptr, n, f, N, D, PER_POSITION), 1.0)
        dh = scale * (dy - _channel(s1_ptr, n, f, N, D, PER_POSITION) / count
                      - xhat * _channel(s2_ptr, n, f, N, D, PER_POSITION) / count)
        dh = tl.where(real[:, None], dh, 0.0)
    else:
        dh = scale * dy
    features = f < D
    dh = tl.where((n < N)[:, None] & features[None, :], dh, 0.0)
    tl.store(dbias_ptr + (b * P + pid) * D + f, tl.sum(dh, 0), mask=features)
    stored = dh.to(shifted_ptr.dtype.element_ty)
    for j in range(K):  # D_j[n + j - k//2] = dh[n]
        target = n + j - HALF
        ok = (n < N) & (target >= 0) & (target < N)
        rows = (b * N + target)[:, None]
        tl.store(shifted_ptr + (rows * K + j) * D + f[None, :], stored, mask=ok[:, None] & features[None, :])


def _moments(mean: Tensor, m2: Tensor, count: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """Merge per-part moments (mean, sum of squared deviations, count) over ``dims`` (Chan et al.): the
    channels' mean, biased variance and count."""
    total = count.sum(dims)
    safe = total.clamp_min(1)
    merged = (count * mean).sum(dims) / safe
    deviation = mean - merged
    return merged, (m2 + count * deviation.square()).sum(dims) / safe, total


def _torch_step_where_a_kernel_does_not_fit(step: Callable[..., Any]) -> Callable[..., Any]:
    """A step of TritonStemSteps, or the same step of TorchStemSteps where one of its kernels needs more shared
    memory than the device has (:func:`~longattn.attention._triton.kernels_or_pytorch_path`): the steps have the
    same signatures, so each one, forward or backward, falls back by itself."""

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        return kernels_or_pytorch_path(lambda: step(*args, **kwargs),
                                       lambda: getattr(TorchStemSteps, step.__name__)(*args, **kwargs))

    return run


class TritonStemSteps:
    """The stem steps of the Smoother's GPU path as Triton kernels (see the module docstring)."""

    @staticmethod
    @_torch_step_where_a_kernel_does_not_fit
    def segment_mean(x: Tensor, mask: Tensor | None, segments: int, dtype: torch.dtype) -> Tensor:
        return _SegmentMean.apply(x, mask, segments, dtype)

    @staticmethod
    @_torch_step_where_a_kernel_does_not_fit
    @launches_on_input_device
    def stem_input(x: Tensor, smoothed: Tensor | None, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
        x = _rows(x)
        smoothed = x if smoothed is None else smoothed
        batch, length, dim = x.shape
        has_smoothed = smoothed is not x
        inp = torch.empty(batch, length, (2 if has_smoothed else 1) * dim, dtype=dtype, device=x.device)
        launch(_stem_input_fwd, (triton.cdiv(length, _TRANSPOSE_TILE), triton.cdiv(dim, _TRANSPOSE_TILE), batch),
            smoothed, x, _mask_bytes(mask, x), inp, length, dim, *smoothed.stride(), x.stride(0), x.stride(1),
            HAS_SMOOTHED=has_smoothed, HAS_MASK=mask is not None, BR=_TRANSPOSE_TILE, BD=_TRANSPOSE_TILE)
        return inp

    @staticmethod
    @_torch_step_where_a_kernel_does_not_fit
    @launches_on_input_device
    def stem_input_backward(grad: Tensor, mask: Tensor | None, has_smoothed: bool,
                            dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[Tensor | None, Tensor]:
        """The gradient of X^smooth comes back channel-first (a [B, N, dim] view of [B, dim, N]): the layout
        the FFT's backward transforms along."""
        grad = grad.contiguous()
        batch, length, channels = grad.shape
        dim = channels // 2 if has_smoothed else channels
        grad_x = torch.empty(batch, length, dim, dtype=dtypes[1], device=grad.device)
        grad_smoothed = None
        if has_smoothed:
            grad_smoothed = torch.empty(batch, dim, length, dtype=dtypes[0], device=grad.device).transpose(1, 2)
        target = grad_x if grad_smoothed is None else grad_smoothed
        launch(_stem_input_bwd, (triton.cdiv(length, _TRANSPOSE_TILE), triton.cdiv(dim, _TRANSPOSE_TILE), batch),
            grad, _mask_bytes(mask, grad), target, grad_x, length, dim, *target.stride(), HAS_SMOOTHED=has_smoothed,
            HAS_MASK=mask is not None, BR=_TRANSPOSE_TILE, BD=_TRANSPOSE_TILE)
        return grad_smoothed, grad_x

    @staticmethod
    @_torch_step_where_a_kernel_does_not_fit
    @launches_on_input_device
    def shift_sum(taps_out: Tensor, bias: Tensor, mask: Tensor | None,
                  cfg: StemConfig) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        batch, length, width = taps_out.shape
        k = cfg.kernel_size
        dim = width // k
        rows, columns = _tile(dim)
        parts = triton.cdiv(length, rows)
        positions = cfg.over == "positions"
        h = torch.empty(batch, length, dim, dtype=cfg.gemm_dtype, device=taps_out.device)
        moment_shape = (batch, length) if positions else (batch, parts, dim)
        mean = torch.empty(moment_shape, dtype=torch.float32, device=h.device)
        m2 = torch.empty_like(mean)
        count = torch.empty(batch, parts, dtype=torch.float32, device=h.device)
        launch(_shift_sum_kernel, (parts, batch),
            taps_out.contiguous(), bias, _mask_bytes(mask, h), h, mean, m2, count, length, dim, k, k // 2, parts,
            HAS_MASK=mask is not None, TRAINING=cfg.training, PER_POSITION=positions, BR=rows, BD=columns)
        if not cfg.training:
            return h, None, None, None
        if positions:  # a real row holds dim entries of its position's channel
            real = torch.ones_like(mean) if mask is None else mask.to(mean.dtype)
            return (h, *_moments(mean, m2, real * dim, (0,)))
        return (h, *_moments(mean, m2, count[..., None].expand_as(mean), (0, 1)))

    @staticmethod
    @_torch_step_where_a_kernel_does_not_fit
    @launches_on_input_device
    def normalise(h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, keep: Tensor | None,
                  mask: Tensor | None, cfg: StemConfig) -> Tensor:
        batch, length, dim = h.shape
        out = torch.empty(h.shape, dtype=cfg.out_dtype, device=h.device)
        rows, columns = _tile(dim)
        launch(_normalise_kernel, (triton.cdiv(length, rows), batch),
            h, mean, rstd, weight, bias, h if keep is None else keep.view(torch.uint8), _mask_bytes(mask, h), out,
            length, dim, _keep_scale(cfg), ACT=_ACTIVATION_CODES[cfg.activation], HAS_KEEP=keep is not None,
            HAS_MASK=mask is not None, PER_POSITION=cfg.over == "positions", BR=rows, BD=columns)
        return out

    @staticmethod
    @_torch_step_where_a_kernel_does_not_fit
    @launches_on_input_device
    def backward_sums(grad: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor,
                      keep: Tensor | None, mask: Tensor | None, cfg: StemConfig) -> tuple[Tensor, Tensor]:
        batch, length, dim = h.shape
        rows, columns = _tile(dim)
        parts = triton.cdiv(length, rows)
        positions = cfg.over == "positions"
        shape = (batch, length) if positions else (batch, parts, dim)
        sums = torch.empty((2, *shape), dtype=torch.float32, device=h.device)
        launch(_backward_sums_kernel, (parts, batch),
            grad.contiguous(), h, mean, rstd, weight, bias, h if keep is None else keep.view(torch.uint8),
            _mask_bytes(mask, h), sums[0], sums[1], length, dim, parts, _keep_scale(cfg),
            ACT=_ACTIVATION_CODES[cfg.activation], HAS_KEEP=keep is not None, HAS_MASK=mask is not None,
            PER_POSITION=positions, BR=rows, BD=columns)
        total = sums.sum(1) if positions else sums.sum((1, 2))
        return total[0], total[1]

    @staticmethod
    @_torch_step_where_a_kernel_does_not_fit
    @launches_on_input_device
    def backward_input(grad: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor,
                       keep: Tensor | None, mask: Tensor | None, sums: tuple[Tensor, Tensor] | None,
                       count: Tensor | None, cfg: StemConfig) -> tuple[Tensor, Tensor]:
        batch, length, dim = h.shape
        k = cfg.kernel_size
        half = k // 2
        rows, columns = _tile(dim)
        parts = triton.cdiv(length, rows)
        shifted = torch.empty(batch, length, k, dim, dtype=cfg.gemm_dtype, device=h.device)
        for j in range(k):  # the rows of each shifted block that no gradient row lands on (beyond the sequence)
            offset = j - half
            shifted[:, :max(0, min(length, offset)), j] = 0
            shifted[:, max(0, length + min(0, offset)):, j] = 0
        grad_bias = torch.empty(batch, parts, dim, dtype=torch.float32, device=h.device)
        training = sums is not None
        launch(_backward_input_kernel, (parts, batch),
            grad.contiguous(), h, mean, rstd, weight, bias, h if keep is None else keep.view(torch.uint8),
            _mask_bytes(mask, h), *(sums if training else (mean, mean)), count if training else mean, shifted,
            grad_bias, length, dim, k, half, parts, _keep_scale(cfg), ACT=_ACTIVATION_CODES[cfg.activation],
            HAS_KEEP=keep is not None, HAS_MASK=mask is not None, PER_POSITION=cfg.over == "positions",
            TRAINING=training, BR=rows, BD=columns)
        return shifted.view(batch, length, k * dim), grad_bias.sum((0, 1))


def _keep_scale(cfg: StemConfig) -> float:
    return 1.0 / (1.0 - cfg.dropout_p)
