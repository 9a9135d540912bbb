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
only ([B, #gaps, H, L]), which gives the same numbers as the authors' dense form, a mask on the [L, L] score
matrix (scores outside the pattern are -inf and get softmax weight exactly 0); tests compare it with that dense
form. The attention dropout's keep-mask is drawn on the pattern's cells only: dropout on a weight of 0 changes
nothing, so this is the dense dropout's distribution with O(L log L) draws instead of L^2, and no [L, L] tensor is
formed in training either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import budget_slices
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
        return self.channels_first(x).transpose(1, 2)

    def channels_first(self, x: Tensor) -> Tensor:
        """The convolution of x [B, L, d] in its own layout [B, d, L]."""
        return super().forward(F.pad(x.transpose(1, 2), (self.kernel_size[0] - 1, 0)))


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
        slices = budget_slices(x.shape[0], x[0].numel(), EVALUATION_SLICE_ELEMENTS)
        if self.training or torch.is_grad_enabled() or len(slices) == 1:
            return self.attend(x)
        # evaluation: a slice of batch rows at a time (each row's output depends on that row only; no dropout draws),
        # so that the layer's [rows, L, d]-sized buffers stay below glibc's mmap threshold (32 MiB) and come from the
        # heap instead of fresh page-faulting maps (at batch 256 and L = 432 each was 56 MB)
        return torch.cat([self.attend(x[rows]) for rows in slices])

    def attend(self, x: Tensor) -> Tensor:
        """The layer on x [B, L, d]."""
        b, n, d = x.shape
        # [B, H, Dh, L] operands (see _PatternAttention): the convolutions' own layout for q and k, the value and
        # output projections as batched products in and out of it (nn.Linear's numbers up to rounding, no copy to
        # and from [B, L, d]; at evaluation batches each copy is a fresh mmap that page-faults)
        heads_major = (b, self.heads, d // self.heads, n)
        q = self.to_q.channels_first(x).view(heads_major) * (d // self.heads) ** -0.5
        k = self.to_k.channels_first(x).view(heads_major)
        v = torch.baddbmm(self.to_v.bias[None, :, None].expand(b, d, n), self.to_v.weight.expand(b, d, d),
                          x.transpose(1, 2)).view(heads_major)
        gaps = logsparse_gaps(n, self.local_window)
        out = _PatternAttention.apply(q, k, v, gaps, self.dropout_noise(b, n, gaps, x)).view(b, d, n)
        return torch.baddbmm(self.to_out.bias.expand(b, n, d), out.transpose(1, 2), self.to_out.weight.T.expand(b, d, d))

    def dropout_noise(self, batch: int, n: int, gaps: list[int], x: Tensor) -> Tensor | None:
        """``self.dropout`` on the weights of the pattern's cells: the factor [B, #gaps, H, L] that multiplies them
        (None without dropout), each cell kept with probability 1 - p and scaled by 1 / (1 - p), as nn.Dropout
        does. Cells outside the pattern have weight 0, so drawing only the pattern's cells gives the distribution
        of dropout on the dense [B, H, L, L] weights. The cells before the sequence's start (i < g) are drawn too;
        their weight is 0."""
        p = self.dropout.p
        if not self.training or p == 0:
            return None
        factor = x.new_empty(batch, len(gaps), self.heads, n)
        if p == 1:
            return factor.zero_()  # nn.Dropout(1) draws nothing and zeroes everything
        return factor.bernoulli_(1 - p).div_(1 - p)


# Without gradients in evaluation, LogSparseConvAttention attends slices of batch rows of at most this many input
# elements (at least one row): 16 MiB in float32.
EVALUATION_SLICE_ELEMENTS = 1 << 22
# Batch rows per group of _PatternAttention: a group's [rows, H, Dh, L] operands hold at most this many elements (at
# least one row; 2 MiB in float32), so that the few passes over them per diagonal run in cache. Measured at the
# forecaster's sizes (L = 192-816, training batch 32, evaluation batch 256): 2^17 - 2^21 cost about the same in
# training, smaller groups cost more in evaluation (the per-call overhead of ~40 small operations per group).
PATTERN_GROUP_ELEMENTS = 1 << 19


class _PatternAttention(torch.autograd.Function):
    """Softmax attention on the LogSparse pattern's diagonals (gaps g_m, ``gaps[0]`` = 0), with the dropout factor
    ``noise`` [B, #gaps, H, L] (or None) on the weights, on [B, H, Dh, L] queries (already scaled), keys and values,
    with its backward written out, a group of batch rows at a time:

        s_m[i] = q_i . k_(i - g_m)  (-inf where i < g_m),   w = softmax over m of s,   out_i = sum_m (w_m noise_m)[i] v_(i - g_m)

    Dh-major, a diagonal's products are element-wise over contiguous rows of the sequence and the sums over Dh
    run across rows (not along rows of Dh = 16); autograd of the same slices formed a zero-filled full-size
    gradient per slice and diagonal. The products go through one scratch buffer of a group's size. Saved: the
    inputs and w ([B, #gaps, H, L])."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, gaps: list[int], noise: Tensor | None) -> Tensor:
        weights = query.new_empty(query.shape[0], len(gaps), query.shape[1], query.shape[-1])
        out = torch.empty_like(value)
        groups = _row_groups(query)
        scratch = query.new_empty(groups[0].stop, *query.shape[1:])
        for rows in groups:
            w = weights[rows]
            _diagonal_products(query[rows], key[rows], gaps, scratch, out=w, before=float("-inf"))
            torch.softmax(w, dim=1, out=w)
            _sum_over_diagonals(w if noise is None else w * noise[rows], value[rows], gaps, out=out[rows])
        ctx.save_for_backward(query, key, value, weights, noise)
        ctx.gaps = gaps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        query, key, value, weights, noise = ctx.saved_tensors
        gaps = ctx.gaps
        grad_query, grad_key, grad_value = (torch.empty_like(t) for t in (query, key, value))
        groups = _row_groups(query)
        scratch = query.new_empty(groups[0].stop, *query.shape[1:])
        for rows in groups:
            q, k, w, g_out = query[rows], key[rows], weights[rows], grad[rows]
            # out_i = sum_m dropped_m[i] v_(i - g_m): the gradients of dropped and of v
            grad_w = _diagonal_products(g_out, value[rows], gaps, scratch, out=torch.empty_like(w), before=0.0)
            _sum_over_diagonals(w if noise is None else w * noise[rows], g_out, gaps, out=grad_value[rows],
                                transpose=True)
            if noise is not None:
                grad_w.mul_(noise[rows])
            # softmax over the diagonals: ds = w (dw - sum_m w_m dw_m); zero where i < g_m (w = 0 there)
            grad_s = grad_w.sub_((w * grad_w).sum(1, keepdim=True)).mul_(w)
            _sum_over_diagonals(grad_s, k, gaps, out=grad_query[rows])
            _sum_over_diagonals(grad_s, q, gaps, out=grad_key[rows], transpose=True)
        return grad_query, grad_key, grad_value, None, None


def _diagonal_products(x: Tensor, y: Tensor, gaps: list[int], scratch: Tensor, out: Tensor, before: float) -> Tensor:
    """out[:, m, :, i] = x_i . y_(i - g_m) over Dh (``before`` where i < g_m), x, y [rows, H, Dh, L], out
    [rows, #gaps, H, L]; the products go through ``scratch`` (at least [rows, H, Dh, L])."""
    rows, n = x.shape[0], x.shape[-1]
    for m, g in enumerate(gaps):
        out[:, m, :, :g] = before
        product = torch.mul(x[..., g:], y[..., :n - g], out=scratch[:rows, ..., :n - g])
        torch.sum(product, dim=-2, out=out[:, m, :, g:])
    return out


def _row_groups(x: Tensor) -> list[slice]:
    """Groups of batch rows of [B, H, Dh, L] holding at most PATTERN_GROUP_ELEMENTS elements (at least one row)."""
    return budget_slices(x.shape[0], x[0].numel(), PATTERN_GROUP_ELEMENTS)


def _sum_over_diagonals(diagonals: Tensor, x: Tensor, gaps: list[int], out: Tensor, transpose: bool = False) -> Tensor:
    """out[..., i] = sum_m diagonals[:, m, ..., i] x[..., i - g_m] (an L x L matrix given by its diagonals, times x),
    or with ``transpose`` out[..., j] = sum_m diagonals[:, m, ..., j + g_m] x[..., j + g_m] (its transpose); x, out
    [rows, H, Dh, L], diagonals [rows, #gaps, H, L] (gap 0 first)."""
    n = x.shape[-1]
    torch.mul(diagonals[:, 0, :, None], x, out=out)
    for m, g in enumerate(gaps[1:], start=1):
        if transpose:
            out[..., :n - g].addcmul_(diagonals[:, m, :, None, g:], x[..., g:])
        else:
            out[..., g:].addcmul_(diagonals[:, m, :, None, g:], x[..., :n - g])
    return out


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
