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
kernel: memory O(N (1 + 2 delta + 2G/w) Dh) per head for the gathered keys, never N x N. On a
GPU every chunk runs at once (:func:`longformer_attention_gpu`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention._triton import pytorch_path_where_kernels_do_not_fit, triton_runs_on
from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    output_dtype,
    padding_safe,
    register_attention,
    split_heads,
    uses_gpu_path,
)
from longattn.attention.chunked import (
    Band,
    Chunk,
    SparsePattern,
    chunked_attention,
    chunked_projected_attention,
    window_chunk,
    windowed_attention,
)
from longattn.attention.decoding import DecodingState, KVState, WindowState, attend_keys, ones_or

__all__ = ["LongformerAttention", "LongformerState", "longformer_attention", "longformer_attention_reference"]


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


@dataclass(frozen=True)
class _Options:
    half: int  # w/2: queries per window chunk
    dilation: int
    is_causal: bool
    scale: float
    dropout_p: float

    @property
    def reach(self) -> int:
        return self.dilation * self.half


def _plan(real: Tensor, gidx: Tensor, options: _Options) -> list[Chunk]:
    """Groups of window chunks (rows, their window keys and the global keys), then the global rows."""
    b, n = real.shape
    is_global = torch.zeros(n, dtype=torch.bool, device=real.device)
    is_global[gidx] = True
    c, reach = options.half, options.reach
    step = max(1, LONGFORMER_GROUP_TOKENS // c) * c
    chunks = []
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        lo, hi = max(0, r0 - reach), min(n, r0 + -(-(r1 - r0) // c) * c + reach)
        keys = torch.cat([torch.arange(lo, hi, device=real.device), gidx])
        chunks.append(Chunk(rows=slice(r0, r1), keys=keys, info=(real, is_global, gidx, lo, hi, options)))
    if gidx.numel():
        chunks.append(Chunk(rows=gidx, keys=slice(0, n), info=(real, gidx, options), triple=1))
    return chunks


def _longformer_chunk(chunk: Chunk, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    if chunk.triple == 1:
        # global rows: Q_g of the global tokens against K_g, V_g of every token (full rows)
        real, gidx, o = chunk.info
        b, n = real.shape
        visible = real[:, None, None, :].expand(b, 1, gidx.numel(), n)
        if o.is_causal:
            visible = visible & (torch.arange(n, device=real.device)[None, :] <= gidx[:, None])
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, dropout_p=o.dropout_p, scale=o.scale)
        return torch.where(visible.any(-1, keepdim=True), out, 0.0)

    # window chunks of c = w/2 queries, chunk j of the group seeing keys [r0 + j c - reach,
    # r0 + j c + c + reach) plus the G global keys (K_s, V_s), all under one softmax; chunks go to
    # the batch axis, so one mask per chunk serves all heads
    real, is_global, gidx, lo, hi, o = chunk.info
    b, h, rows, d = query.shape
    n, g, c, reach = real.shape[1], gidx.numel(), o.half, o.reach
    span = c + 2 * reach
    chunks = -(-rows // c)
    base = chunk.rows.start - reach  # position of window row 0 below
    device = query.device

    def windows(t: Tensor) -> Tensor:  # [B, H, hi - lo + G, D] -> [B * chunks, H, span + G, D]
        padded = F.pad(t[:, :, :hi - lo], (0, 0, lo - base, base + chunks * c + 2 * reach - hi))
        window = padded.unfold(2, span, c).transpose(-1, -2)  # [B, H, chunks, span, D]
        glob = t[:, :, None, hi - lo:].expand(-1, -1, chunks, -1, -1)
        return torch.cat([window, glob], dim=-2).transpose(1, 2).flatten(0, 1)

    # key offset relative to the query: (chunk_start - reach + s) - (chunk_start + r) = s - r - reach
    offset = torch.arange(span, device=device)[None, :] - torch.arange(c, device=device)[:, None] - reach
    in_window = (offset.abs() <= reach) & (offset % o.dilation == 0)
    if o.is_causal:
        in_window = in_window & (offset <= 0)
    positions = torch.arange(base, base + chunks * c + 2 * reach, device=device)
    exists = (positions >= 0) & (positions < n)
    inside = positions.clamp(0, n - 1)
    # keys that exist, are real and are not global (global keys are added once, at the end)
    key_ok = (exists & (real[:, inside] & ~is_global[inside])).unfold(1, span, c)  # [B, chunks, span]
    query_pos = positions[reach:reach + chunks * c].view(chunks, c, 1)
    visible_glob = real[:, gidx][:, None, None, :].expand(b, chunks, c, g)
    if o.is_causal:
        visible_glob = visible_glob & (gidx.view(1, 1, g) <= query_pos)
    visible = torch.cat([in_window & key_ok[:, :, None, :], visible_glob], dim=-1).flatten(0, 1)[:, None]
    q = F.pad(query, (0, 0, 0, chunks * c - rows)).unflatten(2, (chunks, c)).transpose(1, 2).flatten(0, 1)
    out = F.scaled_dot_product_attention(q, windows(key), windows(value), attn_mask=visible, dropout_p=o.dropout_p,
                                         scale=o.scale)
    # queries that see no key output zeros; global queries' rows come from their own chunk
    global_query = is_global[query_pos.clamp(max=n - 1)].expand(b, chunks, c, 1).flatten(0, 1)[:, None]
    keep = visible.any(-1, keepdim=True) & ~global_query
    out = torch.where(keep, out, 0.0)
    return out.unflatten(0, (b, chunks)).transpose(1, 2).flatten(2, 3)[:, :, :rows]


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
    options = _Options(attention_window // 2, dilation, is_causal, 1.0 / math.sqrt(d) if scale is None else scale,
                       dropout_p)
    if uses_gpu_path(query):
        gidx = _global_index_on(global_positions, n, query.device)
        global_rows = _global_rows(global_query.index_select(2, gidx).to(output_dtype(query)), global_key,
                                   global_value, attention_mask, gidx, options)
        return longformer_attention_gpu(query, key, value, global_rows, attention_mask, gidx, options).transpose(1, 2)
    real = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    chunks = _plan(real, _global_index(global_positions, n, query.device), options)
    return chunked_attention(_longformer_chunk, chunks, [(query, key, value), (global_query, global_key, global_value)],
                             replay_random=dropout_p > 0)


def _global_index_on(global_positions: Sequence[int], length: int, device: torch.device) -> Tensor:
    """:func:`_global_index` built on the host and copied without waiting for the device."""
    return _global_index(global_positions, length, torch.device("cpu")).to(device, non_blocking=True)


@pytorch_path_where_kernels_do_not_fit
def longformer_attention_gpu(query: Tensor, key: Tensor, value: Tensor, global_rows: Tensor,
                             attention_mask: Tensor | None, gidx: Tensor, options: _Options) -> Tensor:
    """The GPU path, all rows at once. The sliding window (Q_s, K_s, V_s) runs through the
    block-sparse Triton kernel where it runs (the window as a band, the global tokens' keys as
    extra keys, kept out of the band so a global key inside the window counts once), else through
    one SDPA call over every chunk's window (chunked.windowed_attention). ``global_rows``
    [B, H, G, Dv] (the global tokens' own attention, :func:`_global_rows`) replace the rows
    ``gidx``, written into the kernel's output buffer. Output token-major [B, N, H, Dv] in the
    autocast dtype."""
    o = options
    dtype = output_dtype(query)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    b, h, n, _ = query.shape
    g = gidx.numel()
    key_valid, extra_key, extra_value, extra_valid = attention_mask, None, None, None
    if g:
        is_global = torch.zeros(n, dtype=torch.bool, device=query.device).index_fill_(0, gidx, True)
        key_valid = (~is_global).expand(b, n) if attention_mask is None else attention_mask & ~is_global
        extra_key, extra_value = key.index_select(2, gidx), value.index_select(2, gidx)
        extra_valid = None if attention_mask is None else attention_mask.index_select(1, gidx)
    band = Band(1, -o.reach, o.reach + 1, o.dilation)
    pattern = SparsePattern(band, o.is_causal, key_valid=key_valid, extra_pos=gidx, extra_valid=extra_valid)
    if triton_runs_on(query):
        from longattn.attention import _blocksparse_triton as kernels

        if kernels.kernel_supports(query, pattern):
            return kernels.blocksparse_attention(query, key, value, pattern, extra_key=extra_key,
                                                 extra_value=extra_value, scale=o.scale, dropout_p=o.dropout_p,
                                                 replace_rows=(gidx, global_rows) if g else None)
    out = windowed_attention(query, key, value, pattern, window_chunk(band), extra_key=extra_key,
                             extra_value=extra_value, scale=o.scale, dropout_p=o.dropout_p)
    return out.index_copy(1, gidx, global_rows.transpose(1, 2).to(out.dtype)) if g else out


def _global_visible(attention_mask: Tensor | None, gidx: Tensor, n: int, is_causal: bool) -> Tensor | None:
    """[B or 1, 1, G, N]: the keys each global row sees (None: every key)."""
    visible = None if attention_mask is None else attention_mask[:, None, None, :]
    if is_causal:
        before = torch.arange(n, device=gidx.device) <= gidx[:, None]  # [G, N]
        visible = before if visible is None else visible & before
    return visible


def _global_rows(global_query_rows: Tensor, global_key: Tensor, global_value: Tensor, attention_mask: Tensor | None,
                 gidx: Tensor, options: _Options) -> Tensor:
    """The global rows: Q_g at the global positions against K_g, V_g of every token, one SDPA call."""
    visible = _global_visible(attention_mask, gidx, global_key.shape[2], options.is_causal)
    out = F.scaled_dot_product_attention(global_query_rows, global_key, global_value, attn_mask=visible,
                                         dropout_p=options.dropout_p, scale=options.scale)
    return out if visible is None else torch.where(visible.any(-1, keepdim=True), out, 0.0)  # seeing no key: zeros


def _global_rows_from_input(x: Tensor, global_query_rows: Tensor, key_proj: nn.Linear, value_proj: nn.Linear,
                            attention_mask: Tensor | None, gidx: Tensor, options: _Options) -> Tensor:
    """The global rows without K_g, V_g for every token: with K_g = x W_k^T + b_k and V_g = x W_v^T
    + b_v per head, q K_g^T = (q W_k) x^T + q b_k and P V_g = (P x) W_v^T + (sum of P) b_v. Equal to
    :func:`_global_rows` on the projections; [B, H, G, N] scores instead of two [B, N, dim]
    projections (G is small)."""
    b, n, dim = x.shape
    heads, head_dim = global_query_rows.shape[1], global_query_rows.shape[-1]
    g = global_query_rows.shape[2]
    w_key = key_proj.weight.view(heads, head_dim, dim)
    w_value = value_proj.weight.view(heads, head_dim, dim)
    # heads and global rows side by side as the rows of one [B, H G, *] product with x (no copy of x per head)
    scores = torch.einsum("bhgd,hde->bhge", global_query_rows, w_key).flatten(1, 2) @ x.transpose(1, 2)
    scores = scores.unflatten(1, (heads, g))  # [B, H, G, N]
    if key_proj.bias is not None:  # the same for every key of a row (softmax ignores it), kept as in K_g
        scores = scores + (global_query_rows @ key_proj.bias.view(heads, head_dim, 1).to(scores.dtype))
    scores = scores.float() * options.scale  # softmax in float32
    visible = _global_visible(attention_mask, gidx, n, options.is_causal)
    if visible is not None:
        scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1)
    if visible is not None:
        weights = weights * visible  # a row that sees no key gets zeros (its softmax was uniform over nothing)
    if options.dropout_p:
        weights = F.dropout(weights, options.dropout_p)
    mixed = (weights.to(global_query_rows.dtype).flatten(1, 2) @ x).unflatten(1, (heads, g))  # [B, H, G, dim]
    out = torch.einsum("bhge,hde->bhgd", mixed, w_value)
    if value_proj.bias is not None:
        out = out + weights.sum(-1, keepdim=True) * value_proj.bias.view(heads, 1, head_dim)
    return out


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
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        options = _Options(self.attention_window // 2, self.dilation, self.causal, scale,
                           self.dropout if self.training else 0.0)
        if not isinstance(self.proj, QKVProjection):  # q, k, v handed over from outside (longattn.hf)
            q, k, v = self.proj.qkv(x)
            gq, gk, gv = self.global_qkv(x)
            return self.proj.out(longformer_attention(
                q, k, v, attention_mask, attention_window=self.attention_window, dilation=self.dilation,
                global_positions=self.global_positions, global_query=gq, global_key=gk, global_value=gv,
                is_causal=self.causal, scale=self.scale, dropout_p=options.dropout_p))
        if uses_gpu_path(x):
            return self.proj.out(self._attend_gpu(x, attention_mask, options).transpose(1, 2))
        # the functional form's chunks, with the projections inside them (see chunked.py)
        b, n, _ = x.shape
        real = torch.ones(b, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
        chunks = _plan(real, _global_index(self.global_positions, n, x.device), options)
        local = (self.proj.to_q, self.proj.to_k, self.proj.to_v)
        glob = local if self.global_proj is None else tuple(self.global_proj[name] for name in ("query", "key", "value"))
        out = chunked_projected_attention(_longformer_chunk, chunks, x, [local, glob], self.heads,
                                          replay_random=options.dropout_p > 0)
        return self.proj.out(out)

    def _attend_gpu(self, x: Tensor, attention_mask: Tensor | None, options: _Options) -> Tensor:
        """The GPU path of the module: Q_g projected at the global rows only, K_g and V_g never
        projected for every token (:func:`_global_rows_from_input`)."""
        q, k, v = self.proj.qkv(x)
        gidx = _global_index_on(self.global_positions, x.shape[1], x.device)
        if self.global_proj is None:
            global_rows = _global_rows(q.index_select(2, gidx), k, v, attention_mask, gidx, options)
        else:
            gq_rows = split_heads(self.global_proj["query"](x.index_select(1, gidx)), self.heads)
            global_rows = _global_rows_from_input(x, gq_rows, self.global_proj["key"], self.global_proj["value"],
                                                  attention_mask, gidx, options)
        return longformer_attention_gpu(q, k, v, global_rows, attention_mask, gidx, options)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, attention_window={self.attention_window}, dilation={self.dilation}, "
            f"global_positions={self.global_positions}, causal={self.causal}"
        )

    # -- decoding: the sliding window, the global tokens and, while a global position lies ahead, the
    # global projections of every token ---------------------------------------------------------
    decode_state = "window"

    def _global_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        gq, gk, gv = self.global_qkv(x)
        return (q, k, v) if gq is None else (gq, gk, gv)

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, LongformerState]:
        q, k, v = self.proj.qkv(x)
        gq, gk, gv = self.global_qkv(x)
        out = longformer_attention(
            q, k, v, attention_mask, attention_window=self.attention_window, dilation=self.dilation,
            global_positions=self.global_positions, global_query=gq, global_key=gk, global_value=gv, is_causal=True,
            scale=self.scale, dropout_p=self.dropout if self.training else 0.0)
        _, gk, gv = self._global_inputs(x, q, k, v)
        b, n = x.shape[:2]
        real = torch.ones(b, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
        is_global = torch.zeros(n, dtype=torch.bool, device=x.device)
        gidx = _global_index(self.global_positions, n, x.device)
        is_global[gidx] = True
        reach = self.dilation * (self.attention_window // 2)
        state = LongformerState(
            length=n,
            window=WindowState.start(k, v, real & ~is_global, reach),  # global keys join once, below
            global_keys=KVState.start(k[:, :, gidx], v[:, :, gidx], real[:, gidx]),
            history=KVState.start(gk, gv, real) if self._global_ahead(n) else None,
        )
        return self.proj.out(out), state

    def _global_ahead(self, position: int) -> bool:
        """Whether a global row at ``position`` or later is still to come (it needs every token's K_g, V_g)."""
        return bool(self.global_positions) and max(self.global_positions) >= position

    def step_attend(self, x: Tensor, state: LongformerState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, LongformerState]:
        q, k, v = self.proj.qkv(x)
        gq, gk, gv = self._global_inputs(x, q, k, v)
        t, b = state.length, x.shape[0]
        real = ones_or(real, b, x.device)
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        dropout_p = self.dropout if self.training else 0.0
        if state.history is not None:
            state.history.append(gk, gv, real)
        if t in self.global_positions:
            # a global row: Q_g of this token against K_g, V_g of every token up to it
            keys, values, visible = state.history.view()
            out = attend_keys(gq, keys, values, visible[:, None, None, :], scale=scale, dropout_p=dropout_p)
            state.global_keys.append(k, v, real)
            state.window.slide(*state.window.with_token(k, v, torch.zeros_like(real)))
        else:
            # the window t - reach .. t (every dilation-th), then the global tokens so far, under one softmax
            keys, values, visible = state.window.with_token(k, v, real)
            reach = keys.shape[2] - 1
            offsets = torch.arange(reach, -1, -1, device=x.device)  # t - j
            in_window = (offsets % self.dilation == 0) & (offsets <= t)
            global_keys, global_values, global_real = state.global_keys.view()
            out = attend_keys(q, torch.cat([keys, global_keys], 2), torch.cat([values, global_values], 2),
                              torch.cat([visible & in_window, global_real], 1)[:, None, None, :], scale=scale,
                              dropout_p=dropout_p)
            state.window.slide(keys, values, visible)
        if state.history is not None and not self._global_ahead(t + 1):
            state.history = None  # no global row ahead: the global projections are no longer needed
        return self.proj.out(out), state


@dataclass
class LongformerState(DecodingState):
    """Longformer's decoding state: the sliding window (K_s, V_s of the last ``dilation * w / 2`` tokens, global
    ones left out), the global tokens' K_s, V_s, and K_g, V_g of every token while a global row lies ahead."""

    window: WindowState | None = None
    global_keys: KVState | None = None
    history: KVState | None = None
