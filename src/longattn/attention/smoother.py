"""The Smoother block of SKTformer / S^3 Attention (SKTformer paper, Section 3.2 and Algorithm 2).

It is not an attention mechanism (nothing is registered here); the ``skeleton`` attention puts it
in front of its projections, and the LRA encoder and the time-series forecaster may use it directly.

Pipeline on a token matrix X of shape [B, N, dim] (N <= max_len):

1. Segment average (eq. 5-6): average each of ``segments`` (= r) groups of dim/r consecutive
   features, X S. Skipped (r = dim) with ``segment_average=False``.
2. Fourier convolution (eq. 4-5): rFFT along the sequence at length ``max_len`` (the input is
   zero-padded to ``max_len`` as in the authors' code), pointwise product with the learnable
   complex weights L of shape [max_len // 2 + 1, dim], irFFT. This is a circular convolution
   of length ``max_len`` with a learned kernel of the full sequence length.
3. Convolution stem (Section 3.2.2): concat [X^smooth, X] -> Conv1d(2 dim -> dim, kernel 3)
   -> BatchNorm -> activation (ReLU) -> dropout.

Padding: padded tokens are zeroed before the FFT and before the stem, so their contents never
reach a real token, and the BatchNorm statistics are taken over real tokens only. A sequence of
N < max_len tokens is treated exactly like the same sequence padded to max_len.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention._triton import triton_runs_on
from longattn.attention.base import (
    AttentionError,
    check_attention_mask,
    compute_dtype,
    full_float32,
    output_dtype,
    uses_gpu_path,
)

__all__ = ["Smoother", "MaskedBatchNorm", "draw_keep", "mask_factor"]

_ACTIVATIONS = {"relu": F.relu, "elu": F.elu, "gelu": F.gelu}
_FFT_NORMS = ("backward", "ortho", "forward")
_BATCHNORM_AXES = ("positions", "features")
PRECISIONS = ("full", "bf16")


class _MaskedBatchNormTrain(torch.autograd.Function):
    """Training-mode masked batch norm with a hand-written backward.

    Forward: mean = sum(w h) / c, var = sum(w (h - mean)^2) / c per channel (w = 1 at real
    tokens), y = (h - mean) * weight / sqrt(var + eps) + bias. Autograd through those steps takes
    about a dozen full passes over h; the closed-form gradient below takes four:
    dh = g s + w (a + b (h - mean)) with s = weight / sqrt(var + eps), a = -s sum(g) / c and
    b = -s / (var + eps) * sum(g (h - mean)) / c (the mean's path through var vanishes because
    sum(w (h - mean)) = 0). Returns (y, mean, var); mean and var carry no gradient.
    """

    @staticmethod
    def forward(ctx, h, weights, count, weight, bias, reduce_dims, channel_shape, eps):  # type: ignore[override]
        mean = (h * weights).sum(reduce_dims) / count
        centred = h - mean.view(channel_shape)
        var = (centred.square() * weights).sum(reduce_dims) / count
        rstd = torch.rsqrt(var + eps)
        scale = weight * rstd
        out = torch.addcmul(bias.view(channel_shape), centred, scale.view(channel_shape))
        ctx.save_for_backward(centred, weights, count, rstd, scale)
        ctx.shapes = (reduce_dims, channel_shape)
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _grad_mean, _grad_var):  # type: ignore[override]
        centred, weights, count, rstd, scale = ctx.saved_tensors
        reduce_dims, channel_shape = ctx.shapes
        grad_bias = grad.sum(reduce_dims)
        grad_centred = (grad * centred).sum(reduce_dims)
        grad_weight = grad_centred * rstd
        a = -scale * grad_bias / count
        b = -scale * rstd.square() * grad_centred / count
        grad_h = None
        if ctx.needs_input_grad[0]:
            correction = torch.addcmul(a.view(channel_shape), centred, b.view(channel_shape)) * weights
            grad_h = torch.addcmul(correction, grad, scale.view(channel_shape))
        return grad_h, None, None, grad_weight, grad_bias, None, None, None


# Positions per tile of the fused stem: temporaries are [B, tile, dim] (a few MiB), so long
# sequences never allocate whole-sequence scratch buffers beyond the ones saved for backward.
STEM_TILE = 4096


def mask_factor(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as 0/1 in ``dtype``, converted through its bytes: on CPU a bool -> float
    conversion (or a masked_fill, or a product with a bool tensor) takes a slow path, about 10x a
    uint8 -> float conversion; used on finite values only (0 * NaN would stay NaN)."""
    return mask.view(torch.uint8).to(dtype)


