"""Long-term forecasters: the SKT forecaster (SKTformer / S^3 Algorithms 3-4), a generic encoder over any
registered attention, and DLinear.

Every forecaster maps ``x`` [B, seq_len, C] (and optional calendar marks [B, seq_len, M]) to
[B, pred_len, C_out] in the scaled units of the data.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn import attention as attention_registry
from longattn.models.registry import build_model, register_model


def window_normalise(x: Tensor, var_offset: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Per-window, per-channel standardisation of Algorithm 3: (x - mean) / sqrt(var + var_offset).

    The offset (1 in the papers) keeps near-constant windows from being blown up. ``torch.var``'s
    default (unbiased) estimator is used, as in Algorithm 3.
    """
    mean = x.mean(dim=1, keepdim=True)
    std = torch.sqrt(x.var(dim=1, keepdim=True) + var_offset)
    return (x - mean) / std, mean, std


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """The fixed sine/cosine position table of Vaswani et al. (2017), [length, dim]."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)[:, : dim // 2]
    return table


class ChannelEmbedding(nn.Module):
    """Kernel-1 Conv1d from channels to d_model, plus sinusoidal positions (and optional calendar marks)."""

    def __init__(self, channels: int, d_model: int, max_len: int, calendar_dim: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        self.value = nn.Conv1d(channels, d_model, kernel_size=1)
        self.calendar = nn.Linear(calendar_dim, d_model, bias=False) if calendar_dim > 0 else None
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        h = self.value(x.transpose(1, 2)).transpose(1, 2) + self.positions[: x.shape[1]]
        if self.calendar is not None:
            if marks is None or marks.shape[-1] != self.calendar.in_features:
                raise ValueError(f"this model was built with {self.calendar.in_features} calendar features; pass them")
            h = h + self.calendar(marks)
        return self.dropout(h)


def lowest_frequency_indices(length: int, harmonics: int) -> Tensor:
    """FFT bins of a length-``length`` signal sorted by |frequency| (ties keep FFT order), first 1 + 2*harmonics."""
    freqs = torch.fft.fftfreq(length)
    order = sorted(range(length), key=lambda i: abs(float(freqs[i])))
    return torch.tensor(order[: 1 + 2 * harmonics], dtype=torch.long)


class FourierExtrapolation(nn.Module):
    """Algorithm 4: keep the 1 + 2*harmonics lowest-frequency DFT components of the input window and evaluate
    their sum of cosines (amplitude |X_k| / n, phase arg X_k) on t = 0 .. n + pred_len - 1.

    sum_k |X_k|/n cos(2 pi f_k t + arg X_k) = sum_k (Re X_k cos(2 pi f_k t) - Im X_k sin(2 pi f_k t)) / n, which is
    what the forward pass computes (two small matmuls, and no gradient singularity of |.| and arg at X_k = 0);
    :meth:`reference` is the literal amplitude/phase form. With harmonics >= n/2 every bin is kept and the
    future is the periodic continuation of the window.
    """

    def __init__(self, input_len: int, pred_len: int, harmonics: int | None = None) -> None:
        super().__init__()
        harmonics = pred_len if harmonics is None else harmonics
        if harmonics < 0:
            raise ValueError(f"harmonics must be >= 0, got {harmonics}")
        self.input_len, self.pred_len = input_len, pred_len
        index = lowest_frequency_indices(input_len, harmonics)
        freqs = torch.fft.fftfreq(input_len, dtype=torch.float64)[index]
        angle = 2 * math.pi * torch.arange(input_len + pred_len, dtype=torch.float64).unsqueeze(1) * freqs  # [T, K]
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("freqs", freqs, persistent=False)
        # Kept in float64 (cast per call) so float64 models and tests get exact tables.
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)

    def _check(self, x: Tensor) -> None:
        if x.dim() != 3 or x.shape[1] != self.input_len:
            raise ValueError(f"expected [B, {self.input_len}, C], got {list(x.shape)}")

    def forward(self, x: Tensor) -> Tensor:
        """[B, n, C] -> [B, n + pred_len, C] (the fitted window followed by the extrapolation)."""
        self._check(x)
        spectrum = torch.fft.fft(x, dim=1)[:, self.index]  # [B, K, C]
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        return (cos @ spectrum.real - sin @ spectrum.imag) / self.input_len

    def reference(self, x: Tensor) -> Tensor:
        """Plain amplitude/phase evaluation, for tests."""
        self._check(x)
        spectrum = torch.fft.fft(x, dim=1)[:, self.index]
        amplitude, phase = spectrum.abs() / self.input_len, spectrum.angle()
        t = torch.arange(self.input_len + self.pred_len, dtype=x.dtype, device=x.device)
        angle = 2 * math.pi * t[None, :, None, None] * self.freqs.to(x.dtype)[None, None, :, None]  # [1, T, K, 1]
        return (amplitude[:, None] * torch.cos(angle + phase[:, None])).sum(dim=2)


class TimeLinear(nn.Linear):
    """Linear(seq_len -> pred_len) over time: [B, seq_len, C] -> [B, pred_len, C]."""

    def forward(self, y: Tensor) -> Tensor:
        return super().forward(y.transpose(1, 2)).transpose(1, 2)


def forecast_head(kind: str, seq_len: int, pred_len: int, harmonics: int | None = None) -> nn.Module:
    """The forecasters' output head: Fourier extrapolation (Algorithm 4) or a linear map over time."""
    if kind == "fourier":
        return FourierExtrapolation(seq_len, pred_len, harmonics)
    if kind == "linear":
        return TimeLinear(seq_len, pred_len)
    raise ValueError(f"head must be 'fourier' or 'linear', got {kind!r}")


