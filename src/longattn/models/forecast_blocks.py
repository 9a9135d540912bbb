"""Pieces shared by the comparison forecasters (Informer, Autoformer, FEDformer, LogTrans, the efficient-attention
Transformers, S4, PatchTST, iTransformer): embeddings, series decomposition, the generative decoder input, the
post-LN Transformer layers of the Informer code family and two encoder-decoder scaffolds.

Decoder input (Informer Section 3.3, "generative inference"): the decoder sees the last ``label_len`` steps of the
input window (the "start token") followed by ``pred_len`` placeholders (zeros; the decomposition models put the
window mean into the trend placeholder instead). The models receive only ``x`` [B, seq_len, C] and optional
calendar marks of the input window: the future marks the upstream code feeds the decoder are not part of the
forecaster contract, so the placeholder steps get zero marks (see docs/forecasting_models.md).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.softmax import softmax_attention
from longattn.models.forecasters import moving_average, sinusoidal_positions

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "DataEmbedding",
    "DecompDecoderLayer",
    "DecompEncoderDecoder",
    "DecompEncoderLayer",
    "FullCrossAttention",
    "GenerativeTransformer",
    "MixtureDecomposition",
    "PostNormDecoderLayer",
    "PostNormEncoderLayer",
    "ProjectedInner",
    "SeasonalLayerNorm",
    "SeriesDecomposition",
    "check_window",
    "decoder_marks",
    "resolve_label_len",
]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"gelu": F.gelu, "relu": F.relu}

SelfAttentionFactory = Callable[[], nn.Module]
"""Builds a fresh self-attention module mapping [B, N, d_model] -> [B, N, d_model]."""


def activation_fn(name: str) -> Callable[[Tensor], Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


class Activation(nn.Module):
    """A named activation (``gelu`` or ``relu``) as a module."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = activation_fn(name)

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


def resolve_label_len(label_len: int | None, seq_len: int) -> int:
    """The decoder's start-token length: ``seq_len // 2`` when None (48 for input 96, the papers' setting)."""
    label_len = seq_len // 2 if label_len is None else label_len
    if not 0 <= label_len <= seq_len:
        raise ValueError(f"label_len must be in [0, seq_len={seq_len}], got {label_len}")
    return label_len


def check_window(x: Tensor, seq_len: int, channels: int) -> None:
    """Clear error for an input that is not [B, seq_len, channels] floating point or that holds NaN/inf."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[1:] != (seq_len, channels):
        shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"expected x of shape [B, {seq_len}, {channels}], got {shape}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError("x holds NaN or inf")


def decoder_marks(marks: Tensor | None, label_len: int, pred_len: int) -> Tensor | None:
    """Marks of the decoder input: those of the last ``label_len`` steps, zeros for the placeholders."""
    if marks is None:
        return None
    return F.pad(marks[:, marks.shape[1] - label_len :], (0, 0, 0, pred_len))


class TokenEmbedding(nn.Module):
    """Informer's value embedding: Conv1d(channels -> d_model, kernel 3, circular padding, no bias)."""

    def __init__(self, channels: int, d_model: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, d_model, kernel_size=3, padding=1, padding_mode="circular", bias=False)
        nn.init.kaiming_normal_(self.conv.weight, mode="fan_in", nonlinearity="leaky_relu")

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class DataEmbedding(nn.Module):
    """Value (TokenEmbedding) + optional sinusoidal positions + optional calendar embedding (Informer's "timeF":
    a bias-free Linear of the marks), then dropout. Autoformer and FEDformer use it without positions."""

    def __init__(self, channels: int, d_model: int, max_len: int, calendar_dim: int = 0, dropout: float = 0.0,
                 positions: bool = True) -> None:
        super().__init__()
        self.value = TokenEmbedding(channels, d_model)
        self.calendar = nn.Linear(calendar_dim, d_model, bias=False) if calendar_dim > 0 else None
        self.use_positions = positions
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        h = self.value(x)
        if self.use_positions:
            h = h + self.positions[: x.shape[1]].to(h.dtype)
        if self.calendar is not None:
            if marks is None or marks.shape[-1] != self.calendar.in_features:
                raise ValueError(f"this model was built with {self.calendar.in_features} calendar features; pass them")
            h = h + self.calendar(marks)
        return self.dropout(h)


# ----------------------------------------------------------------------------- series decomposition