def draw_keep(shape: tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """Bool dropout mask of ``shape`` ([B, N, ...]): an entry is kept when a float32 uniform draw is
    >= p, the distribution of ``nn.Dropout(p)``. Drawn per batch element and per tile of STEM_TILE
    positions, in memory order, so no float tensor of the whole shape exists; on CPU the
    generator fills tensors in memory order, so these are the draws of ``torch.rand(shape) >= p``."""
    keep = torch.empty(shape, dtype=torch.bool, device=device)
    for b in range(shape[0]):
        for start in range(0, shape[1], STEM_TILE):
            stop = min(start + STEM_TILE, shape[1])
            torch.ge(torch.rand((stop - start, *shape[2:]), device=device), p, out=keep[b, start:stop])
    return keep


class _FusedReluStem(torch.autograd.Function):
    """The Smoother in training: Fourier convolution (eq. 4-5, when ``frequency_weight`` is given;
    see _fourier_forward) -> convolution stem -> masked BatchNorm over positions -> ReLU -> dropout
    -> zero padding, the stem tile by tile along the sequence, with a hand-written backward.

    The same numbers as ``_fourier_smooth`` -> ``stem_conv`` -> ``MaskedBatchNorm`` -> ReLU ->
    ``_dropout_and_zero_padding`` (tested in float64, forward and every gradient): the Conv1d is k
    token-major GEMMs per input (tap j adds ``input[n + j - k//2] @ W_j^T`` to output row n), so neither the concatenated
    channel-first input nor a channel-first output or gradient is ever formed; the BatchNorm
    statistics of a position only involve that position, so every step is local to a tile. Saved
    for backward: the GEMM inputs x and X^smooth and the segments' spectrum, the centred conv output
    and one bool mask [B, N, dim] for ReLU, dropout and padding together. With ``gemm_dtype``
    bfloat16, X^smooth and the conv output (before its bias: the centred one is recomputed per tile
    from it and the per-position mean) are kept in bfloat16, x is converted tile by tile where a GEMM
    reads it; the conv is then one im2col GEMM per tile, its output rounded once, and so are the
    input gradients (the gradient of X^smooth is kept in bfloat16: its entries are those rounded
    products). Statistics, FFT, the other gradients and the output stay in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, frequency_weight, conv_weight, conv_bias, bn_weight, bn_bias, valid, dropout_keep, dropout_p,
                eps, gemm_dtype, fourier, output_grad_private):  # type: ignore[override]
        spectrum = None
        # with reduced-precision GEMMs X^smooth is written in their dtype by the Fourier blocks and kept
        # so for backward; x is converted tile by tile where it is read (the im2col copy in forward, its
        # rows for the weight gradient in backward): no whole-sequence copy of it
        if frequency_weight is not None:  # X^smooth of eq. (5), zero at padded positions
            smoothed, spectrum, weight = _fourier_forward(x, frequency_weight, valid, *fourier, out_dtype=gemm_dtype)
            inputs = [smoothed, x]
        else:
            inputs = [x]
        batch, length, dim = x.shape
        reduced = gemm_dtype != x.dtype
        # the conv output kept for backward, written by the GEMMs: in full precision centred in
        # place; in reduced precision as the GEMMs wrote it (before the bias, in their dtype)
        conv = torch.empty(x.shape, dtype=gemm_dtype, device=x.device)
        if reduced:  # all taps of all inputs as one GEMM over an im2col tile: one rounding of the output
            stacked = _stacked_taps(conv_weight, len(inputs)).to(gemm_dtype)
        else:
            taps = _stem_taps(conv_weight, len(inputs), gemm_dtype)  # [k][input] -> W^T [dim_in, dim]
        # ReLU, dropout and padding as one bool per entry; the dropout draws are not needed after
        # this, so their buffer (made by the caller for this call only) is reused
        passes = torch.empty(x.shape, dtype=torch.bool, device=x.device) if dropout_keep is None else dropout_keep
        out = torch.empty_like(x)
        mean, var, rstd, count = (x.new_empty(length) for _ in range(4))
        factor = 1.0 / (1.0 - dropout_p) if dropout_keep is not None else 1.0
        for start in range(0, length, STEM_TILE):
            stop = min(start + STEM_TILE, length)
            tile_conv = conv[:, start:stop]
            if reduced:
                _stem_conv_tile_im2col(inputs, stacked, conv_weight.shape[-1], start, tile_conv)
            else:
                _stem_conv_tile(inputs, taps, start, tile_conv)
            # [B, T, dim]; in full precision centred in place: the saved buffer then holds the centred output
            h = torch.add(tile_conv, conv_bias) if reduced else tile_conv.add_(conv_bias)  # reduced: promoted to x's dtype
            w = None if valid is None else mask_factor(valid[:, start:stop, None], x.dtype)
            if w is None:
                count[start:stop] = batch * dim
                tile_mean = h.sum((0, 2)) / count[start:stop]
            else:
                count[start:stop] = (w.sum((0, 2)) * dim).clamp_min(1)
                tile_mean = (h * w).sum((0, 2)) / count[start:stop]
            tile_centred = h.sub_(tile_mean[None, :, None])
            squares = tile_centred.square() if w is None else tile_centred.square() * w
            tile_var = squares.sum((0, 2)) / count[start:stop]
            tile_rstd = torch.rsqrt(tile_var + eps)
            mean[start:stop], var[start:stop], rstd[start:stop] = tile_mean, tile_var, tile_rstd
            # the dropout's 1/(1-p) (> 0: the sign of y, hence the ReLU, is unchanged) folded into the
            # BatchNorm's affine map: the output is then y times the pass mask, one pass
            scale = (bn_weight[start:stop] * tile_rstd * factor)[None, :, None]
            y = torch.addcmul(bn_bias[start:stop, None] * factor, tile_centred, scale)
            tile_passes = passes[:, start:stop]
            if dropout_keep is None:
                torch.gt(y, 0, out=tile_passes)
            else:
                tile_passes &= y > 0
            if valid is not None:
                tile_passes &= valid[:, start:stop, None]
            torch.mul(y, mask_factor(tile_passes, y.dtype), out=out[:, start:stop])
        ctx.save_for_backward(*inputs, conv_weight, conv_bias, bn_weight, conv, mean, passes, rstd, count,
                              *(() if valid is None else (valid,)),
                              *(() if spectrum is None else (spectrum, weight)))
        ctx.config = (len(inputs), valid is not None, factor, gemm_dtype, fourier, x.dtype, reduced, output_grad_private)
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_mean, _grad_var):  # type: ignore[override]
        n_inputs, masked, factor, gemm_dtype, fourier, dtype, reduced, output_grad_private = ctx.config
        saved = ctx.saved_tensors
        inputs = saved[:n_inputs]
        conv_weight, conv_bias, bn_weight, conv, mean, passes, rstd, count = saved[n_inputs:n_inputs + 8]
        rest = saved[n_inputs + 8:]
        valid = rest[0] if masked else None
        spectrum, weight = rest[-2:] if n_inputs == 2 else (None, None)
        batch, length, dim = conv.shape
        taps = _stem_taps(conv_weight, n_inputs, gemm_dtype, transpose=False)  # [k][input] -> W [dim, dim_in]
        # reduced precision: the input gradients by one GEMM per tile over windows of the conv gradient
        back_stacked = _backward_stacked_taps(conv_weight, gemm_dtype) if reduced else None
        half = conv_weight.shape[-1] // 2
        # the gradient of x written over the incoming gradient when nothing else can see that (the
        # caller says so: see Smoother.forward): one whole-sequence buffer fewer. Each tile reads the
        # incoming gradient k//2 rows beyond its own, so it keeps those of the next tile before writing.
        overwrite = (output_grad_private and grad_out.dtype == dtype and grad_out.shape == inputs[-1].shape
                     and grad_out.is_contiguous() and STEM_TILE >= half)
        # every row of the input gradients is written once, by the tile that owns it (no zero fill)
        grad_inputs = [grad_out if overwrite else torch.empty(inputs[-1].shape, dtype=dtype, device=conv.device)]
        if n_inputs == 2:  # the gradient of X^smooth channel-first: its FFT then runs along contiguous rows
            # (in reduced precision its entries are products rounded to bfloat16: stored so, exactly)
            grad_weight, grad_smoothed = _fourier_gradient_buffers(batch, length, weight,
                                                                   gemm_dtype if reduced else dtype)
            grad_inputs.insert(0, grad_smoothed)
        grad_taps = [[torch.zeros(w.shape[::-1], dtype=dtype, device=w.device) for w in row]
                     for row in taps]  # dW_j^T accumulators
        grad_conv_bias = grad_out.new_zeros(dim)
        grad_bn_weight, grad_bn_bias = grad_out.new_empty(length), grad_out.new_empty(length)
        carried = None  # the incoming gradient of the rows [start - k//2, start), kept before they were overwritten
        for start in range(0, length, STEM_TILE):
            stop = min(start + STEM_TILE, length)
            # the input rows [start, stop) take the conv gradient of the output rows up to k//2 beyond
            # the tile: their BatchNorm backward (local to each position) is computed here as well
            lo, hi = max(0, start - half), min(length, stop + half)
            tile_centred = conv[:, lo:hi]
            if reduced:
                # conversion, bias and centring in one pass (promoted to x's dtype)
                tile_centred = torch.sub(tile_centred, mean[lo:hi, None] - conv_bias)
            tile_rstd, tile_count = rstd[lo:hi], count[lo:hi]
            # the gradient of the BatchNorm output is grad_y * factor: the dropout's 1/(1-p) goes on the
            # per-position sums and scale below instead of a pass over grad_y
            incoming = grad_out[:, lo:hi] if carried is None else torch.cat([carried, grad_out[:, start:hi]], 1)
            grad_y = incoming * mask_factor(passes[:, lo:hi], grad_out.dtype)
            if overwrite and half and stop < length:
                carried = grad_out[:, stop - half:stop].clone()
            # masked BatchNorm backward (see _MaskedBatchNormTrain)
            sum_grad = grad_y.sum((0, 2)) * factor
            sum_grad_centred = (grad_y * tile_centred).sum((0, 2)) * factor
            grad_bn_bias[start:stop] = sum_grad[start - lo:stop - lo]
            grad_bn_weight[start:stop] = (sum_grad_centred * tile_rstd)[start - lo:stop - lo]
            scale = bn_weight[lo:hi] * tile_rstd
            a = -scale * sum_grad / tile_count
            b = -scale * tile_rstd.square() * sum_grad_centred / tile_count
            correction = torch.addcmul(a[None, :, None], tile_centred, b[None, :, None])
            if valid is not None:
                correction *= mask_factor(valid[:, lo:hi, None], correction.dtype)
            grad_h = correction.addcmul_(grad_y, (scale * factor)[None, :, None])  # output rows [lo, hi)
            grad_conv_bias += grad_h[:, start - lo:stop - lo].sum((0, 1))
            sources, firsts = inputs, None
            if inputs[-1].dtype != gemm_dtype:  # x's rows in the GEMM dtype, as the forward's im2col copy made them
                sources, firsts = [*inputs[:-1], inputs[-1][:, lo:hi].to(gemm_dtype)], [0] * (n_inputs - 1) + [lo]
            _stem_conv_tile_backward(grad_h.to(gemm_dtype), lo, sources, taps, grad_inputs, grad_taps, start, stop,
                                     back_stacked, firsts)
        grad_conv_weight = torch.stack([torch.cat([g.t() for g in row], dim=1) for row in grad_taps], dim=-1)
        grad_x = grad_inputs[-1]
        grad_frequency_weight = None
        if n_inputs == 2:
            grad_smoothed = grad_inputs[0].transpose(1, 2)  # [B, dim, N], channel-first in memory
            if valid is not None:  # X^smooth was zeroed there
                grad_smoothed *= mask_factor(valid[:, None, :], grad_smoothed.dtype)
            grad_frequency_weight = _fourier_backward(grad_smoothed, grad_x, spectrum, weight, grad_weight, *fourier)
        return (grad_x, grad_frequency_weight, grad_conv_weight.to(conv_weight.dtype),
                grad_conv_bias, grad_bn_weight, grad_bn_bias, None, None, None, None, None, None, None)


# One block of the Fourier convolution's feature columns (its spectrum and transform) holds at most
# this many bytes: below glibc's largest mmap threshold (32 MiB), so at long lengths the blocks are
# recycled from the heap instead of being mapped and faulted in afresh, and they stay near the cache.
FOURIER_BLOCK_BYTES = 16 << 20
# norm of torch.fft's forward transform whose scaling is that of the inverse transform under ``norm``
# (the adjoint of irfft is an rfft with irfft's scaling, and the other way round)
_ADJOINT_NORM = {"backward": "forward", "forward": "backward", "ortho": "ortho"}


def _fourier_blocks(batch: int, max_len: int, dim: int, segments: int, itemsize: int) -> list[tuple[int, int, int]]:
    """(first column, columns, segments spanned) of the column blocks: each lies inside one segment or
    covers whole segments, and holds about FOURIER_BLOCK_BYTES."""
    width = dim // segments
    budget = max(1, FOURIER_BLOCK_BYTES // (batch * max_len * itemsize))
    if budget >= width:
        spanned = max(k for k in range(1, segments + 1) if segments % k == 0 and k * width <= budget)
        columns = spanned * width
    else:
        columns = max(c for c in range(1, width + 1) if width % c == 0 and c <= budget)
    return [(start, columns, max(1, columns // width)) for start in range(0, dim, columns)]


def _fourier_forward(x: Tensor, frequency_weight: Tensor, valid: Tensor | None, max_len: int, segments: int,
                     norm: str, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """X^smooth of eq. (5) from x (zero at padded tokens), by column blocks; the same numbers as
    ``Smoother._fourier_smooth``. Returns it (in ``out_dtype``, default x's), zeroed at padded
    positions, and (kept for backward) the segments' spectrum [B, r, F] and the complex frequency
    weights [dim, F], both channel-first."""
    batch, length, dim = x.shape
    width = dim // segments
    spectrum = torch.fft.rfft(x.reshape(batch, length, segments, width).mean(-1), n=max_len, dim=1, norm=norm)
    # channel-first, like the gradient in backward: each block's irfft runs along contiguous rows and
    # is copied into whole rows, and its product reads contiguous rows of the weights and spectrum
    # (a few columns of a token-major [B, N, dim] or [F, dim] array touch every cache line of it once
    # per block, and products with such strided factors are several times slower on CPU)
    weight_t = torch.view_as_complex(frequency_weight).t().contiguous()  # [dim, F]: a view of the parameter
    spectrum_t = spectrum.transpose(1, 2).contiguous()  # [B, r, F]
    smoothed = x.new_empty(batch, dim, length, dtype=out_dtype or x.dtype)
    for start, columns, spanned in _fourier_blocks(batch, max_len, dim, segments, x.element_size()):
        first = start // width
        block_weight = weight_t[start:start + columns].view(spanned, columns // spanned, -1)
        product = spectrum_t.new_empty(batch, spanned, columns // spanned, spectrum_t.shape[-1])
        torch.mul(block_weight, spectrum_t[:, first:first + spanned, None, :], out=product)
        smoothed[:, start:start + columns] = torch.fft.irfft(product.view(batch, columns, -1), n=max_len, dim=-1,
                                                             norm=norm)[..., :length]
    smoothed = smoothed.transpose(1, 2)  # [B, N, dim], channel-first in memory
    if valid is not None:
        smoothed *= mask_factor(valid[..., None], smoothed.dtype)
    return smoothed, spectrum_t, weight_t


def _fourier_gradient_buffers(batch: int, length: int, weight_t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The gradient of the frequency weights [dim, F] (complex, the parameter's channel-first layout)
    and a buffer for the gradient of X^smooth in ``dtype``, a [B, N, dim] view laid out [dim, B, N].

    When one feature's rows of the latter (B N entries) take no more bytes than one row of the former
    (F complex weights), as at batch 1, the latter is the tail of the former's memory: _fourier_backward
    turns feature rows of X^smooth's gradient into rows of the weights' gradient in increasing order,
    and the weights' first c rows end at byte c F s_w, no later than where feature c of X^smooth's
    gradient begins, D F s_w - (D - c) B N s (s_w, s the element sizes): every row of it is read before
    anything is written over it. One whole-sequence buffer fewer to fault in."""
    grad_weight = torch.empty(weight_t.shape, dtype=weight_t.dtype, device=weight_t.device)
    dim, frequencies = weight_t.shape
    entries = dim * batch * length
    if batch * length * torch.empty((), dtype=dtype).element_size() <= frequencies * weight_t.element_size():
        flat = grad_weight.view(-1).view(dtype)
        store = flat[flat.numel() - entries:]
    else:
        store = torch.empty((entries,), dtype=dtype, device=weight_t.device)
    return grad_weight, store.view(dim, batch, length).permute(1, 2, 0)


def _fourier_backward(grad_smoothed: Tensor, grad_x: Tensor, spectrum_t: Tensor, weight_t: Tensor,
                      grad_weight: Tensor, max_len: int, segments: int, norm: str) -> Tensor:
    """Backward of _fourier_forward: adds the gradient of x into ``grad_x`` and writes that of the
    frequency weights into ``grad_weight`` (see _fourier_gradient_buffers), returned in the parameter's
    shape. ``grad_smoothed`` is channel-first [B, dim, N] (any dtype: converted block by block to x's),
    ``spectrum_t`` and ``weight_t`` as _fourier_forward returns them. The adjoint of irfft is an rfft
    with irfft's scaling whose bins with a mirror image count twice (as torch's own derivative)."""
    batch, dim, length = grad_smoothed.shape
    width = dim // segments
    mirrored = slice(1, max_len - spectrum_t.shape[-1] + 1)  # bins 1 .. ceil(max_len / 2) - 1
    grad_spectrum = spectrum_t.new_zeros(spectrum_t.shape)
    # the weights' gradient counts the mirrored bins twice, the spectrum's gradient once (the adjoint of
    # the rfft of the zero-padded segment means is the real part of the inverse c2c of the one-sided
    # spectrum, an irfft with the rfft's scaling once the mirrored bins are halved): the doubling goes
    # on the small conjugated spectrum (made once; a product with a lazy conjugate is slower)
    doubled_conj = spectrum_t.conj_physical()
    doubled_conj[..., mirrored] *= 2
    for start, columns, spanned in _fourier_blocks(batch, max_len, dim, segments, grad_x.element_size()):
        first = start // width
        block = grad_smoothed[:, start:start + columns].to(grad_x.dtype)
        grad_product = torch.fft.rfft(block, n=max_len, dim=-1,
                                      norm=_ADJOINT_NORM[norm]).view(batch, spanned, columns // spanned, -1)
        block_spectrum = doubled_conj[:, first:first + spanned, None, :]
        block_grad = grad_weight[start:start + columns].view(spanned, columns // spanned, -1)
        if batch == 1:
            torch.mul(grad_product[0], block_spectrum[0], out=block_grad)
        else:
            torch.sum(grad_product * block_spectrum, 0, out=block_grad)
        # the sum over the segment's columns of grad_product conj(L), accumulated in place one column at
        # a time (no conjugated copy of the block's weights, no [B, r, columns, F] temporary: 2x faster)
        block_weight = weight_t[start:start + columns].view(spanned, columns // spanned, -1)
        block_grad_spectrum = grad_spectrum[:, first:first + spanned]
        for column in range(columns // spanned):
            block_grad_spectrum.addcmul_(grad_product[:, :, column], block_weight[:, column].conj())
    grad_means = torch.fft.irfft(grad_spectrum, n=max_len, dim=-1, norm=_ADJOINT_NORM[norm])[..., :length]
    grad_x.view(batch, length, segments, width).add_(grad_means.transpose(1, 2)[..., None], alpha=1.0 / width)
    return torch.view_as_real(grad_weight.t())  # [F, dim, 2] with the parameter's strides


def _stem_taps(conv_weight: Tensor, n_inputs: int, dtype: torch.dtype, transpose: bool = True) -> list[list[Tensor]]:
    """Conv1d weight [dim, n_inputs * dim_in, k] -> per tap, per input, W^T [dim_in, dim] (or W)."""
    per_input = conv_weight.to(dtype).chunk(n_inputs, dim=1)
    return [[(w[:, :, j].t() if transpose else w[:, :, j]).contiguous() for w in per_input]
            for j in range(conv_weight.shape[-1])]


def _tap_rows(offset: int, start: int, stop: int, length: int) -> tuple[int, int]:
    """Output rows [lo, hi) of the tile whose tap input row n + offset lies inside the sequence."""
    return max(start, -offset), min(stop, length - offset)


def _stem_conv_tile(inputs: list[Tensor], taps: list[list[Tensor]], start: int, out: Tensor) -> None:
    """Conv1d output rows [start, start + T) without the bias, token-major, written into ``out``
    [B, T, dim]: k GEMMs per input, the centre tap (which covers every row) first."""
    batch, length, _ = inputs[0].shape
    stop = start + out.shape[1]
    half = len(taps) // 2
    for j in [half] + [j for j in range(len(taps)) if j != half]:
        lo, hi = _tap_rows(j - half, start, stop, length)
        if lo >= hi:
            continue
        for i, (source, weight_t) in enumerate(zip(inputs, taps[j])):
            for b in range(batch):
                _add_product(out[b, lo - start:hi - start], source[b, lo + j - half:hi + j - half], weight_t,
                             overwrite=j == half and i == 0)


def _stacked_taps(conv_weight: Tensor, n_inputs: int) -> Tensor:
    """Conv1d weight [dim, n_inputs * dim_in, k] -> [n_inputs * k * dim_in, dim], the rows in the
    order of _stem_conv_tile_im2col's columns (input, then tap, then channel)."""
    dim, channels, k = conv_weight.shape
    return conv_weight.view(dim, n_inputs, channels // n_inputs, k).permute(1, 3, 2, 0).reshape(-1, dim)


def _needs_halo(length: int, start: int, tile: int, half: int) -> bool:
    """Whether the rows [start - half, start + tile + half) reach beyond a sequence of ``length``."""
    return start - half < 0 or start + tile + half > length


def _stem_conv_tile_im2col(inputs: list[Tensor], stacked: Tensor, k: int, start: int, out: Tensor) -> None:
    """Conv1d output rows [start, start + T) without the bias, written into ``out`` [B, T, dim] by
    one GEMM per batch element over the tile's im2col matrix [T, n_inputs * k * dim_in]: row n
    holds input rows n - k//2 .. n + k//2 of every input (zeros beyond the sequence). Each input's
    rows are first copied into one token-major tile with k//2 rows of halo on each side (X^smooth
    is channel-first: transposed by a GEMM with the identity), whose k-row windows are then strided
    views."""
    batch, length, dim_in = inputs[0].shape
    tile = out.shape[1]
    stop, half = start + tile, k // 2
    lo, hi = max(0, start - half), min(length, stop + half)
    halo = out.new_zeros(tile + 2 * half, dim_in) if _needs_halo(length, start, tile, half) else None
    columns = out.new_empty(tile, len(inputs) * k * dim_in)
    identity = None
    for b in range(batch):
        for i, source in enumerate(inputs):
            rows = halo[lo - (start - half):hi - (start - half)] if halo is not None else None
            if source.stride(1) == 1 and dim_in > 1:  # channel-first: transposed by a GEMM with the identity
                # (exact: one product by 1 per entry; about 3x faster than the strided copy on CPU)
                identity = torch.eye(dim_in, dtype=out.dtype, device=out.device) if identity is None else identity
                rows = torch.mm(source[b, lo:hi].to(out.dtype), identity, out=rows)
            elif rows is None:
                rows = source[b, lo:hi].contiguous()
            else:
                rows.copy_(source[b, lo:hi])
            rows = halo if halo is not None else rows
            windows = rows.as_strided((tile, k * dim_in), (dim_in, 1))
            columns[:, i * k * dim_in:(i + 1) * k * dim_in] = windows
        torch.mm(columns, stacked, out=out[b])


def _backward_stacked_taps(conv_weight: Tensor, dtype: torch.dtype) -> Tensor:
    """Conv1d weight [dim, n_inputs * dim_in, k] -> [k * dim, n_inputs * dim_in]: block p of rows is
    W_{k-1-p}, the tap through which output row m - k//2 + p reads input row m."""
    dim, channels, k = conv_weight.shape
    return conv_weight.flip(-1).permute(2, 0, 1).reshape(k * dim, channels).to(dtype)


def _stem_input_grads_im2col(grad_h: Tensor, first: int, back_stacked: Tensor, grad_inputs: list[Tensor],
                             start: int, stop: int) -> None:
    """Write the input gradients of the rows [start, stop) by one GEMM per batch element: the k-row
    windows of the conv gradient (a strided view of a token-major tile with k//2 halo rows, zeros beyond
    the sequence) [T, k dim] times ``back_stacked`` (_backward_stacked_taps), so the product is rounded
    once (with reduced-precision factors) and written once per input."""
    length, dim_in = grad_inputs[0].shape[1:]
    tile, dim = stop - start, grad_h.shape[-1]
    half = back_stacked.shape[0] // dim // 2
    halo = grad_h.new_zeros(tile + 2 * half, dim) if _needs_halo(length, start, tile, half) else None
    for b in range(grad_h.shape[0]):
        rows = grad_h[b]  # output rows [first, first + len), exactly the tile's windows when no halo is needed
        if halo is not None:
            halo[first - (start - half):first - (start - half) + grad_h.shape[1]] = rows
            rows = halo
        product = rows.as_strided((tile, back_stacked.shape[0]), (dim, 1)) @ back_stacked  # [T, n_inputs dim_in]
        for i, grad_source in enumerate(grad_inputs):
            grad_source[b, start:stop] = product[:, i * dim_in:(i + 1) * dim_in]


def _stem_conv_tile_backward(grad_h: Tensor, first: int, inputs: list[Tensor], taps: list[list[Tensor]],
                             grad_inputs: list[Tensor], grad_taps: list[list[Tensor]], start: int, stop: int,
                             back_stacked: Tensor | None = None, input_firsts: list[int] | None = None) -> None:
    """Write the input gradients of the rows [start, stop) and accumulate the weight gradients of the
    conv rows [start, stop) (token-major GEMMs). ``grad_h`` holds the conv gradient of the output rows
    from ``first`` on, k//2 rows beyond the tile on each side (where the sequence has them). With
    ``back_stacked`` the input gradients come from _stem_input_grads_im2col. ``input_firsts``: the
    sequence row of each input's first row (default 0: whole sequences; an input may hold only the
    rows [start - k//2, stop + k//2) the weight gradient reads)."""
    batch, length, _ = grad_inputs[-1].shape
    input_firsts = input_firsts or [0] * len(inputs)
    half = len(taps) // 2
    if back_stacked is not None:
        _stem_input_grads_im2col(grad_h, first, back_stacked, grad_inputs, start, stop)
    # the centre tap covers every row of the tile: it writes them, the others add
    for j in [half] + [j for j in range(len(taps)) if j != half]:
        offset = j - half
        if back_stacked is None:  # input row m takes the gradient of output row m - offset
            lo, hi = max(start, offset), min(stop, length + offset)
            for weight, grad_source in zip(taps[j], grad_inputs):
                for b in range(batch):
                    g = grad_h[b, lo - offset - first:hi - offset - first]
                    _add_product(grad_source[b, lo:hi], g, weight, overwrite=j == half)
        lo, hi = _tap_rows(offset, start, stop, length)
        if lo >= hi:
            continue
        for source, source_first, grad_weight_t in zip(inputs, input_firsts, grad_taps[j]):
            rows = slice(lo + offset - source_first, hi + offset - source_first)
            for b in range(batch):
                _add_product(grad_weight_t, source[b, rows].t(), grad_h[b, lo - first:hi - first])


def _add_product(out: Tensor, a: Tensor, b: Tensor, overwrite: bool = False) -> None:
    """out += a @ b in place (out = a @ b with ``overwrite``); with reduced-precision factors the
    product (accumulated in float32 by the GEMM) is rounded once to their dtype and added in
    ``out``'s precision."""
    if a.dtype == out.dtype:
        if overwrite:
            torch.mm(a, b, out=out)
        else:
            out.addmm_(a, b)
    else:
        out.copy_(a @ b) if overwrite else out.add_(a @ b)


# ------------------------------------------------------------------------------ GPU path
# The Smoother on a GPU (Smoother._gpu_forward): one batched program for any batch and length, no host
# synchronisation, autocast-native. The fused steps of its stem have two implementations with the same
# signatures: TorchStemSteps below (plain PyTorch: the reference, and the path without Triton) and the
# Triton kernels of _smoother_triton.TritonStemSteps.

# dtypes the Triton kernels take (float64 runs the PyTorch steps)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class StemConfig(NamedTuple):
    """What the stem steps need to know besides tensors."""

    kernel_size: int
    over: str  # "positions" or "features": the BatchNorm channels
    activation: str
    dropout_p: float  # the rate of the given keep mask (its kept entries are scaled by 1 / (1 - p))
    eps: float
    training: bool  # batch statistics (True) or the running ones
    gemm_dtype: torch.dtype  # the convolution's factors, the stored X^smooth/x and conv output
    out_dtype: torch.dtype  # the Smoother's output (the autocast dtype under autocast)

    @property
    def stats_dtype(self) -> torch.dtype:
        return compute_dtype(self.gemm_dtype)


def no_autocast(t: Tensor):
    """Autocast off for products whose dtypes are chosen explicitly."""
    if t.device.type in ("cpu", "cuda"):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def exact_products(dtype: torch.dtype):
    """float32 products in float32 (TF32 off, see full_float32); nothing to do for other dtypes."""
    return full_float32() if dtype == torch.float32 else contextlib.nullcontext()


def activation_grad(y: Tensor, activation: str) -> Tensor:
    """d act(y) / dy for the stem's activations (ReLU's derivative is 0 at 0, as torch's)."""
    if activation == "relu":
        return (y > 0).to(y.dtype)
    if activation == "elu":
        return torch.where(y > 0, torch.ones_like(y), torch.exp(y))
    return 0.5 * (1.0 + torch.erf(y * _SQRT_HALF)) + y * torch.exp(-0.5 * y.square()) * _INV_SQRT_2PI


class TorchStemSteps:
    """The GPU path's Smoother steps in plain PyTorch. Sequences are [B, N, ·] tensors, ``mask`` a bool
    [B, N] (True = real token) or None; per-channel vectors (BatchNorm statistics and affine parameters)
    are indexed by position (``over="positions"``, [N]) or by feature (``over="features"``, [dim])."""

    @staticmethod
    def segment_mean(x: Tensor, mask: Tensor | None, segments: int, dtype: torch.dtype) -> Tensor:
        """X S of eq. (6) in compact form, [B, N, r] in ``dtype``, padded tokens as zeros (even NaN ones)."""
        batch, length, dim = x.shape
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0)
        return x.to(dtype).view(batch, length, segments, dim // segments).mean(-1)

    @staticmethod
    def stem_input(x: Tensor, smoothed: Tensor | None, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
        """The stem's input [X^smooth, X] ([B, N, 2 dim], or X alone) in ``dtype``, zero at padded tokens."""
        parts = [t for t in (smoothed, x) if t is not None]
        if mask is not None:
            parts = [t.masked_fill(~mask[..., None], 0) for t in parts]
        return torch.cat([t.to(dtype) for t in parts], -1)

    @staticmethod
    def stem_input_backward(grad: Tensor, mask: Tensor | None, has_smoothed: bool,
                            dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[Tensor | None, Tensor]:
        """(gradient of X^smooth or None, gradient of X) from that of the stem input, zero at padded tokens,
        in ``dtypes`` (those of X^smooth and X)."""
        if mask is not None:
            grad = grad.masked_fill(~mask[..., None], 0)
        if not has_smoothed:
            return None, grad.to(dtypes[1])
        dim = grad.shape[-1] // 2
        return grad[..., :dim].to(dtypes[0]), grad[..., dim:].to(dtypes[1])

    @staticmethod
    def shift_sum(taps_out: Tensor, bias: Tensor, mask: Tensor | None,
                  cfg: StemConfig) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """The Conv1d output h[n] = bias + sum_j Y_j[n + j - k//2] from every tap's product Y = [Y_0 .. Y_{k-1}]
        ([B, N, k dim]; zero beyond the sequence), stored in the GEMM dtype, and in training its masked
        BatchNorm statistics (mean, biased variance, count of real entries per channel) taken from the
        stored values."""
        batch, length, width = taps_out.shape
        k = cfg.kernel_size
        half, dim = k // 2, width // k
        taps = taps_out.view(batch, length, k, dim)
        h = taps[:, :, half].to(cfg.stats_dtype) + bias.to(cfg.stats_dtype)
        for j in range(k):  # one shifted add per tap of the kernel
            offset = j - half
            lo, hi = max(0, -offset), min(length, length - offset)
            if j != half and lo < hi:
                h[:, lo:hi] += taps[:, lo + offset:hi + offset, j]
        h = h.to(cfg.gemm_dtype)
        if not cfg.training:
            return h, None, None, None
        return (h, *_masked_moments(h.to(cfg.stats_dtype), mask, cfg.over))

    @staticmethod
    def normalise(h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, keep: Tensor | None,
                  mask: Tensor | None, cfg: StemConfig) -> Tensor:
        """BatchNorm with the given statistics, activation, dropout (``keep``) and zero padding, in the output dtype."""
        y, _ = _batchnorm_affine(h, mean, rstd, weight, bias, cfg)
        out = _ACTIVATIONS[cfg.activation](y)
        factor = _pass_factor(keep, mask, cfg)
        return (out if factor is None else out * factor).to(cfg.out_dtype)

    @staticmethod
    def backward_sums(grad: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor,
                      keep: Tensor | None, mask: Tensor | None, cfg: StemConfig) -> tuple[Tensor, Tensor]:
        """Per channel sum(dy) and sum(dy xhat), dy the gradient of the BatchNorm output: the gradients of its
        bias and weight, and the two sums its batch-statistics backward needs."""
        dy, xhat = _batchnorm_output_grad(grad, h, mean, rstd, weight, bias, keep, mask, cfg)
        dims = _reduce_dims(cfg.over)
        return dy.sum(dims), (dy * xhat).sum(dims)

    @staticmethod
    def backward_input(grad: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor,
                       keep: Tensor | None, mask: Tensor | None, sums: tuple[Tensor, Tensor] | None,
                       count: Tensor | None, cfg: StemConfig) -> tuple[Tensor, Tensor]:
        """The gradient dh of the conv output, returned as D = [D_0 .. D_{k-1}] ([B, N, k dim], GEMM dtype) with
        D_j[m] = dh[m - j + k//2] (zero beyond the sequence), so that the input gradient is one GEMM D W^T;
        and the conv bias gradient sum(dh). ``sums`` (training): backward_sums' output, for the batch
        statistics' part; None uses the running statistics' (constant) BatchNorm."""
        dy, xhat = _batchnorm_output_grad(grad, h, mean, rstd, weight, bias, keep, mask, cfg)
        shape = _channel_shape(cfg.over, h)
        scale = (weight.to(dy.dtype) * rstd).view(shape)
        if sums is None:
            dh = dy * scale
        else:
            safe = count.clamp_min(1)
            dh = scale * (dy - (sums[0] / safe).view(shape) - xhat * (sums[1] / safe).view(shape))
            if mask is not None:
                dh = dh * mask[..., None].to(dh.dtype)
        batch, length, dim = h.shape
        k = cfg.kernel_size
        half = k // 2
        shifted = h.new_zeros(batch, length, k, dim, dtype=cfg.gemm_dtype)
        for j in range(k):  # one shifted copy per tap
            offset = j - half
            lo, hi = max(0, offset), min(length, length + offset)
            if lo < hi:
                shifted[:, lo:hi, j] = dh[:, lo - offset:hi - offset]
        return shifted.view(batch, length, k * dim), dh.sum((0, 1))


def _reduce_dims(over: str) -> tuple[int, int]:
    return (0, 2) if over == "positions" else (0, 1)


def _channel_shape(over: str, h: Tensor) -> tuple[int, int, int]:
    return (1, h.shape[1], 1) if over == "positions" else (1, 1, h.shape[2])


def _masked_moments(h: Tensor, mask: Tensor | None, over: str) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel mean, biased variance and count over the real tokens of h."""
    dims = _reduce_dims(over)
    batch, length, dim = h.shape
    if mask is None:
        var, mean = torch.var_mean(h, dims, correction=0)
        return mean, var, h.new_full(mean.shape, batch * (dim if over == "positions" else length))
    real = mask[..., None].to(h.dtype)
    count = real.sum(dims) * dim if over == "positions" else real.sum(dims).expand(dim)
    safe = count.clamp_min(1)
    mean = (h * real).sum(dims) / safe
    var = ((h - mean.view(_channel_shape(over, h))).square() * real).sum(dims) / safe
    return mean, var, count


def _batchnorm_affine(h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor,
                      cfg: StemConfig) -> tuple[Tensor, Tensor]:
    """(y, xhat): xhat = (h - mean) rstd and the BatchNorm output y = xhat weight + bias, in the statistics' dtype."""
    shape = _channel_shape(cfg.over, h)
    xhat = (h.to(cfg.stats_dtype) - mean.view(shape)) * rstd.view(shape)
    return xhat * weight.to(xhat.dtype).view(shape) + bias.to(xhat.dtype).view(shape), xhat


def _pass_factor(keep: Tensor | None, mask: Tensor | None, cfg: StemConfig) -> Tensor | None:
    """Dropout (kept entries scaled by 1 / (1 - p)) and zero padding as one factor, or None."""
    factor = None
    if keep is not None:
        factor = keep.to(cfg.stats_dtype) * (1.0 / (1.0 - cfg.dropout_p))
    if mask is not None:
        real = mask[..., None].to(cfg.stats_dtype)
        factor = real if factor is None else factor * real
    return factor


def _batchnorm_output_grad(grad: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor,
                           keep: Tensor | None, mask: Tensor | None, cfg: StemConfig) -> tuple[Tensor, Tensor]:
    """(dy, xhat): the gradient of the BatchNorm output through zero padding, dropout and the activation."""
    y, xhat = _batchnorm_affine(h, mean, rstd, weight, bias, cfg)
    dy = grad.to(y.dtype) * activation_grad(y, cfg.activation)
    factor = _pass_factor(keep, mask, cfg)
    return (dy if factor is None else dy * factor), xhat


def stem_steps(x: Tensor, gemm_dtype: torch.dtype):
    """The Triton stem steps where the kernels run for ``x`` and both dtypes are theirs, else TorchStemSteps."""
    if x.dtype in KERNEL_DTYPES and gemm_dtype in KERNEL_DTYPES and triton_runs_on(x):
        from longattn.attention import _smoother_triton

        return _smoother_triton.TritonStemSteps
    return TorchStemSteps


class _StemInput(torch.autograd.Function):
    """The stem's input [X^smooth, X] in the GEMM dtype, zero at padded tokens (``steps.stem_input``). Its own
    function so that the float32 X^smooth is freed before the convolution's GEMM output is allocated."""

    @staticmethod
    def forward(ctx, x, smoothed, mask, dtype, steps):  # type: ignore[override]
        ctx.save_for_backward(mask)
        ctx.config = (steps, smoothed is not None, (x.dtype if smoothed is None else smoothed.dtype, x.dtype))
        return steps.stem_input(x, smoothed, mask, dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        steps, has_smoothed, dtypes = ctx.config
        grad_smoothed, grad_x = steps.stem_input_backward(grad, mask, has_smoothed, dtypes)
        return grad_x, grad_smoothed, None, None, None


class _StemConvolution(torch.autograd.Function):
    """The convolution stem on the GPU path after its input: Conv1d (kernel k, Section 3.2.2) -> masked BatchNorm
    -> activation -> dropout -> zero padding, with a hand-written backward.

    The convolution is GEMMs over all B N tokens at once. Forward: Y = inp [W_0 .. W_{k-1}] (every tap's
    product in one [B N, C] x [C, k dim] GEMM, W_j = W[:, :, j]^T) and h[n] = bias + sum_j Y_j[n + j - k//2]
    (``steps.shift_sum``, with the BatchNorm statistics). Backward: with D_j[m] = dh[m - j + k//2] side by
    side (``steps.backward_input``), d inp = D [W_0 .. W_{k-1}]^T and d[W_0 .. W_{k-1}] = inp^T D, two GEMMs.
    GEMMs take the GEMM dtype (the autocast dtype under autocast; float32 ones with TF32 off, forward and
    backward); statistics, normalisation and activation run in float32 (float64 for float64). Saved for
    backward: the stem input and conv output in the GEMM dtype, the per-channel statistics and the
    dropout mask. ``on_statistics(mean, var, count)`` receives the batch statistics in training."""

    @staticmethod
    def forward(ctx, inp, conv_weight, conv_bias, bn_weight, bn_bias, mask, keep, running_mean, running_var, cfg,
                steps, on_statistics):  # type: ignore[override]
        batch, length, channels = inp.shape
        with no_autocast(inp):
            taps = conv_weight.permute(1, 2, 0).reshape(channels, -1).to(cfg.gemm_dtype)  # column j dim + o: W[o, :, j]
            with exact_products(cfg.gemm_dtype):
                taps_out = torch.mm(inp.view(-1, channels), taps).view(batch, length, -1)
            h, mean, var, count = steps.shift_sum(taps_out, conv_bias, mask, cfg)
            del taps_out
            if cfg.training:
                on_statistics(mean, var, count)
            else:
                mean, var = running_mean.to(cfg.stats_dtype), running_var.to(cfg.stats_dtype)
            rstd = torch.rsqrt(var + cfg.eps)
            out = steps.normalise(h, mean, rstd, bn_weight, bn_bias, keep, mask, cfg)
        ctx.save_for_backward(inp, h, mean, rstd, count, bn_weight, bn_bias, taps, keep, mask)
        ctx.config = (cfg, steps)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        inp, h, mean, rstd, count, bn_weight, bn_bias, taps, keep, mask = ctx.saved_tensors
        cfg, steps = ctx.config
        channels, dim, k = inp.shape[-1], h.shape[-1], cfg.kernel_size
        with no_autocast(grad):
            sums = steps.backward_sums(grad, h, mean, rstd, bn_weight, bn_bias, keep, mask, cfg)
            shifted, grad_conv_bias = steps.backward_input(grad, h, mean, rstd, bn_weight, bn_bias, keep, mask,
                                                           sums if cfg.training else None, count, cfg)
            flat = shifted.view(-1, k * dim)
            with exact_products(cfg.gemm_dtype):
                grad_inp = torch.mm(flat, taps.t()).view(inp.shape) if ctx.needs_input_grad[0] else None
                grad_taps = torch.mm(inp.view(-1, channels).t(), flat)
        grad_conv_weight = grad_taps.view(channels, k, dim).permute(2, 0, 1)
        return (grad_inp, grad_conv_weight, grad_conv_bias, sums[1], sums[0], None, None, None, None, None, None,
                None)


class MaskedBatchNorm(nn.Module):
    """BatchNorm over [B, N, C] whose statistics ignore padded tokens.

    ``over="positions"``: one channel per sequence position (``num_channels = max_len``), the
    statistics of position p are taken over the batch and the features, as the authors'
    ``BatchNorm1d(seq_len)`` on a [B, seq_len, dim] tensor does. ``over="features"``: the usual
    one channel per feature, statistics over batch and positions. Training updates the running
    statistics (momentum, unbiased variance) like ``nn.BatchNorm1d``; channels with no real
    token in the batch keep their running statistics. Eval mode uses the running statistics.
    """

    def __init__(self, num_channels: int, over: str, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        if over not in _BATCHNORM_AXES:
            raise AttentionError(f"batchnorm_over must be one of {_BATCHNORM_AXES}, got {over!r}")
        self.over = over
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.register_buffer("running_mean", torch.zeros(num_channels))
        self.register_buffer("running_var", torch.ones(num_channels))

    def forward(self, h: Tensor, valid: Tensor, offset: int = 0) -> Tensor:
        """``h``: [B, N, C]; ``valid``: float [B, N] with 1 = real token. Returns [B, N, C].

        ``offset``: position of h's first token in the sequence (a shard of a sequence split
        across processes); with ``over="positions"`` it selects the channels of h's positions."""
        n = h.shape[1]
        if self.over == "positions":
            reduce_dims, channel_shape = (0, 2), (1, n, 1)
            positions = slice(offset, offset + n)
            weight, bias = self.weight[positions], self.bias[positions]
            running_mean, running_var = self.running_mean[positions], self.running_var[positions]
            count = valid.sum(0) * h.shape[2]  # [N]
        else:
            reduce_dims, channel_shape = (0, 1), (1, 1, h.shape[2])
            weight, bias = self.weight, self.bias
            running_mean, running_var = self.running_mean, self.running_var
            count = valid.sum().expand(h.shape[2])  # [C]
        if self.training:
            # statistics of half inputs in float32: 1 / (var + eps) alone passes float16's range
            # for a (nearly) constant channel, and the backward uses its square
            stats_dtype = compute_dtype(h.dtype)
            safe_count = count.clamp_min(1).to(stats_dtype)
            out, mean, var = _MaskedBatchNormTrain.apply(
                h.to(stats_dtype), valid.unsqueeze(-1).to(stats_dtype), safe_count, weight.to(stats_dtype),
                bias.to(stats_dtype), reduce_dims, channel_shape, self.eps,
            )
            self.update_running_statistics(mean, var, count, running_mean, running_var)
            return out.to(h.dtype)
        mean, var = running_mean.to(h.dtype), running_var.to(h.dtype)
        scale = weight.to(h.dtype) * torch.rsqrt(var + self.eps)
        return (h - mean.view(channel_shape)) * scale.view(channel_shape) + bias.to(h.dtype).view(channel_shape)

    @torch.no_grad()
    def update_running_statistics(self, mean: Tensor, var: Tensor, count: Tensor, running_mean: Tensor,
                                  running_var: Tensor) -> None:
        """Momentum update with the unbiased variance; channels with no real token (count 0) keep theirs."""
        safe_count = count.clamp_min(1).to(var.dtype)
        unbiased = var * safe_count / (safe_count - 1).clamp_min(1)
        new_mean = torch.lerp(running_mean, mean.to(running_mean.dtype), self.momentum)
        new_var = torch.lerp(running_var, unbiased.to(running_var.dtype), self.momentum)
        seen = count > 0
        running_mean.copy_(torch.where(seen, new_mean, running_mean))
        running_var.copy_(torch.where(seen, new_var, running_var))

    def extra_repr(self) -> str:
        return f"channels={self.weight.numel()}, over={self.over!r}, eps={self.eps}, momentum={self.momentum}"


class Smoother(nn.Module):
    """SKTformer's Smoother: segment average, Fourier convolution, convolution stem (Algorithm 2).

    Args:
        dim: feature size of the tokens.
        max_len: longest sequence; the FFT length and the size of the frequency weights
            (``max_len // 2 + 1`` complex weights per feature) and of the position BatchNorm.
        segments: r of eq. (5-6), the number of feature groups averaged; must divide ``dim``.
            Paper default 8 (Tables 7a, 8).
        kernel_size: kernel of the stem's Conv1d (paper 3; the authors' LRA code uses 1). Odd.
        activation: "relu" (paper), "elu" (authors' LRA and time-series code) or "gelu".
        segment_average: False skips eq. (6), i.e. r = dim (authors' LRA code).
        fourier: the Fourier convolution (Table 6 "Fourier Conv."); False feeds the stem X alone.
        conv_stem: the Conv1d + BatchNorm + activation stem (Table 6 "Conv Stem"); False returns
            X^smooth (after dropout) instead.
        dropout: dropout on the output (Algorithm 2 default 0.5; Table 8 uses 0-0.5 per task).
        fft_norm: ``norm`` of both torch.fft.rfft and irfft ("backward", "ortho", "forward").
            Used on both transforms the round trip is the same linear map for every choice; the
            option exists for fidelity with the authors' time-series code.
        batchnorm_over: "positions" (authors' code: BatchNorm1d(max_len) over [B, N, dim]) or
            "features" (the usual BatchNorm over feature channels).
        precision: "full" (GEMMs in the input's dtype) or "bf16" (the fused stem's GEMMs take
            bfloat16 factors and accumulate in float32; X^smooth, the conv output and the gradient
            of X^smooth are kept in bfloat16; statistics, FFT, the other gradients and outputs stay
            float32).
    """

    def __init__(
        self,
        dim: int,
        max_len: int,
        segments: int = 8,
        kernel_size: int = 3,
        activation: str = "relu",
        segment_average: bool = True,
        fourier: bool = True,
        conv_stem: bool = True,
        dropout: float = 0.5,
        fft_norm: str = "backward",
        batchnorm_over: str = "positions",
        precision: str = "full",
    ) -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise AttentionError(f"Smoother precision must be one of {PRECISIONS}, got {precision!r}")
        if not isinstance(dim, int) or dim <= 0:
            raise AttentionError(f"Smoother dim must be a positive int, got {dim!r}")
        if not isinstance(max_len, int) or max_len <= 0:
            raise AttentionError(f"Smoother max_len must be a positive int, got {max_len!r}")
        if not (fourier or conv_stem):
            raise AttentionError("Smoother needs at least one of fourier=True or conv_stem=True")
        if segment_average and (not isinstance(segments, int) or segments <= 0 or dim % segments):
            raise AttentionError(
                f"Smoother segments (r) must be a positive divisor of dim={dim}, got {segments!r}; "
                "or pass segment_average=False"
            )
        if not isinstance(kernel_size, int) or kernel_size <= 0 or kernel_size % 2 == 0:
            raise AttentionError(f"Smoother kernel_size must be a positive odd int, got {kernel_size!r}")
        if activation not in _ACTIVATIONS:
            raise AttentionError(f"Smoother activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if fft_norm not in _FFT_NORMS:
            raise AttentionError(f"Smoother fft_norm must be one of {_FFT_NORMS}, got {fft_norm!r}")
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"Smoother dropout must be in [0, 1), got {dropout!r}")
        self.dim = dim
        self.max_len = max_len
        self.segments = segments if segment_average else dim
        self.segment_average = segment_average
        self.kernel_size = kernel_size
        self.activation = activation
        self.fourier = fourier
        self.conv_stem = conv_stem
        self.fft_norm = fft_norm
        self.precision = precision
        # the fused stem in training (see uses_fused_stem); tests switch it off to compare
        self.fused = True
        if fourier:
            # L of eq. (5) stored as (real, imag) pairs; Kaiming-normal with fan_in = 2 * dim as in
            # the paper's Algorithm 2, i.e. std 1/sqrt(dim) per component. Shape [F, dim, 2], laid out
            # channel-first in memory (each feature's F weights contiguous): the Fourier blocks read
            # and write whole rows of it with no transposed copy (see _fourier_forward).
            weight = torch.randn(max_len // 2 + 1, dim, 2) / math.sqrt(dim)
            self.frequency_weight = nn.Parameter(weight.permute(1, 0, 2).contiguous().permute(1, 0, 2))
        if conv_stem:
            in_channels = 2 * dim if fourier else dim
            self.stem_conv = nn.Conv1d(in_channels, dim, kernel_size, padding=kernel_size // 2)
            self.stem_norm = MaskedBatchNorm(max_len if batchnorm_over == "positions" else dim, batchnorm_over)
        self.dropout = nn.Dropout(dropout)  # holds p; applied in _dropout_and_zero_padding

    @classmethod
    def lra_variant(cls, dim: int, max_len: int, **overrides) -> "Smoother":
        """The authors' LRA smoother: no segment average, kernel-1 stem, ELU (paper: r=8, k=3, ReLU)."""
        options = dict(segment_average=False, kernel_size=1, activation="elu")
        options.update(overrides)
        return cls(dim, max_len, **options)

    # ------------------------------------------------------------------------------ pieces
    def _valid(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Check the input; the mask as 0/1 factors in x's dtype (ones without a mask)."""
        self._check(x, attention_mask)
        if attention_mask is None:
            return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
        return attention_mask.to(x.dtype)

    def _check(self, x: Tensor, attention_mask: Tensor | None) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise AttentionError(f"Smoother input must be a [B, N, dim] tensor, got {getattr(x, 'shape', x)!r}")
        if not x.is_floating_point():
            raise AttentionError(f"Smoother input must be floating point, got {x.dtype}")
        b, n, d = x.shape
        if d != self.dim:
            raise AttentionError(f"Smoother input feature size {d} does not match dim={self.dim}")
        if n == 0 or n > self.max_len:
            raise AttentionError(f"Smoother sequence length must be in [1, max_len={self.max_len}], got {n}")
        check_attention_mask(attention_mask, b, n, x.device)

    def segment_average_of(self, x: Tensor) -> Tensor:
        """X S of eq. (6) in compact form: [B, N, dim] -> [B, N, r] (one column per segment)."""
        b, n, d = x.shape
        return x.reshape(b, n, self.segments, d // self.segments).mean(-1)

    def fourier_smooth(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """X^smooth of eq. (5): [B, N, dim] -> [B, N, dim]; padded tokens enter as zeros.

        Public so that Appendix I / Table 14 can measure the incoherence before and after it.
        """
        if not self.fourier:
            raise AttentionError("this Smoother was built with fourier=False")
        valid = self._valid(x, attention_mask)
        return self._fourier_smooth(x * valid.unsqueeze(-1))

    def _fourier_smooth(
        self, x_zeroed: Tensor, offset: int = 0, sum_spectra: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """X^smooth at the rows of ``x_zeroed``. A sequence split across processes (longattn.parallel)
        passes its shard's ``offset`` in the sequence and ``sum_spectra``, an all-reduce: by
        linearity the sequence's spectrum is the sum of the shards' spectra at their positions."""
        b, n, d = x_zeroed.shape
        # torch.fft has no bfloat16 and only power-of-two float16 lengths: run those in float32
        fft_dtype = compute_dtype(x_zeroed.dtype)
        u = self.segment_average_of(x_zeroed.to(fft_dtype))  # [B, N, r]
        if offset:
            u = F.pad(u, (0, 0, offset, 0))  # the shard's tokens at their positions in the sequence
        # FFT at max_len: r transforms instead of d, as XS repeats each segment column (eq. 5).
        u_freq = torch.fft.rfft(u, n=self.max_len, dim=1, norm=self.fft_norm)  # [B, F, r]
        if sum_spectra is not None:
            u_freq = sum_spectra(u_freq)
        repeats = d // self.segments
        weight = torch.view_as_complex(self.frequency_weight.to(fft_dtype))  # [F, d]
        # broadcast each segment's spectrum over its dim/r features inside the product: the
        # result is born contiguous [B, F, r, dim/r] (no expanded copy of u_freq, fwd or bwd)
        product = weight.view(-1, self.segments, repeats) * u_freq.unsqueeze(-1)
        smoothed = torch.fft.irfft(product.reshape(b, -1, d), n=self.max_len, dim=1, norm=self.fft_norm)
        return smoothed[:, offset : offset + n].to(x_zeroed.dtype)

    # ------------------------------------------------------------------------------ forward
    def forward(self, x: Tensor, attention_mask: Tensor | None = None, *, output_grad_private: bool = False) -> Tensor:
        """[B, N, dim] -> [B, N, dim] for any N <= max_len; zeros at padded positions.

        ``output_grad_private``: the caller guarantees that the gradient autograd passes back for the
        output is seen by nothing else (no hook, no retained gradient: the output feeds only the
        caller's own functions); the fused stem then writes the gradient of x over it."""
        self._check(x, attention_mask)
        if uses_gpu_path(x):
            return self._gpu_forward(x, attention_mask)
        # None when every token is real: then no mask is applied anywhere (multiplying by 1 is a no-op)
        real = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
        if real is not None:  # padded contents (even NaN) never enter the FFT or the stem
            x = x.masked_fill(~real[..., None], 0)
        if self.uses_fused_stem(x):
            return self._fused_stem(x, real, output_grad_private)
        smoothed = None
        if self.fourier:
            # zero X^smooth at padded positions too: the stem's kernel must not read the
            # convolution's spill-over into padding (keeps N < max_len == padded to max_len)
            smoothed = self._fourier_smooth(x)
            if real is not None:
                smoothed = smoothed.masked_fill(~real[..., None], 0)
        keep = x.new_ones(x.shape[:2]) if real is None else real.to(x.dtype)
        if smoothed is not None and not self.conv_stem:
            return self._dropout_and_zero_padding(smoothed, keep.unsqueeze(-1))
        return self._stem(smoothed, x, keep)

    def uses_fused_stem(self, x: Tensor) -> bool:
        """Training with the paper's stem (ReLU, BatchNorm over positions) in float32/float64
        runs through ``_FusedReluStem``; everything else through the module-by-module path."""
        return (self.fused and self.training and self.conv_stem and self.activation == "relu"
                and self.stem_norm.over == "positions" and x.dtype in (torch.float32, torch.float64))

    def _stem(self, smoothed: Tensor | None, x: Tensor, keep: Tensor) -> Tensor:
        """The stem module by module (the reference of the fused path): Conv1d, MaskedBatchNorm,
        activation, dropout and zero padding."""
        if smoothed is not None:
            # concatenated straight into Conv1d's channel-first layout [B, 2 dim, N]: one pass,
            # and the convolution (forward and backward) needs no contiguous copy of its input
            stem_in = torch.cat((smoothed.transpose(1, 2), x.transpose(1, 2)), dim=1)
        else:
            stem_in = x.transpose(1, 2).contiguous()
        h = self.stem_conv(stem_in).transpose(1, 2)  # [B, N, dim] view of a [B, dim, N] tensor
        h = self.stem_norm(h, keep)
        h = _ACTIVATIONS[self.activation](h)
        return self._dropout_and_zero_padding(h, keep.unsqueeze(-1))

    def _fused_stem(self, x: Tensor, real: Tensor | None, output_grad_private: bool = False) -> Tensor:
        p = self.dropout.p
        # the same draws as _dropout_and_zero_padding, kept as one bool per entry
        keep = draw_keep(x.shape, p, x.device) if p > 0 else None
        norm, n = self.stem_norm, x.shape[1]
        gemm_dtype = torch.bfloat16 if self.precision == "bf16" else x.dtype
        out, mean, var = _FusedReluStem.apply(
            x, self.frequency_weight if self.fourier else None, self.stem_conv.weight, self.stem_conv.bias,
            norm.weight[:n], norm.bias[:n], real, keep, p, norm.eps, gemm_dtype,
            (self.max_len, self.segments, self.fft_norm), output_grad_private,
        )
        count = x.new_full((n,), x.shape[0] * self.dim) if real is None else real.sum(0).to(x.dtype) * self.dim
        norm.update_running_statistics(mean, var, count, norm.running_mean[:n], norm.running_var[:n])
        return out

    def _gpu_forward(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The GPU path: the same pipeline as one batched program for any batch and length, with no host
        synchronisation (a mask with every token real is used as it is). Output in ``output_dtype(x)``;
        the convolution's GEMMs in that dtype (bfloat16 with ``precision="bf16"`` for float32), the FFT,
        statistics and normalisation in float32 (float64 for float64)."""
        out_dtype = output_dtype(x)
        gemm_dtype = torch.bfloat16 if self.precision == "bf16" and out_dtype == torch.float32 else out_dtype
        p = self.dropout.p if self.training else 0.0
        # drawn first, as one tensor: on a CPU the numbers the CPU paths draw
        keep = torch.rand(x.shape, device=x.device) >= p if p > 0 else None
        steps = stem_steps(x, gemm_dtype)
        smoothed = self._gpu_fourier(x, attention_mask, steps) if self.fourier else None
        if not self.conv_stem:
            cfg = StemConfig(1, "features", "relu", p, 0.0, self.training, gemm_dtype, out_dtype)
            factor = _pass_factor(keep, attention_mask, cfg)
            return (smoothed if factor is None else smoothed * factor).to(out_dtype)
        norm, length = self.stem_norm, x.shape[1]
        channels = slice(0, length) if norm.over == "positions" else slice(None)
        running = norm.running_mean[channels], norm.running_var[channels]
        cfg = StemConfig(self.kernel_size, norm.over, self.activation, p, norm.eps, self.training, gemm_dtype,
                         out_dtype)

        def on_statistics(mean: Tensor, var: Tensor, count: Tensor) -> None:
            norm.update_running_statistics(mean, var, count, *running)

        inp = _StemInput.apply(x, smoothed, attention_mask, gemm_dtype, steps)
        del smoothed  # float32 [B, N, dim]: gone before the convolution's GEMM output exists
        return _StemConvolution.apply(inp, self.stem_conv.weight, self.stem_conv.bias, norm.weight[channels],
                                      norm.bias[channels], attention_mask, keep, *running, cfg, steps, on_statistics)

    def _gpu_fourier(self, x: Tensor, attention_mask: Tensor | None, steps) -> Tensor:
        """X^smooth of eq. (5) on the GPU path, [B, N, dim] in float32 (float64 for float64): the segment means
        (``steps.segment_mean``, padded tokens as zeros), their rFFT at max_len, the product with L and the
        irFFT of the dim columns, each one batched operation (autograd differentiates them). Channel-first
        ([B, dim, F] and [B, dim, max_len], the layout torch's FFTs run in): no transposed copy before or after
        a transform, forward or backward; the result is a [B, N, dim] view of it (the stem input reads it so)."""
        batch, length, dim = x.shape
        fft_dtype = compute_dtype(x.dtype)
        means = steps.segment_mean(x, attention_mask, self.segments, fft_dtype)  # [B, N, r]
        spectrum = torch.fft.rfft(means, n=self.max_len, dim=1, norm=self.fft_norm).transpose(1, 2)  # [B, r, F]
        # L is stored channel-first: its [dim, F] transpose is contiguous
        weight = torch.view_as_complex(self.frequency_weight.to(fft_dtype)).t()
        product = weight.view(self.segments, dim // self.segments, -1) * spectrum.unsqueeze(2)  # [B, r, dim/r, F]
        smoothed = torch.fft.irfft(product.flatten(1, 2), n=self.max_len, dim=-1, norm=self.fft_norm).transpose(1, 2)
        return smoothed if length == self.max_len else smoothed[:, :length]

    def _dropout_and_zero_padding(self, h: Tensor, keep: Tensor) -> Tensor:
        """dropout(h) * keep as one multiplication, written token-major contiguous [B, N, dim]
        (one copy here saves a copy in each downstream projection).

        The dropout mask keeps an entry when a uniform draw is >= p and scales kept entries by
        1 / (1 - p): the distribution of ``nn.Dropout(p)``, drawn with torch.rand, which is
        several times cheaper on CPU than the Bernoulli sampler F.dropout uses.
        """
        p = self.dropout.p
        factor = keep
        if self.training and p > 0:
            drawn = torch.rand(h.shape, device=h.device)  # float32 draws also for half inputs
            factor = (drawn >= p) * (keep * (1.0 / (1.0 - p)))
        # factor first: the product takes its contiguous layout, not h's (possibly transposed) one
        return (factor * h).contiguous()

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, max_len={self.max_len}, segments={self.segments}, "
            f"kernel_size={self.kernel_size}, activation={self.activation!r}, fourier={self.fourier}, "
            f"conv_stem={self.conv_stem}, fft_norm={self.fft_norm!r}"
        )
