"""Sliding windows of keys, shared by the windowed mechanisms (``local``, ``sliding_sinks``).

* :func:`window_band`: the keys i - before .. i + after of query i as the :class:`~longattn.attention.chunked.Band`
  that the block-sparse kernel and :func:`~longattn.attention.chunked.windowed_attention` evaluate;
* :func:`dense_window_scores`: the dense scores of a float64 reference, the keys outside a query's window (a
  position rule each mechanism writes out for itself), after it when causal, or padded, at -inf. N x N: tests only.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from longattn.attention.chunked import Band

__all__ = ["dense_window_scores", "window_band"]


def window_band(before: int, after: int) -> Band:
    """The window of query i: keys i - ``before`` .. i + ``after``, both included."""
    return Band(1, -before, after + 1)


def dense_window_scores(query: Tensor, key: Tensor, attention_mask: Tensor | None,
                        sees: Callable[[Tensor, Tensor], Tensor], *, is_causal: bool, scale: float) -> Tensor:
    """q_i . k_j * ``scale`` [B, H, N, N] where ``sees(i, j)`` (query positions [N, 1], key positions [1, N]) allows
    key j, j <= i when ``is_causal`` and key j is real (``attention_mask`` [B, N], True = real); -inf elsewhere."""
    n = query.shape[-2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = sees(i, j)
    if is_causal:
        allowed = allowed & (j <= i)
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :]
    return (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