class SeriesDecomposition(nn.Module):
    """Autoformer's series decomposition block (eq. 1): trend = AvgPool(Padding(X)), seasonal = X - trend."""

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"moving-average kernel must be >= 1, got {kernel_size}")
        self.kernel_size = kernel_size

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        trend = moving_average(x, self.kernel_size)
        return x - trend, trend


class MixtureDecomposition(nn.Module):
    """FEDformer's Mixture Of Experts decomposition (MOEDecomp, Section 3.1): trend = sum_i softmax(L(x))_i *
    AvgPool_i(x), a softmax over the kernels of weights that a Linear(1 -> #kernels) computes from each value."""

    def __init__(self, kernel_sizes: tuple[int, ...] | list[int]) -> None:
        super().__init__()
        kernel_sizes = tuple(int(k) for k in kernel_sizes)
        if not kernel_sizes or min(kernel_sizes) < 1:
            raise ValueError(f"moving-average kernels must be a non-empty list of ints >= 1, got {kernel_sizes}")
        self.kernel_sizes = kernel_sizes
        self.gate = nn.Linear(1, len(kernel_sizes))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        trends = torch.stack([moving_average(x, k) for k in self.kernel_sizes])  # [K, B, T, C]
        # L(x)_i = w_i x + b_i per value, with the kernels first: the softmax over them then runs across whole
        # [B, T, C] slices (torch's softmax over a short last axis goes row by row, ~6x slower here)
        logits = torch.addcmul(self.gate.bias.view(-1, 1, 1, 1), self.gate.weight.view(-1, 1, 1, 1), x)
        trend = (trends * torch.softmax(logits, dim=0)).sum(0)
        return x - trend, trend


class SeasonalLayerNorm(nn.Module):
    """Autoformer's LayerNorm for the seasonal part: LayerNorm, then the mean over time is subtracted."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        return h - h.mean(dim=1, keepdim=True)


# ----------------------------------------------------------------------------- attention wrappers


class ProjectedInner(nn.Module):
    """Linear projections to queries, keys, values in heads [B, L, H, E] around an inner operator
    (Autoformer's AutoCorrelationLayer, also FEDformer's wrapper of its frequency blocks), and the output map.

    An inner operator that reads only some of its inputs says so with a ``uses`` attribute (e.g. ``"q"`` for
    FEDformer's Fourier block); the projections it does not read are not created (the authors' code keeps them,
    unused, which only adds parameters without gradients) and it receives None in their place.
    """

    def __init__(self, inner: nn.Module, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.inner, self.heads = inner, heads
        uses = getattr(inner, "uses", "qkv")
        self.to_q = nn.Linear(d_model, d_model) if "q" in uses else None
        self.to_k = nn.Linear(d_model, d_model) if "k" in uses else None
        self.to_v = nn.Linear(d_model, d_model) if "v" in uses else None
        self.to_out = nn.Linear(d_model, d_model)

    def _project(self, projection: nn.Linear | None, t: Tensor) -> Tensor | None:
        return None if projection is None else projection(t).reshape(t.shape[0], t.shape[1], self.heads, -1)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        b, n, _ = queries.shape
        out = self.inner(self._project(self.to_q, queries), self._project(self.to_k, keys),
                         self._project(self.to_v, values))
        return self.to_out(out.reshape(b, n, -1))


class SoftmaxInner(nn.Module):
    """Multi-head softmax attention on [B, L, H, E] heads (``softmax_attention``)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = softmax_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return out.transpose(1, 2)


class FullCrossAttention(ProjectedInner):
    """Multi-head softmax attention of queries ``x`` [B, L, d] on ``memory`` [B, S, d]."""

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__(SoftmaxInner(dropout), d_model, heads)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x, memory, memory)


# ----------------------------------------------------------------------------- Informer-family layers


