"""Sliding-window attention with attention sinks: GPT-OSS's learned sink logit per head, StreamingLLM's first
tokens kept, or both.

Each query attends to the ``window_size`` most recent keys, itself included (causal: keys i - w + 1 .. i;
non-causal: |i - j| < w), plus its sinks:

* ``learned_sink`` (GPT-OSS, OpenAI 2025, model card section 2): one learned logit s_h per head joins every
  query's softmax denominator with no value, out_i = sum_j exp(l_ij) v_j / (exp(s_h) + sum_j exp(l_ij)), so a
  head can put weight "nowhere" when no key in its window matters;
* ``sink_tokens`` (StreamingLLM, Xiao et al., ICLR 2024, section 3.2): the first ``sink_tokens`` positions stay
  visible to every (later, if causal) query whatever the window, the attention sinks that keep a windowed
  model's softmax stable on long streams. Positions are array positions: in a left-padded row they are
  padding, which no query sees.

Both run through :func:`longattn.attention.chunked.windowed_attention`, all query chunks at once against their
windows plus the sinks as extra keys (one SDPA call): O(N (w + sinks) D) time and memory, no N x N tensor, the
same code on the CPU and GPU paths. The learned logit is an extra key of value zero whose score is s_h for every
query: the queries get a constant 1 as one more feature and that key the feature s_h / scale, the other keys 0.
The decoding state keeps the last w - 1 keys and values and the sink tokens' only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    output_dtype,
    padding_safe,
    register_attention,
)
from longattn.attention.chunked import SparsePattern, window_chunk, windowed_attention
from longattn.attention.decoding import WindowState, attend_keys, ones_or
from longattn.attention.ops.window import dense_window_scores, window_band


def _check_options(window_size: int, sink_tokens: int) -> None:
    if not isinstance(window_size, int) or window_size < 1:
        raise AttentionError(f"window_size must be a positive int, got {window_size!r}")
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise AttentionError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")


def with_sink_feature(query: Tensor, key: Tensor, sink_logits: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Queries and keys one feature wider, and the sink key: (q | 1) . (k | 0) = q . k and (q | 1) . (0 | s_h / scale)
    = s_h / scale, so the sink key scores s_h for every query (``sink_logits`` [H]). Returns (query, key, sink key
    [B, H, 1, D + 1])."""
    b, h = key.shape[:2]
    query = F.pad(query, (0, 1), value=1.0)
    key = F.pad(key, (0, 1))
    sink = F.pad((sink_logits.to(key.dtype) / scale).view(1, h, 1, 1), (key.shape[-1] - 1, 0)).expand(b, -1, -1, -1)
    return query, key, sink


