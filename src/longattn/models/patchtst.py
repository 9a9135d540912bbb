"""PatchTST (Nie et al., "A Time Series is Worth 64 Words: Long-term Forecasting with Transformers", ICLR 2023).

Section 3.1 of the paper: each channel is a separate univariate series (channel independence) that shares one
Transformer backbone; the series is instance-normalised (RevIN, Kim et al. 2022), cut into patches of length P
with stride S (the last value repeated S times at the end first, so the number of patches is
floor((L - P) / S) + 2), each patch mapped by W_p to d_model plus a learned position W_pos (x_d = W_p x_p + W_pos),
encoded by a vanilla Transformer encoder with BatchNorm (Section 3.1 "Transformer Encoder"; the authors' code adds
the previous layer's attention scores to each layer's scores, "residual attention"), flattened and mapped to the
horizon by a linear head, then de-normalised. Defaults are the paper's supervised PatchTST/42 settings for the
larger datasets (ETTm, Weather, Electricity, Traffic): 3 layers, 16 heads, d_model 128, d_ff 256, dropout 0.2,
P = 16, S = 8.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longattn.attention.base import merge_heads, split_heads
from longattn.models.forecast_blocks import Activation, check_window
from longattn.models.registry import register_model


class RevIN(nn.Module):
    """Reversible instance normalisation (Kim et al. 2022): per window and channel, x_hat = (x - mean) / sqrt(var +
    eps) * gamma + beta with the population variance; :meth:`denormalise` inverts it with the same statistics."""

    def __init__(self, channels: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels)) if affine else None
        self.bias = nn.Parameter(torch.zeros(channels)) if affine else None

    def normalise(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mean = x.mean(dim=1, keepdim=True).detach()
        std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        h = (x - mean) / std
        if self.weight is not None:
            h = h * self.weight + self.bias
        return h, mean, std

    def denormalise(self, y: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        if self.weight is not None:
            y = (y - self.bias) / (self.weight + self.eps * self.eps)
        return y * std + mean


def make_patches(x: Tensor, patch_len: int, stride: int, pad_end: bool = True) -> Tensor:
    """[B, C, L] -> [B, C, num_patches, patch_len]; ``pad_end`` repeats the last value ``stride`` times first."""
    if pad_end:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], stride)], dim=-1)
    if x.shape[-1] < patch_len:
        raise ValueError(f"series of length {x.shape[-1]} is shorter than patch_len={patch_len}")
    return x.unfold(-1, patch_len, stride)


def patch_count(seq_len: int, patch_len: int, stride: int, pad_end: bool = True) -> int:
    return (seq_len + (stride if pad_end else 0) - patch_len) // stride + 1


class BatchNormOverTime(nn.BatchNorm1d):
    """BatchNorm1d over the feature axis of [B, N, d] (the paper's "BatchNorm" in the encoder)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class ResidualAttention(nn.Module):
    """Multi-head softmax attention whose pre-softmax scores get the previous layer's scores added (the authors'
    ``res_attention``, He et al. 2020's RealFormer); returns the output and this layer's scores."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.heads, self.scale = heads, (d_model // heads) ** -0.5
        self.to_q, self.to_k, self.to_v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.to_out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, x: Tensor, previous_scores: Tensor | None) -> tuple[Tensor, Tensor]:
        q, k, v = (split_heads(f(x), self.heads) for f in (self.to_q, self.to_k, self.to_v))
        # the [B, H, N, N] scores (N = number of patches, small) are held keys-major in memory and returned as a
        # [B, H, N_q, N_k] view: the softmax over the keys then runs across rows, vectorised, instead of along
        # rows of N ~ 12 (~5x faster); previous_scores, a view of the same kind, is added in the same layout
        scores_by_key = k @ q.transpose(-1, -2) * self.scale
        if previous_scores is not None:
            scores_by_key = scores_by_key + previous_scores.transpose(-1, -2)
        weights = torch.softmax(scores_by_key, dim=-2).transpose(-1, -2)
        if self.dropout.p > 0:  # dropout draws its mask in memory order: [B, H, N_q, N_k], as before
            weights = weights.contiguous()
        out = self.dropout(weights) @ v
        return self.to_out(merge_heads(out)), scores_by_key.transpose(-1, -2)


class PatchEncoderLayer(nn.Module):
    """Post-norm layer: x = BN(x + Dropout(Attn(x))); x = BN(x + Dropout(FFN(x)))."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, attention_dropout: float,
                 activation: str) -> None:
        super().__init__()
        self.attention = ResidualAttention(d_model, heads, attention_dropout)
        self.norm_attention, self.norm_ff = BatchNormOverTime(d_model), BatchNormOverTime(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), Activation(activation), nn.Dropout(dropout),
                                nn.Linear(d_ff, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, previous_scores: Tensor | None) -> tuple[Tensor, Tensor]:
        attended, scores = self.attention(x, previous_scores)
        x = self.norm_attention(x + self.dropout(attended))
        return self.norm_ff(x + self.dropout(self.ff(x))), scores


