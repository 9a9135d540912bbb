"""Longformer (Beltagy et al., 2020): sliding-window attention plus task-specific global tokens.

* **sliding window** (Sec. 3.1): token ``i`` attends to the ``w/2`` tokens on each side,
  ``j = i + delta * t`` for ``|t| <= w/2`` (``delta`` = dilation, 1 by default);
* **global attention** (Sec. 3.1): a few chosen positions attend to every token and every token
  attends to them (symmetric). Global attention has its own projections ``Q_g, K_g, V_g`` for the
  global tokens' rows ("Linear Projections for Global Attention"); the sliding-window rows use
  ``Q_s, K_s, V_s``, including for their scores on the global keys.

The interface has no per-call global mask, so the global positions are a module option (default:
the first token, the usual [CLS] choice). Each non-global query sees ``window ∪ globals`` under one
softmax (a global key inside the window counts once). Computed in chunks of ``w/2`` queries
against their ``w/2 + w * delta`` window keys plus the global keys, each chunk through SDPA's fused
kernel: memory O(N (1 + 2 delta + 2G/w) Dh) per head for the gathered keys, never N x N.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    padding_safe,
    register_attention,
    split_heads,
)

__all__ = ["LongformerAttention", "longformer_attention", "longformer_attention_reference"]


def _check_window(attention_window: int, dilation: int) -> None:
    if (
        not isinstance(attention_window, int) or isinstance(attention_window, bool)
        or attention_window < 2 or attention_window % 2
    ):
        raise AttentionError(
            f"attention_window must be an even int >= 2 (w/2 per side), got {attention_window!r}"
        )
    if not isinstance(dilation, int) or isinstance(dilation, bool) or dilation < 1:
        raise AttentionError(f"dilation must be a positive int, got {dilation!r}")


def _check_global_positions(global_positions: Sequence[int]) -> tuple[int, ...]:
    positions = tuple(global_positions)
    if any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in positions):
        raise AttentionError(f"global_positions must be non-negative ints, got {global_positions!r}")
    if len(set(positions)) != len(positions):
        raise AttentionError(f"global_positions must not repeat, got {global_positions!r}")
    return tuple(sorted(positions))


def _global_index(global_positions: Sequence[int], length: int, device: torch.device) -> Tensor:
    """The global positions that exist in a sequence of ``length`` tokens (longer ones are ignored)."""
    positions = [p for p in _check_global_positions(global_positions) if p < length]
    return torch.tensor(positions, dtype=torch.long, device=device)


# Query tokens per group of window chunks (recomputed together in backward).
LONGFORMER_GROUP_TOKENS = 512


@padding_safe
def longformer_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    attention_window: int = 512,
    dilation: int = 1,
    global_positions: Sequence[int] = (0,),
    global_query: Tensor | None = None,
    global_key: Tensor | None = None,
    global_value: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Longformer attention on [B, H, N, Dh]: dilated sliding window + global tokens, O(N (w + G)).

    ``global_query/key/value``: the Q_g, K_g, V_g projections ([B, H, N, Dh], only the global rows
    of ``global_query`` are used); None = reuse ``query``/``key``/``value``.
    """
    check_qkv(query, key, value, attention_mask)
    _check_window(attention_window, dilation)
    b, h, n, d = query.shape
    if key.shape[2] != n:
        raise AttentionError("Longformer attention is self-attention: query and key lengths must match")
    global_query = query if global_query is None else global_query
    global_key = key if global_key is None else global_key
    global_value = value if global_value is None else global_value
    globals_ = (("global_query", global_query), ("global_key", global_key), ("global_value", global_value))
    for label, t in globals_:
        if t.shape[:3] != (b, h, n) or t.dtype != query.dtype:
            raise AttentionError(
                f"{label} must be [B, H, N, Dh] = [{b}, {h}, {n}, Dh] of dtype {query.dtype}"
            )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    device = query.device
    real = torch.ones(b, n, dtype=torch.bool, device=device) if attention_mask is None else attention_mask
    gidx = _global_index(global_positions, n, device)
    is_global = torch.zeros(n, dtype=torch.bool, device=device)
    is_global[gidx] = True

    # -- sliding-window rows, chunk by chunk: c = w/2 queries see keys [start - reach, start + c + reach)
    # plus the G global keys, all under one softmax, each chunk through SDPA's fused kernel (no
    # [rows, keys] weights are kept for backward). Chunks go to the batch axis and are gathered
    # token-major, [chunks, keys, H, D] (the fused kernel's own layout, seen as [chunks, H, keys, D]),
    # so one index picks a chunk's keys for every head and one mask per chunk serves all heads.
    half = attention_window // 2
    reach = dilation * half
    chunk = half
    chunks = -(-n // chunk)
    span = chunk + 2 * reach
    tail = chunks * chunk - n
    g = gidx.numel()

    # key offset relative to the query: (chunk_start - reach + s) - (chunk_start + r) = s - r - reach
    offset = torch.arange(span, device=device)[None, :] - torch.arange(chunk, device=device)[:, None] - reach
    in_window = (offset.abs() <= reach) & (offset % dilation == 0)
    if is_causal:
        in_window = in_window & (offset <= 0)
    # keys that exist, are real and are not global (global keys are added once, at the end)
    key_ok = F.pad(real & ~is_global, (reach, tail + reach)).unfold(1, span, chunk)  # [B, C, span]
    visible_glob = real[:, gidx][:, None, None, :].expand(b, chunks, chunk, g)
    if is_causal:
        query_pos = torch.arange(chunks * chunk, device=device).view(chunks, chunk, 1)
        visible_glob = visible_glob & (gidx.view(1, 1, g) <= query_pos)

    # token-major and padded: key position p sits at row p + reach
    query_t = F.pad(query.transpose(1, 2), (0, 0, 0, 0, 0, tail)).unflatten(1, (chunks, chunk))  # [B, C, c, H, D]
    key_t, value_t = (F.pad(t.transpose(1, 2), (0, 0, 0, 0, reach, tail + reach)) for t in (key, value))

    def attend_chunks(batch: Tensor, chunk_idx: Tensor, visible: Tensor) -> Tensor:
        """Chunks (batch[i], chunk_idx[i]) under ``visible`` ([c, span + G] or [M, 1, c, span + G]) -> [M, c, H, D]."""
        window = chunk_idx[:, None] * chunk + torch.arange(span, device=device)
        rows = torch.cat([window, (gidx + reach).expand(len(window), g)], dim=1)  # local rows use K_s, V_s on globals
        k, v = (t[batch[:, None], rows].transpose(1, 2) for t in (key_t, value_t))
        q = query_t[batch, chunk_idx].transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout_p, scale=scale)
        out = torch.where(visible.any(-1)[..., None], out, 0.0)  # queries that see no key output zeros
        return out.transpose(1, 2)

    # Most chunks see every key of their span and every global key: their mask is the window band
    # alone, one [c, span + G] tensor for all of them. Only the others (sequence ends, padding, global
    # tokens inside the span) get masks of their own, so masks cost O(such chunks), not O(N (w + G)).
    unmasked = key_ok.all(-1) & visible_glob.flatten(2).all(-1)  # [B, C]
    # Groups of chunks, each recomputed in backward (checkpoint): one group's gathered keys, values
    # and masks are the only such copies alive at a time, forward or backward.
    step = max(1, LONGFORMER_GROUP_TOKENS // chunk)

    def attend_in_groups(batch: Tensor, chunk_idx: Tensor, visible_of: Callable[[slice], Tensor]) -> Tensor:
        return torch.cat([
            checkpoint(attend_chunks, batch[i:i + step], chunk_idx[i:i + step], visible_of(slice(i, i + step)),
                       use_reentrant=False)
            for i in range(0, batch.numel(), step)
        ])

    out = query_t.new_zeros(b, chunks, chunk, h, value.shape[-1])
    open_chunks = unmasked.nonzero().unbind(1)
    if open_chunks[0].numel():
        band = torch.cat([in_window, in_window.new_ones(chunk, g)], dim=-1)
        out = out.index_put(open_chunks, attend_in_groups(*open_chunks, lambda _: band))
    masked_chunks = (~unmasked).nonzero().unbind(1)
    if masked_chunks[0].numel():
        visible_win = in_window & key_ok[masked_chunks][:, None, :]  # [M, c, span]
        visible = torch.cat([visible_win, visible_glob[masked_chunks]], dim=-1)[:, None]  # [M, 1, c, span + G]
        out = out.index_put(masked_chunks, attend_in_groups(*masked_chunks, lambda rows: visible[rows]))
    out = out.flatten(1, 2)[:, :n].transpose(1, 2)  # [B, H, N, D]
    if g == 0:
        return out

    # -- global rows: Q_g of the global tokens against K_g, V_g of every token (full rows)
    visible_g = real[:, None, None, :].expand(b, 1, g, n)
    if is_causal:
        visible_g = visible_g & (torch.arange(n, device=device)[None, :] <= gidx[:, None])
    out_g = F.scaled_dot_product_attention(global_query[:, :, gidx], global_key, global_value,
                                           attn_mask=visible_g, dropout_p=dropout_p, scale=scale)
    out_g = torch.where(visible_g.any(-1, keepdim=True), out_g, 0.0)
    return out.index_copy(2, gidx, out_g)


@padding_safe
def longformer_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    attention_window: int = 512,
    dilation: int = 1,
    global_positions: Sequence[int] = (0,),
    global_query: Tensor | None = None,
    global_key: Tensor | None = None,
    global_value: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Plain version with full N x N masks; for tests only."""
    b, h, n, d = query.shape
    global_query = query if global_query is None else global_query
    global_key = key if global_key is None else global_key
    global_value = value if global_value is None else global_value
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    real = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask
    is_global = torch.zeros(n, dtype=torch.bool)
    is_global[[p for p in global_positions if p < n]] = True
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    window = ((i - j).abs() <= dilation * (attention_window // 2)) & ((i - j) % dilation == 0)
    allowed = (window | is_global[None, :]) & real[:, None, None, :]
    allowed_g = real[:, None, None, :].expand(b, 1, n, n)
    if is_causal:
        allowed = allowed & (j <= i)
        allowed_g = allowed_g & (j <= i)

    def attend(q: Tensor, k: Tensor, v: Tensor, ok: Tensor) -> Tensor:
        scores = q @ k.transpose(-1, -2) * scale
        w = torch.exp(scores - scores.amax(-1, keepdim=True)) * ok
        total = w.sum(-1, keepdim=True)  # rows with nothing visible stay 0, finite gradients
        return w / total.masked_fill(total == 0, 1.0) @ v

    local_rows = attend(query, key, value, allowed)
    global_rows = attend(global_query, global_key, global_value, allowed_g)
    return torch.where(is_global[:, None], global_rows, local_rows)


@register_attention(
    "longformer",
    capabilities=Capabilities(causal=True, subquadratic=True),
    functional=longformer_attention,
    reference=longformer_attention_reference,
    paper="Longformer: The Long-Document Transformer (Beltagy, Peters and Cohan, 2020)",
)
class LongformerAttention(AttentionBase):
    """Longformer: (dilated) sliding-window attention plus global attention on fixed positions.

    Options (paper defaults):
        attention_window: w, total window; w/2 tokens on each side (512).
        dilation: gap between window keys (1 = no dilation).
        global_positions: positions with global attention ((0,) = the first token, e.g. [CLS]);
            positions beyond a sequence's length are ignored; () = sliding window only.
        separate_global_projections: Q_g, K_g, V_g for the global rows (True), else reuse Q_s, K_s, V_s.
        dropout: attention dropout while training.
        scale: score scale; None = 1/sqrt(head dim).
        bias: biases of the projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        attention_window: int = 512,
        dilation: int = 1,
        global_positions: Sequence[int] = (0,),
        separate_global_projections: bool = True,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        _check_window(attention_window, dilation)
        if isinstance(global_positions, (str, bytes)) or not isinstance(global_positions, Sequence):
            raise AttentionError(f"global_positions must be a sequence of ints, got {global_positions!r}")
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        self.attention_window = attention_window
        self.dilation = dilation
        self.global_positions = _check_global_positions(global_positions)
        self.dropout = dropout
        self.scale = scale
        self.proj = QKVProjection(dim, heads, bias=bias)  # Q_s, K_s, V_s and the output map
        self.global_proj: nn.ModuleDict | None = None
        if separate_global_projections:
            self.global_proj = nn.ModuleDict(
                {name: nn.Linear(dim, dim, bias=bias) for name in ("query", "key", "value")}
            )

    def global_qkv(self, x: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Q_g, K_g, V_g split into heads (None when the sliding-window projections are reused)."""
        if self.global_proj is None:
            return None, None, None
        return tuple(split_heads(self.global_proj[name](x), self.heads) for name in ("query", "key", "value"))

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        gq, gk, gv = self.global_qkv(x)
        out = longformer_attention(
            q, k, v, attention_mask,
            attention_window=self.attention_window,
            dilation=self.dilation,
            global_positions=self.global_positions,
            global_query=gq,
            global_key=gk,
            global_value=gv,
            is_causal=self.causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, attention_window={self.attention_window}, dilation={self.dilation}, "
            f"global_positions={self.global_positions}, causal={self.causal}"
        )
