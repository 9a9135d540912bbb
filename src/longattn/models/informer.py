"""Informer (Zhou et al., "Informer: Beyond Efficient Transformer for Long Sequence Time-Series Forecasting",
AAAI 2021).

* Encoder: ProbSparse self-attention (Section 3.1, eq. 3-4: only the u = c ln L queries with the largest sparsity
  measure M_bar(q, K) = max_j s_j - mean_j s_j, estimated on U = c ln L sampled keys, attend; the others output
  mean(V)), c = 5, through longattn's registered ``informer`` mechanism, with self-attention distilling between
  the attention blocks (eq. 5: MaxPool(ELU(Conv1d(x))), halving the length).
* Decoder (Section 3.3, generative inference): input = last ``label_len`` steps + ``pred_len`` zeros, masked
  ProbSparse self-attention (:func:`masked_probsparse_attention`), full cross-attention on the encoder output,
  one forward pass for the whole horizon.

The masked ProbSparse variant is a model-local layer here, not a registered causal mechanism: the choice of the
active queries uses keys at every position (as in the authors' code), so a query's output may depend on later
inputs through that choice; in the decoder those later inputs are the zero placeholders.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from longattn import attention as attention_registry
from longattn.attention.base import merge_heads, split_heads
from longattn.attention.informer import probsparse_counts, sample_informer_keys, sparsity_measure
from longattn.models.forecast_blocks import GenerativeTransformer
from longattn.models.registry import register_model

LAZY_MASKED = ("cumsum", "cummean")


def masked_probsparse_attention(query: Tensor, key: Tensor, value: Tensor, *, factor: float = 5.0,
                                lazy: str = "cumsum", key_samples: Tensor | None = None,
                                dropout_p: float = 0.0) -> Tensor:
    """Masked (causal) ProbSparse self-attention on [B, H, N, Dh] (Informer's decoder).

    The top u = c ceil(ln N) queries by the sampled M_bar of eq. 4 get softmax attention over keys j <= i; every
    other query i outputs the prefix sum of V up to i (``lazy="cumsum"``, the authors' code) or its prefix mean
    (``"cummean"``, the causal counterpart of the paper's mean(V)). ``key_samples`` [B, N, U] fixes the draw.
    """
    if lazy not in LAZY_MASKED:
        raise ValueError(f"lazy must be one of {LAZY_MASKED}, got {lazy!r}")
    b, h, n, d = query.shape
    counts = probsparse_counts(torch.full((b,), n, device=query.device), factor)
    if key_samples is None:
        key_samples = sample_informer_keys(None, b, n, factor, query.device)
    measure = sparsity_measure(query, key, key_samples, counts, counts.new_full((b,), n))  # [B, H, N]
    u = int(counts.max())
    top = measure.topk(u, dim=-1).indices  # [B, H, u]
    top_q = query.gather(2, top[..., None].expand(b, h, u, d))
    scores = (top_q @ key.transpose(-1, -2)) / math.sqrt(d)  # [B, H, u, N]: u rows only
    future = torch.arange(n, device=query.device)[None, None, None, :] > top[..., None]
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    if dropout_p > 0:
        weights = nn.functional.dropout(weights, dropout_p)
    lazy_out = value.cumsum(dim=-2)
    if lazy == "cummean":
        lazy_out = lazy_out / torch.arange(1, n + 1, device=value.device, dtype=value.dtype)[:, None]
    return lazy_out.scatter(2, top[..., None].expand(b, h, u, value.shape[-1]), weights @ value)


class MaskedProbSparseAttention(nn.Module):
    """Projections around :func:`masked_probsparse_attention`. ``mix`` reproduces the authors' AttentionLayer
    flag that the decoder's self-attention sets: the [B, H, L, Dh] output is read as [B, L, H*Dh] without moving
    the head axis back, which mixes heads and positions before the output projection."""

    def __init__(self, d_model: int, heads: int, factor: float = 5.0, dropout: float = 0.0, mix: bool = True,
                 lazy: str = "cumsum") -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        if lazy not in LAZY_MASKED:
            raise ValueError(f"lazy must be one of {LAZY_MASKED}, got {lazy!r}")
        self.heads, self.factor, self.dropout, self.mix, self.lazy = heads, factor, dropout, mix, lazy
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = (split_heads(f(x), self.heads) for f in (self.to_q, self.to_k, self.to_v))
        out = masked_probsparse_attention(q, k, v, factor=self.factor, lazy=self.lazy,
                                          dropout_p=self.dropout if self.training else 0.0)  # [B, H, N, Dh]
        out = out.reshape(b, n, d) if self.mix else merge_heads(out)
        return self.to_out(out)


@register_model("informer", family="forecaster")
class Informer(GenerativeTransformer):
    """Informer with the paper's defaults: ProbSparse factor c = 5, 2 encoder layers with distilling, 1 decoder
    layer, d_model 512, 8 heads, d_ff 2048, dropout 0.05, GELU, label_len = seq_len // 2 (the code's ``mix`` on
    in the decoder self-attention and the cumulative-sum lazy queries of its masked ProbSparse)."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, label_len: int | None = None,
                 d_model: int = 512, heads: int = 8, encoder_layers: int = 2, decoder_layers: int = 1,
                 d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu", factor: float = 5.0,
                 distil: bool = True, mix: bool = True, lazy: str = "cumsum", calendar_dim: int = 0) -> None:
        super().__init__(
            channels, seq_len, pred_len, label_len=label_len, d_model=d_model, heads=heads,
            encoder_layers=encoder_layers, decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout,
            activation=activation, calendar_dim=calendar_dim, distil=distil,
            encoder_attention=lambda: attention_registry.build("informer", d_model, heads, factor=factor,
                                                               dropout=dropout),
            decoder_attention=lambda: MaskedProbSparseAttention(d_model, heads, factor, dropout, mix, lazy),
        )