@register_model("patchtst", family="forecaster")
class PatchTST(nn.Module):
    """PatchTST/42-style supervised forecaster: RevIN -> patches -> channel-independent Transformer -> flatten
    head -> de-normalise. ``residual_attention`` (authors' code, default on) adds the previous layer's scores."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, patch_len: int = 16, stride: int = 8,
                 pad_end: bool = True, d_model: int = 128, heads: int = 16, layers: int = 3, d_ff: int = 256,
                 dropout: float = 0.2, attention_dropout: float = 0.0, head_dropout: float = 0.0,
                 activation: str = "gelu", revin: bool = True, revin_affine: bool = True,
                 residual_attention: bool = True, calendar_dim: int = 0) -> None:
        super().__init__()
        del calendar_dim  # PatchTST uses no calendar features; accepted so every forecaster builds alike
        if patch_len < 1 or stride < 1:
            raise ValueError(f"patch_len and stride must be >= 1, got {patch_len}, {stride}")
        self.channels, self.seq_len, self.pred_len = channels, seq_len, pred_len
        self.patch_len, self.stride, self.pad_end = patch_len, stride, pad_end
        self.residual_attention = residual_attention
        self.num_patches = patch_count(seq_len, patch_len, stride, pad_end)
        if self.num_patches < 1:
            raise ValueError(f"seq_len={seq_len} gives no whole patch of length {patch_len}")
        self.revin = RevIN(channels, affine=revin_affine) if revin else None
        self.patch_embedding = nn.Linear(patch_len, d_model)  # W_p
        self.positions = nn.Parameter(torch.empty(self.num_patches, d_model).uniform_(-0.02, 0.02))  # W_pos
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            PatchEncoderLayer(d_model, heads, d_ff, dropout, attention_dropout, activation) for _ in range(layers)
        )
        self.head = nn.Linear(d_model * self.num_patches, pred_len)
        self.head_dropout = nn.Dropout(head_dropout)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        check_window(x, self.seq_len, self.channels)
        if self.revin is not None:
            x, mean, std = self.revin.normalise(x)
        b = x.shape[0]
        patches = make_patches(x.transpose(1, 2), self.patch_len, self.stride, self.pad_end)  # [B, C, P_n, P]
        h = self.patch_embedding(patches).reshape(b * self.channels, self.num_patches, -1)  # channel independence
        h = self.dropout(h + self.positions)
        scores = None
        for layer in self.layers:
            h, layer_scores = layer(h, scores)
            scores = layer_scores if self.residual_attention else None
        y = self.head_dropout(self.head(h.reshape(b, self.channels, -1)))  # [B, C, pred_len]
        y = y.transpose(1, 2)
        return self.revin.denormalise(y, mean, std) if self.revin is not None else y


__all__ = ["PatchTST", "RevIN", "make_patches", "patch_count"]