def pointwise_conv(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """A kernel-1 ``conv`` on [B, C_in, L] as one batched product W x (+ bias): the convolution's numbers up to
    rounding, in its output layout ([B, C_out, L] contiguous, so a dropout after it draws the same mask), at
    0.5-0.6x its CPU time forward + backward at the forecasters' sizes (d 128 <-> d_ff 512, L 192-816)."""
    weight = conv.weight.squeeze(-1).expand(x.shape[0], -1, -1)
    if conv.bias is None:
        return torch.bmm(weight, x)
    return torch.baddbmm(conv.bias[None, :, None].expand(x.shape[0], -1, x.shape[-1]), weight, x)


class FeedForward(nn.Module):
    """The position-wise feed-forward block of the Informer code family: kernel-1 convolutions d -> d_ff -> d
    (Conv1d parameters, computed by :func:`pointwise_conv`)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str, bias: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(d_model, d_ff, kernel_size=1, bias=bias)
        self.conv2 = nn.Conv1d(d_ff, d_model, kernel_size=1, bias=bias)
        self.activation = activation_fn(activation)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = self.dropout(self.activation(pointwise_conv(self.conv1, x.transpose(1, 2))))
        return self.dropout(pointwise_conv(self.conv2, y).transpose(1, 2))


class PostNormEncoderLayer(nn.Module):
    """x = LN(x + Dropout(Attn(x))); x = LN(x + FFN(x)) (Vaswani et al.; Informer's EncoderLayer)."""

    def __init__(self, attention: nn.Module, d_model: int, d_ff: int, dropout: float, activation: str) -> None:
        super().__init__()
        self.attention = attention
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(x + self.dropout(self.attention(x)))
        return self.norm2(x + self.ff(x))


class PostNormDecoderLayer(nn.Module):
    """Masked self-attention, cross-attention on the encoder output, FFN; each residual and post-LN."""

    def __init__(self, self_attention: nn.Module, cross_attention: nn.Module, d_model: int, d_ff: int,
                 dropout: float, activation: str) -> None:
        super().__init__()
        self.self_attention, self.cross_attention = self_attention, cross_attention
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        x = self.norm1(x + self.dropout(self.self_attention(x)))
        x = self.norm2(x + self.dropout(self.cross_attention(x, memory)))
        return self.norm3(x + self.ff(x))


class DistillingLayer(nn.Module):
    """Informer's self-attention distilling (eq. 5): MaxPool(ELU(Conv1d(x))), halving the length
    (Conv1d kernel 3 circular, BatchNorm, ELU, MaxPool kernel 3 stride 2 padding 1)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, kernel_size=3, padding=1, padding_mode="circular")
        self.norm = nn.BatchNorm1d(d_model)
        self.pool = nn.MaxPool1d(kernel_size=3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(F.elu(self.norm(self.conv(x.transpose(1, 2))))).transpose(1, 2)


class GenerativeTransformer(nn.Module):
    """The encoder-decoder Transformer forecaster of the Informer code family (the papers' "Transformer",
    Informer, and the efficient-attention Transformers of Table 16), with pluggable self-attention.

    ``form="encoder_decoder"``: encoder over the window (with Informer's distilling layers between attention
    blocks if ``distil``), final LayerNorm; decoder over [last ``label_len`` steps; ``pred_len`` zeros] with
    self-attention, full cross-attention on the encoder output and FFN, final LayerNorm, Linear to channels; the
    last ``pred_len`` outputs are the forecast (Informer Section 3.3, one forward pass, no autoregression).
    ``form="encoder_only"``: one stack over [window; ``pred_len`` zeros] (the Reformer forecaster of the
    Autoformer/FEDformer code, the S4 paper's masked-forecast setup), then LayerNorm and Linear.
    """

    def __init__(self, channels: int, seq_len: int, pred_len: int, *, label_len: int | None, d_model: int,
                 heads: int, encoder_layers: int, decoder_layers: int, d_ff: int, dropout: float, activation: str,
                 calendar_dim: int, encoder_attention: SelfAttentionFactory,
                 decoder_attention: SelfAttentionFactory | None = None,
                 cross_attention: Callable[[], nn.Module] | None = None,
                 distil: bool = False, form: str = "encoder_decoder") -> None:
        super().__init__()
        if form not in ("encoder_decoder", "encoder_only"):
            raise ValueError(f"form must be 'encoder_decoder' or 'encoder_only', got {form!r}")
        if encoder_layers < 1 or (form == "encoder_decoder" and decoder_layers < 1):
            raise ValueError(f"need >= 1 encoder (and decoder) layer, got {encoder_layers}, {decoder_layers}")
        self.channels, self.seq_len, self.pred_len, self.form = channels, seq_len, pred_len, form
        self.label_len = resolve_label_len(label_len, seq_len)
        self.encoder_embedding = DataEmbedding(channels, d_model, seq_len + pred_len, calendar_dim, dropout)
        self.encoder = nn.ModuleList(
            PostNormEncoderLayer(encoder_attention(), d_model, d_ff, dropout, activation) for _ in range(encoder_layers)
        )
        self.distilling = nn.ModuleList(DistillingLayer(d_model) for _ in range(encoder_layers - 1)) if distil else None
        self.encoder_norm = nn.LayerNorm(d_model)
        if form == "encoder_decoder":
            if decoder_attention is None:
                raise ValueError("the encoder-decoder form needs a decoder self-attention")
            cross = cross_attention or (lambda: FullCrossAttention(d_model, heads, dropout))
            self.decoder_embedding = DataEmbedding(channels, d_model, self.label_len + pred_len, calendar_dim, dropout)
            self.decoder = nn.ModuleList(
                PostNormDecoderLayer(decoder_attention(), cross(), d_model, d_ff, dropout, activation)
                for _ in range(decoder_layers)
            )
            self.decoder_norm = nn.LayerNorm(d_model)
        self.projection = nn.Linear(d_model, channels)

    def encode(self, h: Tensor) -> Tensor:
        for i, layer in enumerate(self.encoder):
            h = layer(h)
            if self.distilling is not None and i < len(self.distilling):
                h = self.distilling[i](h)
        return self.encoder_norm(h)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        check_window(x, self.seq_len, self.channels)
        if self.form == "encoder_only":
            stacked = F.pad(x, (0, 0, 0, self.pred_len))
            h = self.encode(self.encoder_embedding(stacked, decoder_marks(marks, self.seq_len, self.pred_len)))
            return self.projection(h)[:, -self.pred_len :]
        memory = self.encode(self.encoder_embedding(x, marks))
        start = F.pad(x[:, self.seq_len - self.label_len :], (0, 0, 0, self.pred_len))
        h = self.decoder_embedding(start, decoder_marks(marks, self.label_len, self.pred_len))
        for layer in self.decoder:
            h = layer(h, memory)
        return self.projection(self.decoder_norm(h))[:, -self.pred_len :]


# ----------------------------------------------------------------------------- Autoformer / FEDformer scaffold

InnerFactory = Callable[[], nn.Module]
"""Builds a fresh inner operator on (queries, keys, values) [B, L, H, E] -> [B, L_q, H, E] (an nn.Module)."""


class DecompEncoderLayer(nn.Module):
    """Autoformer's encoder layer (eq. 3): S = Decomp(AutoCorrelation(X) + X); S = Decomp(FeedForward(S) + S),
    keeping only the seasonal parts."""

    def __init__(self, attention: nn.Module, decomposition: Callable[[], nn.Module], d_model: int, d_ff: int,
                 dropout: float, activation: str) -> None:
        super().__init__()
        self.attention = attention
        self.ff = FeedForward(d_model, d_ff, dropout, activation, bias=False)
        self.decomp1, self.decomp2 = decomposition(), decomposition()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x, _ = self.decomp1(x + self.dropout(self.attention(x, x, x)))
        x, _ = self.decomp2(x + self.ff(x))
        return x


class DecompDecoderLayer(nn.Module):
    """Autoformer's decoder layer (eq. 4): three decompositions after self-correlation, cross-correlation and
    FFN; the three extracted trends are summed and projected to the channels (kernel-3 circular Conv1d)."""

    def __init__(self, self_attention: nn.Module, cross_attention: nn.Module,
                 decomposition: Callable[[], nn.Module], d_model: int, channels: int, d_ff: int, dropout: float,
                 activation: str) -> None:
        super().__init__()
        self.self_attention, self.cross_attention = self_attention, cross_attention
        self.ff = FeedForward(d_model, d_ff, dropout, activation, bias=False)
        self.decomp1, self.decomp2, self.decomp3 = decomposition(), decomposition(), decomposition()
        self.dropout = nn.Dropout(dropout)
        self.trend_projection = nn.Conv1d(d_model, channels, kernel_size=3, padding=1, padding_mode="circular",
                                          bias=False)

    def forward(self, x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor]:
        x, trend1 = self.decomp1(x + self.dropout(self.self_attention(x, x, x)))
        x, trend2 = self.decomp2(x + self.dropout(self.cross_attention(x, memory, memory)))
        x, trend3 = self.decomp3(x + self.ff(x))
        trend = self.trend_projection((trend1 + trend2 + trend3).transpose(1, 2)).transpose(1, 2)
        return x, trend


class DecompEncoderDecoder(nn.Module):
    """The decomposition Transformer of Autoformer (Section 3.1, Figure 1) and FEDformer (Section 3.1, Figure 2).

    Decoder inputs (Autoformer eq. 2): X_des = Concat(seasonal of the last ``label_len`` steps, zeros), X_det =
    Concat(trend of the last ``label_len`` steps, mean of the window). Encoder: embedding without positions,
    ``encoder_layers`` DecompEncoderLayers, SeasonalLayerNorm. Decoder: ``decoder_layers`` DecompDecoderLayers
    accumulating the trend, SeasonalLayerNorm, Linear to channels; forecast = seasonal + trend, last pred_len.
    ``encoder_inner`` / ``decoder_inner`` / ``cross_inner`` build the operators (auto-correlation, frequency
    blocks) that :class:`ProjectedInner` wraps with the projections.
    """

    def __init__(self, channels: int, seq_len: int, pred_len: int, *, label_len: int | None, d_model: int,
                 heads: int, encoder_layers: int, decoder_layers: int, d_ff: int, dropout: float, activation: str,
                 calendar_dim: int, decomposition: Callable[[], nn.Module], encoder_inner: InnerFactory,
                 decoder_inner: InnerFactory, cross_inner: InnerFactory) -> None:
        super().__init__()
        if encoder_layers < 1 or decoder_layers < 1:
            raise ValueError(f"need >= 1 encoder and decoder layer, got {encoder_layers}, {decoder_layers}")
        self.channels, self.seq_len, self.pred_len = channels, seq_len, pred_len
        self.label_len = resolve_label_len(label_len, seq_len)
        self.decomposition = decomposition()
        self.encoder_embedding = DataEmbedding(channels, d_model, seq_len, calendar_dim, dropout, positions=False)
        self.decoder_embedding = DataEmbedding(channels, d_model, self.label_len + pred_len, calendar_dim, dropout,
                                               positions=False)
        self.encoder = nn.ModuleList(
            DecompEncoderLayer(ProjectedInner(encoder_inner(), d_model, heads), decomposition, d_model, d_ff,
                               dropout, activation)
            for _ in range(encoder_layers)
        )
        self.encoder_norm = SeasonalLayerNorm(d_model)
        self.decoder = nn.ModuleList(
            DecompDecoderLayer(ProjectedInner(decoder_inner(), d_model, heads),
                               ProjectedInner(cross_inner(), d_model, heads), decomposition, d_model, channels,
                               d_ff, dropout, activation)
            for _ in range(decoder_layers)
        )
        self.decoder_norm = SeasonalLayerNorm(d_model)
        self.projection = nn.Linear(d_model, channels)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        check_window(x, self.seq_len, self.channels)
        seasonal, trend = self.decomposition(x)
        start = self.seq_len - self.label_len
        mean = x.mean(dim=1, keepdim=True).expand(-1, self.pred_len, -1)
        trend = torch.cat([trend[:, start:], mean], dim=1)  # eq. 2: X_det
        seasonal = F.pad(seasonal[:, start:], (0, 0, 0, self.pred_len))  # eq. 2: X_des
        memory = self.encoder_embedding(x, marks)
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.encoder_norm(memory)
        h = self.decoder_embedding(seasonal, decoder_marks(marks, self.label_len, self.pred_len))
        for layer in self.decoder:
            h, residual_trend = layer(h, memory)
            trend = trend + residual_trend
        out = self.projection(self.decoder_norm(h)) + trend
        return out[:, -self.pred_len :]


def truncate_or_pad_keys(keys: Tensor, values: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Autoformer's alignment of keys/values [B, S, H, E] to the query length L: cut to the first L steps, or
    pad zeros at the end (Section 3.2, cross-correlation between decoder and encoder)."""
    s = keys.shape[1]
    if s >= length:
        return keys[:, :length], values[:, :length]
    pad = (0, 0, 0, 0, 0, length - s)
    return F.pad(keys, pad), F.pad(values, pad)


def log_length_count(factor: float, length: int) -> int:
    """c * ln(L) as the papers' codes take it (Autoformer's top-k: int(c * ln L)), at least 1, at most L."""
    return max(1, min(length, int(factor * math.log(length)))) if length > 1 else 1
