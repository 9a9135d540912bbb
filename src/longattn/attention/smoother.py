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

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import AttentionError, check_attention_mask, compute_dtype

__all__ = ["Smoother", "MaskedBatchNorm"]

_ACTIVATIONS = {"relu": F.relu, "elu": F.elu, "gelu": F.gelu}
_FFT_NORMS = ("backward", "ortho", "forward")
_BATCHNORM_AXES = ("positions", "features")


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
            out = out.to(h.dtype)
            with torch.no_grad():
                seen = count > 0
                unbiased = var * safe_count / (safe_count - 1).clamp_min(1)
                new_mean = torch.lerp(running_mean, mean.to(running_mean.dtype), self.momentum)
                new_var = torch.lerp(running_var, unbiased.to(running_var.dtype), self.momentum)
                running_mean.copy_(torch.where(seen, new_mean, running_mean))
                running_var.copy_(torch.where(seen, new_var, running_var))
            return out
        mean, var = running_mean.to(h.dtype), running_var.to(h.dtype)
        scale = weight.to(h.dtype) * torch.rsqrt(var + self.eps)
        return (h - mean.view(channel_shape)) * scale.view(channel_shape) + bias.to(h.dtype).view(channel_shape)

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
    ) -> None:
        super().__init__()
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
        if fourier:
            # L of eq. (5) stored as (real, imag) pairs; Kaiming-normal with fan_in = 2 * dim as in
            # the paper's Algorithm 2, i.e. std 1/sqrt(dim) per component.
            self.frequency_weight = nn.Parameter(torch.randn(max_len // 2 + 1, dim, 2) / math.sqrt(dim))
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
        if attention_mask is None:
            return torch.ones(b, n, dtype=x.dtype, device=x.device)
        return attention_mask.to(x.dtype)

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
    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """[B, N, dim] -> [B, N, dim] for any N <= max_len; zeros at padded positions."""
        valid = self._valid(x, attention_mask)
        keep = valid.unsqueeze(-1)
        x = x * keep  # padded contents never enter the FFT or the stem
        if self.fourier:
            # zero X^smooth at padded positions too: the stem's kernel must not read the
            # convolution's spill-over into padding (keeps N < max_len == padded to max_len)
            smoothed = self._fourier_smooth(x) * keep
            if not self.conv_stem:
                return self._dropout_and_zero_padding(smoothed, keep)
            # concatenated straight into Conv1d's channel-first layout [B, 2 dim, N]: one pass,
            # and the convolution (forward and backward) needs no contiguous copy of its input
            stem_in = torch.cat((smoothed.transpose(1, 2), x.transpose(1, 2)), dim=1)
        else:
            stem_in = x.transpose(1, 2).contiguous()
        h = self.stem_conv(stem_in).transpose(1, 2)  # [B, N, dim] view of a [B, dim, N] tensor
        h = self.stem_norm(h, valid)
        h = _ACTIVATIONS[self.activation](h)
        return self._dropout_and_zero_padding(h, keep)

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