@register_model("skt", family="forecaster")
class SKTForecaster(nn.Module):
    """The SKT forecaster of Algorithm 3 (SKTformer / S^3 attention).

    window normalisation (mean, sqrt(var + 1)) -> kernel-1 Conv1d embedding + sinusoidal positions ->
    ``layers`` residual layers ``h = attn(h) + h`` (no feed-forward block; with ``attention="skeleton"`` and
    ``smoother=True`` each layer is Smoother + skeleton attention) -> linear projection back to the channels ->
    Fourier extrapolation (Algorithm 4) -> the last ``pred_len`` steps, de-normalised.

    Algorithm 3 as printed re-embeds the raw input in every loop iteration (journal) or returns after the first
    (conference), i.e. effectively one layer; ``layers=1`` is that, larger values stack layers on the embedding.
    ``head="linear"`` swaps the Fourier head for a Linear(seq_len -> pred_len) over time (ablation).
    """

    def __init__(
        self,
        channels: int,
        seq_len: int,
        pred_len: int,
        d_model: int = 512,
        heads: int = 8,
        layers: int = 1,
        attention: str = "skeleton",
        attention_options: dict[str, Any] | None = None,
        dropout: float = 0.05,
        var_offset: float = 1.0,
        head: str = "fourier",
        harmonics: int | None = None,
        calendar_dim: int = 0,
    ) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        self.seq_len, self.pred_len, self.var_offset = seq_len, pred_len, var_offset
        self.embedding = ChannelEmbedding(channels, d_model, seq_len, calendar_dim, dropout)
        self.layers = nn.ModuleList(
            attention_registry.build(attention, d_model, heads, max_len=seq_len, **(attention_options or {}))
            for _ in range(layers)
        )
        self.projection = nn.Linear(d_model, channels)
        self.head = forecast_head(head, seq_len, pred_len, harmonics)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        x, mean, std = window_normalise(x, self.var_offset)
        h = self.embedding(x, marks)
        layer_state: dict = {}
        for layer in self.layers:
            h = layer(h, layer_state=layer_state) + h
        y = self.projection(h)  # [B, seq_len, C]
        y = self.head(y)[:, -self.pred_len :]  # the Fourier head also returns the fitted past
        return y * std + mean


@register_model("encoder", family="forecaster")
class EncoderForecaster(nn.Module):
    """A generic Transformer-encoder forecaster over any registered attention, for like-for-like comparisons.

    Same front end as :class:`SKTForecaster` (window normalisation, Conv1d embedding + positions); then
    ``layers`` pre-LN blocks (attention and a GELU feed-forward, each residual with dropout), a final
    LayerNorm, a projection to the channels and a Linear(seq_len -> pred_len) over time (``head="linear"``,
    default) or the Fourier extrapolation head (``head="fourier"``).
    """

    def __init__(
        self,
        channels: int,
        seq_len: int,
        pred_len: int,
        d_model: int = 512,
        heads: int = 8,
        layers: int = 2,
        d_ff: int = 2048,
        attention: str = "softmax",
        attention_options: dict[str, Any] | None = None,
        dropout: float = 0.05,
        var_offset: float = 1.0,
        head: str = "linear",
        harmonics: int | None = None,
        calendar_dim: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len, self.pred_len, self.var_offset = seq_len, pred_len, var_offset
        self.embedding = ChannelEmbedding(channels, d_model, seq_len, calendar_dim, dropout)
        self.attn_norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.attns = nn.ModuleList(
            attention_registry.build(attention, d_model, heads, max_len=seq_len, **(attention_options or {}))
            for _ in range(layers)
        )
        # a GAU-like mechanism (replaces_ffn) is attention and feed-forward in one: no FFN then
        ffn_layers = 0 if attention_registry.capabilities(attention).replaces_ffn else layers
        self.ff_norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(ffn_layers))
        self.ffs = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))
            for _ in range(ffn_layers)
        )
        self.dropout = nn.Dropout(dropout)
        self.final_norm = nn.LayerNorm(d_model)
        self.projection = nn.Linear(d_model, channels)
        self.head = forecast_head(head, seq_len, pred_len, harmonics)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        x, mean, std = window_normalise(x, self.var_offset)
        h = self.embedding(x, marks)
        layer_state: dict = {}
        for index, (attn_norm, attn) in enumerate(zip(self.attn_norms, self.attns)):
            h = h + self.dropout(attn(attn_norm(h), layer_state=layer_state))
            if self.ffs:
                h = h + self.dropout(self.ffs[index](self.ff_norms[index](h)))
        y = self.projection(self.final_norm(h))
        y = self.head(y)[:, -self.pred_len :]  # the Fourier head also returns the fitted past
        return y * std + mean


