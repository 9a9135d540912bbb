"""iTransformer (Liu et al., "iTransformer: Inverted Transformers Are Effective for Time Series Forecasting",
ICLR 2024).

Section 3 of the paper: the whole look-back series of each variate is one token (eq. 1: h_n^0 = Embedding(X_:,n),
an MLP / Linear over time), self-attention runs across the variate tokens and the feed-forward network over each
token (h^{l+1} = TrmBlock(h^l)), and a Linear projection maps each token to its horizon (Y_:,n = Projection(h_n^L)).
Calendar marks, when given, are extra tokens (one per mark column, as the authors' code does) that are dropped
from the output. Each window is normalised per variate (the authors' ``use_norm``: subtract the mean, divide by
sqrt(population variance + 1e-5)) and de-normalised at the end. Defaults are the paper's ETTm2 settings:
2 layers, d_model 128, d_ff 128, 8 heads, dropout 0.1, GELU.

The attention across variates is any registered longattn mechanism (``attention``, default exact ``softmax``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from longattn import attention as attention_registry
from longattn.models.forecast_blocks import PostNormEncoderLayer, check_window
from longattn.models.registry import register_model


@register_model("itransformer", family="forecaster")
class ITransformer(nn.Module):
    """Variates as tokens: Linear(seq_len -> d_model) per variate, post-LN encoder across variates, final
    LayerNorm, Linear(d_model -> pred_len) per variate."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, d_model: int = 128, heads: int = 8,
                 layers: int = 2, d_ff: int = 128, dropout: float = 0.1, activation: str = "gelu",
                 attention: str = "softmax", attention_options: dict[str, Any] | None = None,
                 normalise: bool = True, eps: float = 1e-5, calendar_dim: int = 0) -> None:
        super().__init__()
        self.channels, self.seq_len, self.pred_len = channels, seq_len, pred_len
        self.normalise, self.eps, self.calendar_dim = normalise, eps, calendar_dim
        self.embedding = nn.Linear(seq_len, d_model)  # eq. 1, Embedding: R^T -> R^D
        self.dropout = nn.Dropout(dropout)
        options = {"dropout": dropout, **(attention_options or {})} if attention == "softmax" else attention_options
        tokens = channels + calendar_dim
        self.layers = nn.ModuleList(
            PostNormEncoderLayer(attention_registry.build(attention, d_model, heads, max_len=tokens, **(options or {})),
                                 d_model, d_ff, dropout, activation)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.projection = nn.Linear(d_model, pred_len)  # Projection: R^D -> R^S

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        check_window(x, self.seq_len, self.channels)
        if self.normalise:
            mean = x.mean(dim=1, keepdim=True).detach()
            std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + self.eps).detach()
            x = (x - mean) / std
        series = x.transpose(1, 2)  # [B, C, T]: one token per variate
        if self.calendar_dim:
            if marks is None or marks.shape[-1] != self.calendar_dim:
                raise ValueError(f"this model was built with {self.calendar_dim} calendar features; pass them")
            series = torch.cat([series, marks.transpose(1, 2).to(series.dtype)], dim=1)
        h = self.dropout(self.embedding(series))
        for layer in self.layers:
            h = layer(h)
        y = self.projection(self.norm(h))[:, : self.channels].transpose(1, 2)  # [B, pred_len, C]
        return y * std + mean if self.normalise else y