@padding_safe
def sliding_sinks_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    window_size: int = 256,
    sink_tokens: int = 0,
    sink_logits: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Sliding-window attention with sinks on [B, H, N, Dh]: the first ``sink_tokens`` keys always visible and, with
    ``sink_logits`` [H], a per-head logit in every softmax; ``attention_mask`` bool [B, N], True = real key."""
    check_qkv(query, key, value, attention_mask)
    _check_options(window_size, sink_tokens)
    b, h, n, d = query.shape
    if sink_logits is not None and tuple(sink_logits.shape) != (h,):
        raise AttentionError(f"sink_logits must be [H] = [{h}], got {list(sink_logits.shape)}")
    dtype = output_dtype(query)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    valid = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    extra_keys, extra_values, extra_pos, extra_valid = [], [], [], []
    if sink_logits is not None:
        query, key, sink = with_sink_feature(query, key, sink_logits, scale)
        extra_keys.append(sink)
        extra_values.append(value.new_zeros(b, h, 1, value.shape[-1]))
        extra_pos.append(torch.zeros(1, dtype=torch.long, device=query.device))
        extra_valid.append(torch.ones(b, 1, dtype=torch.bool, device=query.device))
    sinks = min(sink_tokens, n)
    if sinks:  # the sink tokens are extra keys, so the windows must not count them again
        extra_keys.append(key[:, :, :sinks])
        extra_values.append(value[:, :, :sinks])
        extra_pos.append(torch.arange(sinks, device=query.device))
        extra_valid.append(valid[:, :sinks])
        valid = F.pad(valid[:, sinks:], (sinks, 0), value=False)
    band = window_band(window_size - 1, 0 if is_causal else window_size - 1)  # i - w + 1 .. i (+ w - 1)
    pattern = SparsePattern(band, is_causal, key_valid=valid,
                            extra_pos=torch.cat(extra_pos) if extra_pos else None,
                            extra_valid=torch.cat(extra_valid, dim=1) if extra_valid else None)
    out = windowed_attention(query, key, value, pattern, window_chunk(band),
                             extra_key=torch.cat(extra_keys, dim=2) if extra_keys else None,
                             extra_value=torch.cat(extra_values, dim=2) if extra_values else None,
                             scale=scale, dropout_p=dropout_p)
    return out.transpose(1, 2)


@padding_safe
def sliding_sinks_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    window_size: int = 256,
    sink_tokens: int = 0,
    sink_logits: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Dense N x N version: the window and sink tokens as a mask, the sink logit as one more softmax column. Tests only."""
    b, h, n, d = query.shape

    def sees(i: Tensor, j: Tensor) -> Tensor:  # the window, and the sink tokens from anywhere
        return ((i - j).abs() < window_size) | (j < sink_tokens)

    scores = dense_window_scores(query, key, attention_mask, sees, is_causal=is_causal,
                                 scale=1.0 / math.sqrt(d) if scale is None else scale)
    if sink_logits is not None:
        scores = torch.cat([scores, sink_logits.to(scores.dtype).view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :n]
    return weights @ value


@dataclass
class SinkWindowState(WindowState):
    """The last ``window_size - 1`` positions (:class:`WindowState`) and the sink tokens' keys and values
    [B, H, sink_tokens, D], with which of them are real (False while a sink slot is not yet reached)."""

    sink_keys: Tensor | None = None
    sink_values: Tensor | None = None
    sink_real: Tensor | None = None


@register_attention(
    "sliding_sinks",
    capabilities=Capabilities(causal=True),
    functional=sliding_sinks_attention,
    reference=sliding_sinks_attention_reference,
    paper="gpt-oss-120b & gpt-oss-20b Model Card (OpenAI, 2025); Efficient Streaming Language Models with "
          "Attention Sinks (Xiao et al., ICLR 2024)",
)
class SlidingSinksAttention(AttentionBase):
    """Sliding-window attention with attention sinks: a learned logit per head and/or the first tokens kept."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        window_size: int = 256,
        sink_tokens: int = 0,
        learned_sink: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        _check_options(window_size, sink_tokens)
        self.proj = QKVProjection(dim, heads)
        self.window_size = window_size
        self.sink_tokens = sink_tokens
        # GPT-OSS learns one logit per head; zero at the start weighs the sink like one key of score 0
        self.sink_logits = nn.Parameter(torch.zeros(heads)) if learned_sink else None
        self.dropout = dropout

    def _heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        return sliding_sinks_attention(query, key, value, attention_mask, window_size=self.window_size,
                                       sink_tokens=self.sink_tokens, sink_logits=self.sink_logits,
                                       is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        return self.proj.out(self._heads(q, k, v, attention_mask))

    # -- decoding: the window and the sinks ---------------------------------------------------------
    decode_state = "window"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, SinkWindowState]:
        out = self._heads(query, key, value, attention_mask)
        b, h, n, _ = key.shape
        real = torch.ones(b, n, dtype=torch.bool, device=key.device) if attention_mask is None else attention_mask
        window = WindowState.start(key, value, real, self.window_size - 1)
        take = min(self.sink_tokens, n)
        keep = real[:, None, :take, None]
        fill = (0, 0, 0, self.sink_tokens - take)
        state = SinkWindowState(length=n, keys=window.keys, values=window.values, real=window.real,
                                sink_keys=F.pad(key[:, :, :take].masked_fill(~keep, 0.0), fill),
                                sink_values=F.pad(value[:, :, :take].masked_fill(~keep, 0.0), fill),
                                sink_real=F.pad(real[:, :take], (0, self.sink_tokens - take), value=False))
        return out, state

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: SinkWindowState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, SinkWindowState]:
        """The new query (position t) against the sinks and positions t - w + 1 .. t not among them."""
        new_real = ones_or(real, key.shape[0], key.device)
        keys, values, visible = state.with_token(key, value, new_real)
        t, s = state.length, self.sink_tokens
        if t < s:  # the new token is a sink token itself
            keep = new_real[:, None, None, None]
            state.sink_keys = torch.cat([state.sink_keys[:, :, :t], key.masked_fill(~keep, 0.0),
                                         state.sink_keys[:, :, t + 1:]], dim=2)
            state.sink_values = torch.cat([state.sink_values[:, :, :t], value.masked_fill(~keep, 0.0),
                                           state.sink_values[:, :, t + 1:]], dim=2)
            state.sink_real = torch.cat([state.sink_real[:, :t], new_real[:, None], state.sink_real[:, t + 1:]], dim=1)
        in_window = torch.arange(t - self.window_size + 1, t + 1, device=key.device) >= s  # not a sink, not before 0
        all_keys = torch.cat([state.sink_keys, keys], dim=2)
        all_values = torch.cat([state.sink_values, values], dim=2)
        seen = torch.cat([state.sink_real, visible & in_window], dim=1)
        scale = 1.0 / math.sqrt(query.shape[-1])
        q = query
        if self.sink_logits is not None:
            q, all_keys, sink = with_sink_feature(query, all_keys, self.sink_logits, scale)
            all_keys = torch.cat([all_keys, sink], dim=2)
            all_values = F.pad(all_values, (0, 0, 0, 1))
            seen = F.pad(seen, (0, 1), value=True)
        out = attend_keys(q, all_keys, all_values, seen[:, None, None, :], scale=scale,
                          dropout_p=self.dropout if self.training else 0.0)
        state.slide(keys, values, visible)
        return out, state

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window_size={self.window_size}, sink_tokens={self.sink_tokens}, "
                f"learned_sink={self.sink_logits is not None}")