def moving_average(x: Tensor, kernel_size: int) -> Tensor:
    """Moving average over time of [B, T, C], length-preserving: the front is padded with
    ``kernel_size - 1 - (kernel_size - 1) // 2`` copies of the first step and the end with ``(kernel_size - 1) // 2``
    copies of the last (centred for odd kernels; FEDformer's padding for even ones such as its 24)."""
    if kernel_size < 1:
        raise ValueError(f"kernel_size must be a positive int, got {kernel_size}")
    back = (kernel_size - 1) // 2
    front = kernel_size - 1 - back
    padded = torch.cat([x[:, :1].expand(-1, front, -1), x, x[:, -1:].expand(-1, back, -1)], dim=1)
    return _SlidingMean.apply(padded.transpose(1, 2), kernel_size).transpose(1, 2)


class _SlidingMean(torch.autograd.Function):
    """The mean of every window of ``kernel`` steps along the last axis of [B, C, L] (``avg_pool1d``, stride 1,
    no padding), with its backward written out: d mean_t / d x_s = 1 / kernel for s - kernel < t <= s, so the
    input gradient is the same sliding mean of the output gradient padded with kernel - 1 zeros on each side,
    computed time-major like the forward's input (torch's fast pooling kernel for that layout). torch's own
    ``avg_pool`` backward took ~1.3x the CPU on time-major output gradients and ~2.5x on channel-major ones (as
    Autoformer's decoder trend passes back). The forward is the same call; the gradient the same sums up to
    rounding (the sum over the window, then / kernel)."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: int) -> Tensor:  # type: ignore[override]
        ctx.kernel = kernel
        return F.avg_pool1d(x, kernel, stride=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        kernel = ctx.kernel
        padded = F.pad(grad.transpose(1, 2), (0, 0, kernel - 1, kernel - 1)).transpose(1, 2)
        return F.avg_pool1d(padded, kernel, stride=1), None


@register_model("dlinear", family="forecaster")
class DLinear(nn.Module):
    """DLinear (Zeng et al., 2023): trend = moving average (kernel 25), seasonal = x - trend, each mapped
    seq_len -> pred_len by a linear layer over time (shared by channels, or one per channel with
    ``individual=True``), output = sum."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, kernel_size: int = 25, individual: bool = False,
                 calendar_dim: int = 0) -> None:
        super().__init__()
        del calendar_dim  # DLinear uses no calendar features; accepted so every forecaster builds alike
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd number, got {kernel_size}")
        self.kernel_size, self.individual, self.channels = kernel_size, individual, channels
        count = channels if individual else 1
        self.seasonal = nn.ModuleList(nn.Linear(seq_len, pred_len) for _ in range(count))
        self.trend = nn.ModuleList(nn.Linear(seq_len, pred_len) for _ in range(count))

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        trend = moving_average(x, self.kernel_size)
        seasonal = (x - trend).transpose(1, 2)  # [B, C, T]
        trend = trend.transpose(1, 2)
        if self.individual:
            out = torch.stack(
                [s(seasonal[:, c]) + t(trend[:, c]) for c, (s, t) in enumerate(zip(self.seasonal, self.trend))], dim=1
            )
        else:
            out = self.seasonal[0](seasonal) + self.trend[0](trend)
        return out.transpose(1, 2)


def build_forecaster(name: str, channels: int, seq_len: int, pred_len: int, **options: Any) -> nn.Module:
    """Build registered forecaster ``name``; unknown names and options raise instead of being ignored."""
    return build_model(name, family="forecaster", channels=channels, seq_len=seq_len, pred_len=pred_len, **options)
