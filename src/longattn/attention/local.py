"""Local (sliding-window) attention: each query attends only to keys near it.

Computed block-wise: the sequence is cut into blocks of ``window_size`` tokens and each query
block attends to its own block plus ``look_backward`` blocks before and ``look_forward`` after
(the blocked form of Parmar et al., 2018 / the LRA "Local Attention" baseline). With
``exact_window=True`` (the default) keys further than ``window_size * look_*`` positions from
the query are masked, which gives the true sliding window |i - j| <= w. Each block runs through
SDPA's fused kernel, so memory is O(N * head_dim * (1 + look_backward + look_forward)) plus one
block's scores at a time, never N x N.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longattn.attention.base import AttentionBase, AttentionError, Capabilities, QKVProjection, check_qkv, padding_safe, register_attention


# Query tokens per chunk: the chunk's neighbourhood copies and SDPA mask and temporaries are the
# only per-chunk memory (a few MiB at the default window), recomputed in backward.
LOCAL_CHUNK_TOKENS = 512


def _blocks(x: Tensor, block: int) -> Tensor:
    """[..., N, D] (N a multiple of block) -> [..., N // block, block, D]."""
    return x.unflatten(-2, (x.shape[-2] // block, block))


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
    if window_size < 1:
        raise AttentionError(f"window_size must be >= 1, got {window_size}")
    look_forward = (0 if is_causal else 1) if look_forward is None else look_forward
    if is_causal and look_forward:
        raise AttentionError("causal local attention cannot look forward")
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    w = window_size
    pad = (-n) % w
    valid = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    if pad:
        query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
        valid = F.pad(valid, (0, pad), value=False)
    options = (w, look_backward, look_forward, exact_window, is_causal, scale, dropout_p)
    blocks = (n + pad) // w
    step = max(1, LOCAL_CHUNK_TOKENS // w)
    # Query blocks in chunks, each recomputed in backward (checkpoint): only one chunk's
    # neighbourhood copies, mask and SDPA temporaries exist at a time, forward or backward;
    # what is kept for backward is q, k, v themselves.
    chunks = [
        checkpoint(_local_chunk, query, key, value, valid, start, min(start + step, blocks), options,
                   use_reentrant=False)
        for start in range(0, blocks, step)
    ]
    return torch.cat(chunks, dim=2)[:, :, :n]


def _neighbourhood(blocks: Tensor, start: int, stop: int, backward: int, forward: int, fill: float | bool = 0) -> Tensor:
    """Blocks [start, stop) each followed by its neighbours, missing neighbours at the ends
    filled with ``fill``: [..., nb, block, D] -> [..., stop - start, (backward + 1 + forward) * block, D]."""
    nb = blocks.shape[-3]
    lo, hi = max(0, start - backward), min(nb, stop + forward)
    context = F.pad(blocks[..., lo:hi, :, :], (0, 0, 0, 0, lo - (start - backward), (stop + forward) - hi), value=fill)
    count = stop - start
    return torch.cat([context[..., i:i + count, :, :] for i in range(backward + forward + 1)], dim=-2)


def _local_chunk(query: Tensor, key: Tensor, value: Tensor, valid: Tensor, start: int, stop: int,
                 options: tuple) -> Tensor:
    """Query blocks [start, stop) against their neighbourhoods: [B, H, (stop - start) * w, Dh]."""
    w, look_backward, look_forward, exact_window, is_causal, scale, dropout_p = options
    b = query.shape[0]
    positions = torch.arange(query.shape[2], device=query.device)
    key_pos = _neighbourhood(_blocks(positions[:, None], w), start, stop, look_backward, look_forward, fill=-1)[..., 0]
    key_ok = _neighbourhood(_blocks(valid[..., None], w), start, stop, look_backward, look_forward, fill=False)[..., 0]
    query_pos = _blocks(positions[:, None], w)[start:stop, :, 0]  # [chunk, w]
    offset = key_pos[:, None, :] - query_pos[:, :, None]  # j - i, [chunk, w, span]
    structural = (key_pos >= 0)[:, None, :].expand_as(offset)  # neighbour block exists
    if exact_window:
        structural = structural & (offset <= w * look_forward) & (offset >= -w * look_backward)
    if is_causal:
        structural = structural & (offset <= 0)
    allowed = (structural[None] & key_ok[:, :, None, :]).flatten(0, 1)[:, None]  # [B*chunk, 1, w, span]

    # every query block against its neighbourhood in SDPA's fused kernel; heads sit beside each
    # other so one [w, span] mask per block serves them all
    def heads_inner(t: Tensor) -> Tensor:  # [B, H, chunk, rows, D] -> [B*chunk, H, rows, D]
        return t.transpose(1, 2).flatten(0, 1)

    q = heads_inner(_blocks(query, w)[:, :, start:stop])
    k = heads_inner(_neighbourhood(_blocks(key, w), start, stop, look_backward, look_forward))
    v = heads_inner(_neighbourhood(_blocks(value, w), start, stop, look_backward, look_forward))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)
    out = torch.where(allowed.any(-1, keepdim=True), out, 0.0)  # queries that see no key output zeros
    return out.unflatten(0, (b, -1)).transpose(1, 2).flatten(2, 3)


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
    n, d = query.shape[-2], query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    if exact_window:
        allowed = (j - i <= window_size * look_forward) & (i - j <= window_size * look_backward)
    else:
        bi, bj = i // window_size, j // window_size
        allowed = (bj - bi <= look_forward) & (bi - bj <= look_backward)
    if is_causal:
        allowed = allowed & (j <= i)
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :]
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
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
        q, k, v = self.proj.qkv(x)
        out = local_attention(
            q, k, v, attention_mask,
            window_size=self.window_size, look_backward=self.look_backward, look_forward=self.look_forward,
            exact_window=self.exact_window, is_causal=self.causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj.out(out)
