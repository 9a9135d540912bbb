"""LogTrans (Li et al., "Enhancing the Locality and Breaking the Memory Bottleneck of Transformer on Time Series
Forecasting", NeurIPS 2019).

* Convolutional self-attention (Section 4.1, Figure 2): queries and keys come from a causal convolution of kernel
  k over the sequence (padding k - 1 on the left) instead of a pointwise projection, so that each query/key sees
  its local shape; values are a pointwise projection.
* LogSparse attention (Section 4.2, Figure 3): cell l attends to itself and to the cells l - 2^0, l - 2^1, ...,
  l - 2^floor(log2 l) (O(log L) cells each, O(L log L) in all); optionally also densely to its previous
  ``local_window`` cells ("local attention", Figure 3c).
* The model is the paper's decoder-only (causal) Transformer. For the direct multi-horizon benchmark it runs once
  over [window; ``pred_len`` zero placeholders] and reads the forecast at the placeholders (the generative
  one-pass decoding of Informer instead of the paper's step-by-step rollout; see docs/forecasting_models.md).

The pattern is a set of diagonals: cell i attends to i - g for every allowed gap g (0, the powers of two, and
1 .. ``local_window``), O(log L) of them. :class:`LogSparseConvAttention` computes the scores of those diagonals
only ([#gaps, B, H, L]), which gives the same numbers as the authors' dense form, a mask on the [L, L] score
matrix (scores outside the pattern are -inf and get softmax weight exactly 0); tests compare it with that dense
form. The one [L, L] tensor left is the attention dropout's keep-mask in training: it is drawn over all L x L
cells, as dropout on the dense weights draws it, so the random numbers are consumed exactly as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import merge_heads, split_heads
from longattn.models.forecast_blocks import GenerativeTransformer
from longattn.models.registry import register_model


def logsparse_gaps(length: int, local_window: int = 0) -> list[int]:
    """The gaps i - j (ascending) that the pattern allows within ``length`` cells: 0, 1 .. local_window and
    every power of two (Section 4.2); query i attends to key i - g for each gap g <= i."""
    powers = {1 << m for m in range(max(length - 1, 0).bit_length())}
    return sorted({0} | powers | set(range(1, min(local_window, length - 1) + 1)))


def logsparse_mask(length: int, local_window: int = 0, device: torch.device | None = None) -> Tensor:
    """Bool [L, L], True where query i may attend key j: j = i, j = i - 2^m (m >= 0), or 0 < i - j <= local_window."""
    i = torch.arange(length, device=device)[:, None]
    gap = i - torch.arange(length, device=device)[None, :]
    power_of_two = (gap > 0) & ((gap & (gap - 1)) == 0)
    return (gap == 0) | power_of_two | ((gap > 0) & (gap <= local_window))


class CausalConv1d(nn.Conv1d):
    """Conv1d over time of [B, L, d] that sees only the current and the k - 1 previous steps."""

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__(d_model, d_model, kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        padded = F.pad(x.transpose(1, 2), (self.kernel_size[0] - 1, 0))
        return super().forward(padded).transpose(1, 2)


class LogSparseConvAttention(nn.Module):
    """Multi-head convolutional self-attention restricted to the LogSparse pattern (always causal)."""

    def __init__(self, d_model: int, heads: int, kernel_size: int = 3, local_window: int = 0,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        if kernel_size < 1 or local_window < 0:
            raise ValueError(f"kernel_size must be >= 1 and local_window >= 0, got {kernel_size}, {local_window}")
        self.heads, self.local_window = heads, local_window
        self.to_q, self.to_k = CausalConv1d(d_model, kernel_size), CausalConv1d(d_model, kernel_size)
        self.to_v, self.to_out = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = (split_heads(f(x), self.heads) for f in (self.to_q, self.to_k, self.to_v))
        q = q * (d // self.heads) ** -0.5
        gaps = logsparse_gaps(n, self.local_window)
        # scores[m, ..., i] = q_i . k_(i - g_m): the pattern's diagonals of Q K^T / sqrt(d_head), gaps first (the
        # softmax over them then runs across whole [B, H, L] slices, not along rows of ~10); -inf where i < g_m,
        # so the softmax over a row's gaps equals the dense masked softmax on the pattern
        scores = torch.stack([F.pad((q[:, :, g:] * k[:, :, : n - g]).sum(-1), (g, 0), value=float("-inf"))
                              for g in gaps])
        weights = self.dropout_on_pattern(torch.softmax(scores, dim=0), gaps)
        out = weights[0, ..., None] * v  # gap 0 first, then each diagonal added onto the rows it reaches
        for m, g in enumerate(gaps[1:], start=1):
            out[:, :, g:] += weights[m, :, :, g:, None] * v[:, :, : n - g]
        return self.to_out(merge_heads(out))

    def dropout_on_pattern(self, weights: Tensor, gaps: list[int]) -> Tensor:
        """``self.dropout`` as it acts on the dense [B, H, L, L] weights, applied to their pattern diagonals
        [#gaps, B, H, L]: the keep-mask is drawn over all L x L cells (the same draws, the same order) and read
        on the pattern's diagonals; kept weights are scaled by 1 / (1 - p) as nn.Dropout scales them."""
        p = self.dropout.p
        if not self.training or p == 0:
            return weights
        if p == 1:
            return weights * 0  # nn.Dropout(1) draws nothing and zeroes everything
        _, b, h, n = weights.shape
        keep = torch.empty(b, h, n, n, dtype=torch.bool, device=weights.device).bernoulli_(1 - p)
        noise = torch.zeros_like(weights)
        for m, g in enumerate(gaps):
            noise[m, :, :, g:] = keep.diagonal(-g, dim1=-2, dim2=-1)
        return weights * noise.div_(1 - p)


@register_model("logtrans", family="forecaster")
class LogTrans(GenerativeTransformer):
    """LogTrans: a causal Transformer of LogSparse convolutional self-attention over [window; zeros].
    Defaults: 2 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.05, GELU (the benchmark family's settings),
    convolution kernel k = 3, no extra local window."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, d_model: int = 512, heads: int = 8,
                 layers: int = 2, d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu",
                 kernel_size: int = 3, local_window: int = 0, calendar_dim: int = 0) -> None:
        super().__init__(
            channels, seq_len, pred_len, label_len=None, d_model=d_model, heads=heads, encoder_layers=layers,
            decoder_layers=0, d_ff=d_ff, dropout=dropout, activation=activation, calendar_dim=calendar_dim,
            encoder_attention=lambda: LogSparseConvAttention(d_model, heads, kernel_size, local_window, dropout),
            form="encoder_only",
        )
