"""Autoformer (Wu et al., "Autoformer: Decomposition Transformers with Auto-Correlation for Long-Term Series
Forecasting", NeurIPS 2021).

The decomposition Transformer (:class:`~longattn.models.forecast_blocks.DecompEncoderDecoder`: series
decomposition blocks, eq. 1, inside every layer, eq. 3-4; decoder initialised with the seasonal part of the last
``label_len`` steps plus zeros and their trend plus the window mean, eq. 2) with the Auto-Correlation mechanism
(Section 3.2) in place of attention:

* period-based dependencies, eq. 5 and 8: R_{Q,K}(tau) = F^{-1}(F(Q) conj(F(K)))(tau), i.e. the circular
  correlation sum_t Q_{t} K_{t - tau}, for all lags at once by FFT (O(L log L));
* time delay aggregation, eq. 6: tau_1..tau_k = argTopk R(tau) with k = floor(c ln L), weights
  softmax(R(tau_1) .. R(tau_k)), output sum_i Roll(V, tau_i) * weight_i, where Roll(V, tau)_t = V_{t + tau}
  (cyclic);
* for cross-correlation the keys and values are cut to (or zero-padded to) the query length.

As in the authors' code, R is averaged over the heads and channels before the delays are chosen (one set of
delays per series). ``delay_selection="per_sample"`` (default, eq. 6 as written) picks the delays per sample;
``"batch_shared_in_training"`` reproduces the authors' training shortcut (delays shared by the batch while
training, per sample in eval).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longattn.models.forecast_blocks import (
    DecompEncoderDecoder,
    SeriesDecomposition,
    log_length_count,
    truncate_or_pad_keys,
)
from longattn.models.registry import register_model

DELAY_SELECTIONS = ("per_sample", "batch_shared_in_training")


def autocorrelation(queries: Tensor, keys: Tensor) -> Tensor:
    """R(tau) of eq. 8 for every lag: [B, L, H, E] twice -> [B, H, E, L] (keys already aligned to L)."""
    n = queries.shape[1]
    q = torch.fft.rfft(queries.permute(0, 2, 3, 1), dim=-1)
    k = torch.fft.rfft(keys.permute(0, 2, 3, 1), dim=-1)
    return torch.fft.irfft(q * torch.conj(k), n=n, dim=-1)


def time_delay_aggregation(values: Tensor, delays: Tensor, weights: Tensor) -> Tensor:
    """eq. 6: sum_i weights[b, i] * Roll(V, delays[b, i]); values [B, H, E, L], delays/weights [B, k]. The plain
    form (an element gather along time), the reference of :func:`time_delay_aggregation_rows`."""
    b, h, e, n = values.shape
    doubled = torch.cat([values, values], dim=-1)  # Roll(V, tau)_t = V_{(t + tau) mod L}
    out = torch.zeros_like(values)
    steps = torch.arange(n, device=values.device)
    for i in range(delays.shape[1]):
        index = (steps[None, :] + delays[:, i : i + 1])[:, None, None, :].expand(b, h, e, n)
        out = out + doubled.gather(-1, index) * weights[:, i, None, None, None].to(values.dtype)
    return out


def time_delay_aggregation_rows(values: Tensor, delays: Tensor, weights: Tensor) -> Tensor:
    """:func:`time_delay_aggregation` on token-major values [B, L, H, E] -> [B, L, H, E]: Roll(V, tau) of one
    sample is its L rows of H * E values taken from (t + tau) mod L, so each delay is one ``index_select`` of
    whole rows (and its backward an ``index_add_`` of rows) instead of an element gather (and scatter) along
    the last axis of the [B, H, E, L] transpose (~3x less CPU forward + backward at the forecasters' sizes).
    The same products and sums in the same order: equal to the plain form bit for bit."""
    b, n, h, e = values.shape
    rows = values.reshape(b * n, h * e)
    sample_start = torch.arange(b, device=values.device)[:, None] * n
    steps = torch.arange(n, device=values.device)
    out = torch.zeros_like(values)
    for i in range(delays.shape[1]):
        index = (sample_start + (steps[None, :] + delays[:, i : i + 1]) % n).flatten()
        out = out + rows.index_select(0, index).view(b, n, h, e) * weights[:, i, None, None, None].to(values.dtype)
    return out


class AutoCorrelation(nn.Module):
    """The Auto-Correlation mechanism on heads [B, L, H, E] (Section 3.2)."""

    def __init__(self, factor: float = 1.0, delay_selection: str = "per_sample") -> None:
        super().__init__()
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        if delay_selection not in DELAY_SELECTIONS:
            raise ValueError(f"delay_selection must be one of {DELAY_SELECTIONS}, got {delay_selection!r}")
        self.factor, self.delay_selection = factor, delay_selection

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        n = queries.shape[1]
        keys, values = truncate_or_pad_keys(keys, values, n)
        correlation = autocorrelation(queries, keys).mean(dim=(1, 2))  # [B, L], averaged over heads/channels
        top_k = log_length_count(self.factor, n)
        if self.training and self.delay_selection == "batch_shared_in_training":
            delays = correlation.mean(0).topk(top_k).indices.expand(correlation.shape[0], -1)
            scores = correlation.gather(1, delays)
        else:
            scores, delays = correlation.topk(top_k, dim=-1)
        return time_delay_aggregation_rows(values, delays, torch.softmax(scores, dim=-1))


@register_model("autoformer", family="forecaster")
class Autoformer(DecompEncoderDecoder):
    """Autoformer with the paper's defaults: 2 encoder / 1 decoder layers, d_model 512, 8 heads, d_ff 2048,
    dropout 0.05, GELU, moving average 25, c = 1 (k = floor(ln L) delays), label_len = seq_len // 2."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, label_len: int | None = None,
                 d_model: int = 512, heads: int = 8, encoder_layers: int = 2, decoder_layers: int = 1,
                 d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu", moving_avg: int = 25,
                 factor: float = 1.0, delay_selection: str = "per_sample", calendar_dim: int = 0) -> None:
        inner = lambda: AutoCorrelation(factor, delay_selection)  # noqa: E731
        super().__init__(
            channels, seq_len, pred_len, label_len=label_len, d_model=d_model, heads=heads,
            encoder_layers=encoder_layers, decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout,
            activation=activation, calendar_dim=calendar_dim,
            decomposition=lambda: SeriesDecomposition(moving_avg),
            encoder_inner=inner, decoder_inner=inner, cross_inner=inner,
        )
