"""Local (sliding-window) attention: each query attends only to keys near it.

Computed block-wise: the sequence is cut into blocks of ``window_size`` tokens and each query
block attends to its own block plus ``look_backward`` blocks before and ``look_forward`` after
(the blocked form of Parmar et al., 2018 / the LRA "Local Attention" baseline). With
``exact_window=True`` (the default) keys further than ``window_size * look_*`` positions from
the query are masked, which gives the true sliding window |i - j| <= w. Each block runs through
SDPA's fused kernel, so memory is O(N * head_dim * (1 + look_backward + look_forward)) plus one
block's scores at a time, never N x N. On a GPU all blocks run at once (:func:`local_attention_gpu`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

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
from longattn.attention.decoding import WindowState, attend_keys, ones_or
from longattn.attention.ops.window import dense_window_scores, window_band


# Query tokens per chunk: the chunk's neighbourhood copies, SDPA mask and temporaries are the only
# per-chunk memory (a few MiB at the default window), recomputed in backward; its keys span one
# window more on each side, so larger chunks project fewer keys twice in the module form.
LOCAL_CHUNK_TOKENS = 1024


def _blocks(x: Tensor, block: int) -> Tensor:
    """[..., N, D] (N a multiple of block) -> [..., N // block, block, D]."""
    return x.unflatten(-2, (x.shape[-2] // block, block))


@dataclass(frozen=True)
class _Options:
    window: int
    look_backward: int
    look_forward: int
    exact_window: bool
    is_causal: bool
    scale: float
    dropout_p: float
    length: int


def _check_options(window_size: int, look_forward: int | None, is_causal: bool) -> int:
    if window_size < 1:
        raise AttentionError(f"window_size must be >= 1, got {window_size}")
    look_forward = (0 if is_causal else 1) if look_forward is None else look_forward
    if is_causal and look_forward:
        raise AttentionError("causal local attention cannot look forward")
    return look_forward


def _plan(valid: Tensor, options: _Options) -> list[Chunk]:
    """Chunks of query blocks; each reads the key blocks of its neighbourhoods (one contiguous range)."""
    w, n = options.window, options.length
    step = max(1, LOCAL_CHUNK_TOKENS // w)
    blocks = -(-n // w)
    chunks = []
    for start in range(0, blocks, step):
        stop = min(start + step, blocks)
        keys = slice(max(0, (start - options.look_backward) * w), min(n, (stop + options.look_forward) * w))
        chunks.append(Chunk(rows=slice(start * w, min(n, stop * w)), keys=keys, info=(valid, options)))
    return chunks


def _local_chunk(chunk: Chunk, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """The chunk's query blocks against their neighbourhoods: [B, H, rows, Dv]. ``query`` holds the
    chunk's rows, ``key``/``value`` the positions ``chunk.keys`` (a range)."""
    valid, o = chunk.info
    w, back, fwd = o.window, o.look_backward, o.look_forward
    b, rows = query.shape[0], query.shape[2]
    start = chunk.rows.start // w  # first query block
    count = -(-rows // w)
    span = back + count + fwd  # key blocks from start - back on
    first = (start - back) * w  # position of the first key row below
    device = query.device

    def pad_keys(t: Tensor, fill: float | bool = 0) -> Tensor:  # positions [first, first + span * w)
        lead = chunk.keys.start - first
        return F.pad(t, (0, 0, lead, span * w - lead - t.shape[-2]), value=fill)

    positions = torch.arange(first, first + span * w, device=device)
    key_pos = _neighbourhood(_blocks(positions[:, None], w), back, back + count, back, fwd)[..., 0]  # [count, nbhd]
    key_ok = pad_keys(valid[:, chunk.keys, None], fill=False)
    key_ok = _neighbourhood(_blocks(key_ok, w), back, back + count, back, fwd)[..., 0]  # [B, count, nbhd]
    query_pos = _blocks(positions[back * w:(back + count) * w, None], w)[..., 0]  # [count, w]
    offset = key_pos[:, None, :] - query_pos[:, :, None]  # j - i, [count, w, nbhd]
    structural = ((key_pos >= 0) & (key_pos < o.length))[:, None, :].expand_as(offset)  # the key exists
    if o.exact_window:
        structural = structural & (offset <= w * fwd) & (offset >= -w * back)
    if o.is_causal:
        structural = structural & (offset <= 0)
    allowed = (structural[None] & key_ok[:, :, None, :]).flatten(0, 1)[:, None]  # [B*count, 1, w, nbhd]

    # every query block against its neighbourhood in SDPA's fused kernel; heads sit beside each
    # other so one [w, nbhd] mask per block serves them all
    def heads_inner(t: Tensor) -> Tensor:  # [B, H, count, rows, D] -> [B*count, H, rows, D]
        return t.transpose(1, 2).flatten(0, 1)

    q = heads_inner(_blocks(F.pad(query, (0, 0, 0, count * w - rows)), w))
    k = heads_inner(_neighbourhood(_blocks(pad_keys(key), w), back, back + count, back, fwd))
    v = heads_inner(_neighbourhood(_blocks(pad_keys(value), w), back, back + count, back, fwd))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=o.dropout_p, scale=o.scale)
    out = torch.where(allowed.any(-1, keepdim=True), out, 0.0)  # queries that see no key output zeros
    return out.unflatten(0, (b, -1)).transpose(1, 2).flatten(2, 3)[:, :, :rows]


@padding_safe
def local_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    window_size: int = 256,
    look_backward: int = 1,
    look_forward: int | None = None,
    exact_window: bool = True,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Sliding-window attention on [B, H, N, Dh]; ``attention_mask`` bool [B, N], True = real key."""
    check_qkv(query, key, value, attention_mask)
    look_forward = _check_options(window_size, look_forward, is_causal)
    b, h, n, d = query.shape
    options = _Options(window_size, look_backward, look_forward, exact_window, is_causal,
                       1.0 / math.sqrt(d) if scale is None else scale, dropout_p, n)
    if uses_gpu_path(query):
        return local_attention_gpu(query, key, value, attention_mask, options).transpose(1, 2)
    valid = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    return chunked_attention(_local_chunk, _plan(valid, options), [(query, key, value)], replay_random=dropout_p > 0)


def local_band(window: int, look_backward: int, look_forward: int, exact_window: bool) -> Band:
    """The keys of query i: |j - i| within the window (exact), or whole neighbouring blocks."""
    if exact_window:
        return window_band(window * look_backward, window * look_forward)
    return Band(window, -window * look_backward, window * (look_forward + 1))


@pytorch_path_where_kernels_do_not_fit
def local_attention_gpu(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                        options: _Options) -> Tensor:
    """The GPU path, all blocks at once: the block-sparse Triton kernel where it runs, else every
    query chunk against its window in one SDPA call (chunked.windowed_attention). Output
    token-major [B, N, H, Dv] in the autocast dtype."""
    o = options
    dtype = output_dtype(query)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    pattern = SparsePattern(local_band(o.window, o.look_backward, o.look_forward, o.exact_window), o.is_causal,
                            key_valid=attention_mask)
    if triton_runs_on(query):
        from longattn.attention import _blocksparse_triton as kernels

        if kernels.kernel_supports(query, pattern):
            return kernels.blocksparse_attention(query, key, value, pattern, scale=o.scale, dropout_p=o.dropout_p)
    return windowed_attention(query, key, value, pattern, window_chunk(pattern.band), scale=o.scale,
                              dropout_p=o.dropout_p)


def _neighbourhood(blocks: Tensor, start: int, stop: int, backward: int, forward: int) -> Tensor:
    """Blocks [start, stop) each followed by its neighbours (all of which exist):
    [..., nb, block, D] -> [..., stop - start, (backward + 1 + forward) * block, D]."""
    count = stop - start
    return torch.cat([blocks[..., start - backward + i:start - backward + i + count, :, :]
                      for i in range(backward + forward + 1)], dim=-2)


@padding_safe
def local_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    window_size: int = 256,
    look_backward: int = 1,
    look_forward: int | None = None,
    exact_window: bool = True,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Dense N x N version: the same band (or block-neighbour) pattern as a full mask. Tests only."""
    look_forward = (0 if is_causal else 1) if look_forward is None else look_forward

    def sees(i: Tensor, j: Tensor) -> Tensor:
        if exact_window:
            return (j - i <= window_size * look_forward) & (i - j <= window_size * look_backward)
        bi, bj = i // window_size, j // window_size
        return (bj - bi <= look_forward) & (bi - bj <= look_backward)

    scores = dense_window_scores(query, key, attention_mask, sees, is_causal=is_causal,
                                 scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ value


@register_attention(
    "local",
    capabilities=Capabilities(causal=True),
    functional=local_attention,
    reference=local_attention_reference,
    paper="Image Transformer (Parmar et al., 2018); LRA Local Attention baseline (Tay et al., 2021)",
)
class LocalAttention(AttentionBase):
    """Sliding-window attention: each token attends to neighbours within ``window_size`` positions."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        window_size: int = 256,
        look_backward: int = 1,
        look_forward: int | None = None,
        exact_window: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if window_size < 1:
            raise AttentionError(f"window_size must be >= 1, got {window_size}")
        if causal and look_forward:
            raise AttentionError("causal local attention cannot look forward (look_forward must be 0)")
        self.proj = QKVProjection(dim, heads)
        self.window_size = window_size
        self.look_backward = look_backward
        self.look_forward = look_forward
        self.exact_window = exact_window
        self.dropout = dropout

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        dropout_p = self.dropout if self.training else 0.0
        # q, k, v handed over from outside (longattn.hf), or the GPU path (all blocks at once)
        if not isinstance(self.proj, QKVProjection) or uses_gpu_path(x):
            q, k, v = self.proj.qkv(x)
            return self.proj.out(local_attention(
                q, k, v, attention_mask, window_size=self.window_size, look_backward=self.look_backward,
                look_forward=self.look_forward, exact_window=self.exact_window, is_causal=self.causal,
                dropout_p=dropout_p))
        # the functional form's chunks, with the projections inside them (see chunked.py)
        b, n, _ = x.shape
        options = _Options(self.window_size, self.look_backward, _check_options(self.window_size, self.look_forward,
                                                                                   self.causal),
                           self.exact_window, self.causal, 1.0 / math.sqrt(self.head_dim), dropout_p, n)
        valid = torch.ones(b, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
        proj = self.proj
        out = chunked_projected_attention(_local_chunk, _plan(valid, options), x, [(proj.to_q, proj.to_k, proj.to_v)],
                                          self.heads, replay_random=dropout_p > 0)
        return proj.out(out)

    # -- decoding: a sliding window of keys and values ------------------------------------------
    decode_state = "window"

    def _reach(self) -> int:
        """How far back a query sees: w * look_backward (block-aligned windows: up to (look_backward + 1) w - 1)."""
        w, back = self.window_size, self.look_backward
        return w * back if self.exact_window else (back + 1) * w - 1

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, WindowState]:
        out = local_attention(query, key, value, attention_mask, window_size=self.window_size,
                              look_backward=self.look_backward, look_forward=0, exact_window=self.exact_window,
                              is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        real = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device) \
            if attention_mask is None else attention_mask
        return out, WindowState.start(key, value, real, self._reach())

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: WindowState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, WindowState]:
        """The new query against the window and itself: positions t - reach .. t, those in its window."""
        keys, values, visible = state.with_token(key, value, ones_or(real, key.shape[0], key.device))
        t, reach = state.length, self._reach()
        positions = torch.arange(t - reach, t + 1, device=key.device)
        allowed = positions >= 0
        if not self.exact_window:  # block-aligned: blocks t // w - look_backward .. t // w
            allowed = allowed & (positions // self.window_size >= t // self.window_size - self.look_backward)
        out = attend_keys(query, keys, values, (visible & allowed)[:, None, None, :],
                          dropout_p=self.dropout if self.training else 0.0)
        state.slide(keys, values, visible)
        return out, state
