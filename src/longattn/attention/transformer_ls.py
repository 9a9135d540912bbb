"""Long-Short Transformer (Zhu et al., NeurIPS 2021): short-term window + long-term dynamic projection.

Each query attends, under **one** softmax, to two sets of keys/values (Sec. 3.3):

* short-term (Sec. 3.1): the sequence is cut into disjoint segments of length ``w``; every query
  of a segment sees its home segment plus ``w/2`` tokens on each side (a span of ``2w`` keys,
  zero-padded, i.e. masked, at the ends);
* long-term (Sec. 3.2): a dynamic low-rank projection ``P_i = softmax(X W_i^P)`` (softmax over the
  sequence, eq. 3) compresses keys and values to ``r`` tokens, ``K_bar = P^T K``, ``V_bar = P^T V``
  (eq. 4); padded tokens get zero weight in ``P``.

DualLN (Sec. 3.3, eq. 5): the short-term keys/values go through ``LN_S`` and the projected ones
through ``LN_L`` before the aggregation, so both have matching norms.

Cost per head: O(N (2w + r) d) time, O(N (2w + r)) memory; nothing N x N is ever formed.

Autoregressive form (Sec. 3.2, ``causal=True``): the window is the w keys ending at the query, and
the dynamic projection is applied per chunk of l tokens (r tokens per chunk); a query attends to
the projected tokens of the chunks completed up to it, O(N (2w + N r / l)).

On a GPU: :func:`long_short_attention_gpu` (the module form: ``LongShortAttention._attend_gpu``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

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
    merge_heads,
    output_dtype,
    padding_safe,
    recomputed,
    register_attention,
    split_heads,
    uses_gpu_path,
)
from longattn.attention.chunked import Band, SparsePattern, window_chunk, windowed_attention
from longattn.attention.decoding import DecodingState, WindowState, ones_or

__all__ = [
    "LongShortAttention",
    "LongShortState",
    "dynamic_projection",
    "long_short_attention",
    "long_short_attention_reference",
]

Norm = Callable[[Tensor], Tensor]


def _identity(t: Tensor) -> Tensor:
    return t


def _check_window(window_size: int) -> None:
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
        raise AttentionError(f"window_size must be a positive int (segment length w), got {window_size!r}")


def _half_window(window_size: int) -> int:
    """Keys added on each side of a segment: w/2, at least 1 (w = 1 spans 3 tokens, as the authors' code)."""
    return max(window_size // 2, 1)


def _check_options(window_size: int, projection_logits: Tensor, query: Tensor) -> None:
    _check_window(window_size)
    b, h, n, _ = query.shape
    if (
        not isinstance(projection_logits, Tensor)
        or projection_logits.dim() != 4
        or projection_logits.shape[:3] != (b, h, n)
    ):
        shape = list(projection_logits.shape) if isinstance(projection_logits, Tensor) else projection_logits
        raise AttentionError(f"projection_logits must be [B, H, N, r] = [{b}, {h}, {n}, r], got {shape}")
    if projection_logits.dtype != query.dtype:
        raise AttentionError(f"projection_logits must have the inputs' dtype {query.dtype}")


def dynamic_projection(projection_logits: Tensor, attention_mask: Tensor | None) -> Tensor:
    """P = softmax over the sequence of X W^P (eq. 3): [B, H, N, r]; padded tokens get weight 0."""
    if attention_mask is None:
        return torch.softmax(projection_logits, dim=2)
    keep = attention_mask[:, None, :, None]
    logits = projection_logits.masked_fill(~keep, torch.finfo(projection_logits.dtype).min)
    return torch.softmax(logits, dim=2) * keep.to(logits.dtype)


def _short_term_windows(
    key: Tensor, value: Tensor, real: Tensor, window_size: int, is_causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Keys/values of every segment's window and which of them each query may see.

    Returns k_win, v_win [B, H, S, span, d] and visible [B, 1, S, w or 1, span] (bool).
    Bidirectional: segment plus w/2 on each side (Sec. 3.1). Causal: the w keys ending at the
    query itself, cut from a 2w tile (previous segment + own segment).
    """
    b, n = real.shape
    w = window_size
    segments = -(-n // w)
    tail = segments * w - n
    before, after = (w, tail) if is_causal else (_half_window(w), tail + _half_window(w))
    span = before + w + (after - tail)
    k_win = F.pad(key, (0, 0, before, after)).unfold(2, span, w).transpose(-1, -2)
    v_win = F.pad(value, (0, 0, before, after)).unfold(2, span, w).transpose(-1, -2)
    visible = F.pad(real, (before, after)).unfold(1, span, w)[:, None, :, None, :]  # padding is False
    if is_causal:
        row = torch.arange(w, device=real.device)[:, None]
        col = torch.arange(span, device=real.device)[None, :]
        visible = visible & ((col > row) & (col <= row + w))  # tile column row + w is the query itself
    return k_win, v_win, visible


def _chunk_projection(
    key: Tensor, value: Tensor, projection_logits: Tensor, real: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-chunk dynamic projection for autoregressive models: [B, H, C r, d] keys and values, and
    whether each chunk holds a real token, [B, C]."""
    b, h, n, d = key.shape
    rank = projection_logits.shape[-1]
    chunks = -(-n // chunk_size)
    tail = chunks * chunk_size - n
    real_c = F.pad(real, (0, tail)).view(b, 1, chunks, chunk_size, 1)
    logits = F.pad(projection_logits, (0, 0, 0, tail)).view(b, h, chunks, chunk_size, rank)
    # P_c = softmax over the chunk's real positions (eq. 3 restricted to one chunk)
    proj = torch.softmax(logits.masked_fill(~real_c, torch.finfo(logits.dtype).min), dim=3) * real_c
    key_c = proj.transpose(-1, -2) @ F.pad(key, (0, 0, 0, tail)).view(b, h, chunks, chunk_size, d)
    value_c = proj.transpose(-1, -2) @ F.pad(value, (0, 0, 0, tail)).view(b, h, chunks, chunk_size, d)
    return key_c.flatten(2, 3), value_c.flatten(2, 3), real_c.any(3).view(b, chunks)


def _causal_long_term(
    key: Tensor, value: Tensor, projection_logits: Tensor, real: Tensor, chunk_size: int, queries: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_chunk_projection` and which projected tokens each query sees, visible [B, 1, queries,
    C r]: query t sees chunk c once the chunk is complete, (c + 1) l <= t + 1."""
    b = key.shape[0]
    rank = projection_logits.shape[-1]
    key_c, value_c, chunk_real = _chunk_projection(key, value, projection_logits, real, chunk_size)
    chunks = chunk_real.shape[1]
    chunk_end = (torch.arange(chunks, device=key.device) + 1) * chunk_size
    done = chunk_end <= torch.arange(queries, device=key.device)[:, None] + 1
    visible = done[None, None] & chunk_real.view(b, 1, 1, chunks)  # an all-padding chunk is never seen
    visible = visible[..., None].expand(b, 1, queries, chunks, rank).flatten(-2)
    return key_c, value_c, visible


@padding_safe
def long_short_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    projection_logits: Tensor,
    window_size: int = 8,
    short_norm: Norm | None = None,
    long_norm: Norm | None = None,
    is_causal: bool = False,
    chunk_size: int = 16,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Transformer-LS attention on [B, H, N, Dh] (eq. 5), segment-wise.

    ``projection_logits``: ``X W^P`` per head, [B, H, N, r] (eq. 3). ``short_norm`` / ``long_norm``:
    LN_S / LN_L of the DualLN applied to the last dim (None = no normalisation).
    Bidirectional: O(N (2w + r)) memory. Causal (``is_causal``): a window of the w keys ending at
    the query, and the r projected tokens of every complete earlier chunk of ``chunk_size`` tokens,
    O(N (2w + N r / l)) -- the paper's autoregressive form.
    """
    check_qkv(query, key, value, attention_mask)
    _check_options(window_size, projection_logits, query)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
    b, h, n, d = query.shape
    if key.shape[2] != n:
        raise AttentionError("Transformer-LS is self-attention: query and key lengths must match")
    short_norm = short_norm or _identity
    long_norm = long_norm or _identity
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if uses_gpu_path(query):
        return long_short_attention_gpu(query, key, value, attention_mask, projection_logits, window_size, short_norm,
                                        long_norm, is_causal, chunk_size, scale, dropout_p).transpose(1, 2)
    real = attention_mask
    if real is None:
        real = torch.ones(b, n, dtype=torch.bool, device=query.device)
    w = window_size
    segments = -(-n // w)
    q_seg = F.pad(query, (0, 0, 0, segments * w - n)).view(b, h, segments, w, d)

    if is_causal:
        key_long, value_long, visible_long = _causal_long_term(
            key, value, projection_logits, real, chunk_size, segments * w
        )
        visible_long = visible_long.view(b, 1, segments, w, -1)
    else:  # r projected tokens shared by every query (eq. 4)
        proj = dynamic_projection(projection_logits, attention_mask)
        key_long, value_long = proj.transpose(-1, -2) @ key, proj.transpose(-1, -2) @ value  # [B, H, r, d]
        visible_long = None
    key_long, value_long = long_norm(key_long), long_norm(value_long)
    k_win, v_win, visible_short = _short_term_windows(short_norm(key), short_norm(value), real, w, is_causal)

    minimum = torch.finfo(query.dtype).min
    scores_short = (q_seg @ k_win.transpose(-1, -2) * scale).masked_fill(~visible_short, minimum)
    # every query sees the same projected tokens: one matmul over all segments' queries, [B, H, S, w, r or C r].
    # As K_bar Q^T, transposed, so that the gradient of K_bar is a contiguous matmul output: LN_L's backward
    # returns a contiguous gradient for a transposed one on CPU where its meta function (torch.compile's
    # tracing) keeps the strides, and the views after it then fail under AOT autograd.
    scores_long = (key_long @ q_seg.flatten(2, 3).transpose(-1, -2)).transpose(-1, -2)
    scores_long = scores_long.view(b, h, segments, w, -1) * scale
    if visible_long is not None:
        scores_long = scores_long.masked_fill(~visible_long, minimum)
    # one softmax over the union of both key sets (eq. 5)
    weights = torch.softmax(torch.cat([scores_short, scores_long], dim=-1), dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    w_short, w_long = weights.split([k_win.shape[3], key_long.shape[2]], dim=-1)
    out = w_short @ v_win + (w_long.flatten(2, 3) @ value_long).view(b, h, segments, w, d)
    if visible_long is not None:  # causal: a (padded) query may see no key at all; define it as 0
        sees_something = visible_short.any(-1, keepdim=True) | visible_long.any(-1, keepdim=True)
        out = out.masked_fill(~sees_something, 0.0)
    return out.reshape(b, h, segments * w, d)[:, :, :n]


def long_short_attention_gpu(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                             projection_logits: Tensor, window_size: int, short_norm: Norm, long_norm: Norm,
                             is_causal: bool, chunk_size: int, scale: float, dropout_p: float) -> Tensor:
    """The GPU path of the functional form: the keys of both terms, recomputed in backward from k,
    v and the logits rather than stored, then :func:`_attend_gpu`. Output token-major
    [B, N, H, Dh] in the autocast dtype."""
    dtype = output_dtype(query)

    def keys(key: Tensor, value: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if is_causal:
            b, _, n, _ = key.shape
            real = torch.ones(b, n, dtype=torch.bool, device=key.device) if attention_mask is None else attention_mask
            key_long, value_long, _ = _chunk_projection(key, value, logits, real, chunk_size)
        else:  # r projected tokens shared by every query (eq. 3-4)
            proj = dynamic_projection(logits, attention_mask).transpose(-1, -2)
            key_long, value_long = proj @ key, proj @ value
        return _normalised(key, value, key_long, value_long, short_norm, long_norm, dtype)

    terms = recomputed(keys, key, value, projection_logits)
    return _attend_gpu(query, *terms, attention_mask, window_size, is_causal, chunk_size, scale, dropout_p)


def _normalised(key: Tensor, value: Tensor, key_long: Tensor, value_long: Tensor, short_norm: Norm, long_norm: Norm,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DualLN (eq. 5): LN_S(K), LN_S(V) and LN_L of the projected keys and values, in ``dtype``."""
    return (_short_normalised(key, short_norm, dtype), _short_normalised(value, short_norm, dtype),
            long_norm(key_long).to(dtype), long_norm(value_long).to(dtype))


def _short_normalised(t: Tensor, short_norm: Norm, dtype: torch.dtype) -> Tensor:
    """LN_S on the keys or values in ``dtype`` (its statistics in float32): no float32 copy of them."""
    with _autocast_off(t.device):
        return short_norm(t.to(dtype)).to(dtype)


def _projected_from_input(x: Tensor, proj: Tensor, linears: tuple[nn.Linear, ...]) -> tuple[Tensor, ...]:
    """P^T K for K = x W^T + b per head, as (P^T x) W^T + (column sums of P) b, for each linear:
    the projected tokens without K or V ([B, H r, dim] in between, shared). ``proj`` [B, H, L, r]
    over ``x`` [B, L, dim], or per chunk [B, H, C, L, r] over [B, C, L, dim]; returns [B, H, r, Dh]
    or [B, H, C r, Dh] each."""
    heads, rank, dim = proj.shape[1], proj.shape[-1], x.shape[-1]
    mixed = proj.movedim(1, -3).transpose(-1, -2).flatten(-3, -2) @ x  # [B, (C,) H r, dim]
    mixed = mixed.unflatten(-2, (heads, rank))
    totals = proj.sum(-2)[..., None]  # [B, H, (C,) r, 1]
    out = []
    for linear in linears:
        projected = torch.einsum("...hre,hde->...hrd", mixed, linear.weight.view(heads, -1, dim)).movedim(-3, 1)
        if linear.bias is not None:
            projected = projected + totals * linear.bias.view(heads, *[1] * (proj.dim() - 3), -1)
        out.append(projected.flatten(2, -2))
    return tuple(out)


@pytorch_path_where_kernels_do_not_fit
def _attend_gpu(query: Tensor, key_short: Tensor, value_short: Tensor, key_long: Tensor, value_long: Tensor,
                attention_mask: Tensor | None, window_size: int, is_causal: bool, chunk_size: int, scale: float,
                dropout_p: float) -> Tensor:
    """Eq. 5 on all segments at once: the short-term window as a band of keys around each segment
    (or the w keys ending at the query, causal) and the projected tokens as extra keys seen by every
    query (causal: once their chunk is complete), under one softmax, through the block-sparse
    Triton kernel where it runs, else one SDPA call over every chunk's window
    (chunked.windowed_attention). Output token-major [B, N, H, Dh]."""
    b, _, n, _ = query.shape
    w = window_size
    extra_pos = extra_valid = None
    if is_causal:
        # the projected tokens of chunk c are seen from the chunk's last position on, if it holds a real token
        chunks = -(-n // chunk_size)
        rank = key_long.shape[2] // chunks
        chunk_last = (torch.arange(chunks, device=query.device) + 1) * chunk_size - 1
        extra_pos = chunk_last[:, None].expand(chunks, rank).flatten()
        if attention_mask is not None:
            chunk_real = F.pad(attention_mask, (0, chunks * chunk_size - n)).view(b, chunks, chunk_size).any(-1)
            extra_valid = chunk_real[:, :, None].expand(b, chunks, rank).flatten(1)
        band = Band(1, 1 - w, 1)  # the w keys ending at the query
    else:
        half = _half_window(w)
        band = Band(w, -half, w + half)  # the query's segment and w/2 on each side
    pattern = SparsePattern(band, is_causal, key_valid=attention_mask, extra_pos=extra_pos, extra_valid=extra_valid)
    query = query.to(key_short.dtype)
    if triton_runs_on(query):
        from longattn.attention import _blocksparse_triton as kernels

        if kernels.kernel_supports(query, pattern):
            return kernels.blocksparse_attention(query, key_short, value_short, pattern, extra_key=key_long,
                                                 extra_value=value_long, scale=scale, dropout_p=dropout_p)
    return windowed_attention(query, key_short, value_short, pattern, window_chunk(band), extra_key=key_long,
                              extra_value=value_long, scale=scale, dropout_p=dropout_p)


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


@padding_safe
def long_short_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    projection_logits: Tensor,
    window_size: int = 8,
    short_norm: Norm | None = None,
    long_norm: Norm | None = None,
    is_causal: bool = False,
    chunk_size: int = 16,
    scale: float | None = None,
) -> Tensor:
    """Plain eq. 5 with full N x N masks: for tests only."""
    b, h, n, d = query.shape
    short_norm = short_norm or _identity
    long_norm = long_norm or _identity
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    real = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask
    pos = torch.arange(n)
    w, half = window_size, _half_window(window_size)
    if is_causal:
        # each chunk c gets its own softmax over its real positions; query i sees complete chunks
        chunk_of = pos // chunk_size
        chunks = int(chunk_of.max()) + 1
        in_chunk = chunk_of[None, :] == torch.arange(chunks)[:, None]
        member = in_chunk[None, :, :] & real[:, None, :]  # [B, C, N]
        weight = torch.exp(projection_logits - projection_logits.amax(2, keepdim=True))  # [B, H, N, r]
        weight = weight[:, :, None] * member[:, None, :, :, None]  # [B, H, C, N, r]
        total = weight.sum(3, keepdim=True)
        proj = weight / total.masked_fill(total == 0, 1.0)
        key_long = long_norm(torch.einsum("bhcnr,bhnd->bhcrd", proj, key).flatten(2, 3))
        value_long = long_norm(torch.einsum("bhcnr,bhnd->bhcrd", proj, value).flatten(2, 3))
        complete = (torch.arange(chunks)[None, :] + 1) * chunk_size <= pos[:, None] + 1  # [N, C]
        seen = complete[None] & member.any(-1)[:, None, :]  # [B, N, C]
        allowed_long = seen.repeat_interleave(projection_logits.shape[-1], dim=-1)[:, None]
        in_span = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w)
    else:
        weight = torch.exp(projection_logits - projection_logits.amax(2, keepdim=True))
        weight = weight * real[:, None, :, None]
        proj = weight / weight.sum(2, keepdim=True)
        key_long = long_norm(torch.einsum("bhnr,bhnd->bhrd", proj, key))
        value_long = long_norm(torch.einsum("bhnr,bhnd->bhrd", proj, value))
        allowed_long = torch.ones(1, 1, 1, key_long.shape[2], dtype=torch.bool)
        # key j is in query i's span iff it lies in i's segment widened by w/2 on both sides
        start = (pos // w) * w - half
        in_span = (pos[None, :] >= start[:, None]) & (pos[None, :] < start[:, None] + w + 2 * half)
    allowed = torch.cat([(in_span[None, None] & real[:, None, None, :]).expand(b, 1, n, n),
                         allowed_long.expand(b, 1, n, -1)], -1)
    scores = torch.cat([query @ short_norm(key).transpose(-1, -2), query @ key_long.transpose(-1, -2)], -1)
    scores = scores * scale
    weights = torch.exp(scores - scores.amax(-1, keepdim=True)) * allowed
    total = weights.sum(-1, keepdim=True)
    weights = weights / total.masked_fill(total == 0, 1.0)
    return weights[..., :n] @ short_norm(value) + weights[..., n:] @ value_long


@register_attention(
    "transformer_ls",
    # inductor (torch 2.13, CPU) gives the causal form a wrong input gradient (4% of its largest entry) and parameter
    # gradients off by orders of magnitude, where aot_eager matches eager (tests/attention/test_compile.py)
    capabilities=Capabilities(causal=True, subquadratic=True, compile_backends=("aot_eager",)),
    functional=long_short_attention,
    reference=long_short_attention_reference,
    paper="Long-Short Transformer: Efficient Transformers for Language and Vision (Zhu et al., NeurIPS 2021)",
)
class LongShortAttention(AttentionBase):
    """Transformer-LS: segment-wise sliding window + dynamic low-rank projection, with DualLN.

    Options (defaults: the paper's Long Range Arena setting):
        window_size: w, the segment length; each query sees its segment and w/2 on each side (8;
            odd w: floor(w/2), at least 1 per side).
        rank: r, the number of dynamically projected tokens (32).
        chunk_size, chunk_rank: causal only -- the dynamic projection compresses every chunk of
            ``chunk_size`` tokens to ``chunk_rank`` tokens (16 and 1, the paper's enwik8 setting,
            where the window is 512); a query sees the chunks completed up to it.
        dual_ln: LN_S / LN_L on the short- and long-term keys and values (True); False = ablation.
        dropout: attention dropout while training.
        scale: score scale; None = 1/sqrt(head dim).
        bias: biases of the Q/K/V/output and W^P projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        window_size: int = 8,
        rank: int = 32,
        chunk_size: int = 16,
        chunk_rank: int = 1,
        dual_ln: bool = True,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        _check_window(window_size)
        for label, value in (("rank", rank), ("chunk_size", chunk_size), ("chunk_rank", chunk_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise AttentionError(f"{label} must be a positive int, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        if scale is not None and not scale > 0:
            raise AttentionError(f"scale must be positive or None, got {scale!r}")
        self.window_size = window_size
        self.rank = rank
        self.chunk_size = chunk_size
        self.chunk_rank = chunk_rank
        # projected tokens per head: r over the whole sequence, or chunk_rank per chunk when causal
        self.projection_width = chunk_rank if causal else rank
        self.dropout = dropout
        self.scale = scale
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.to_projection = nn.Linear(dim, heads * self.projection_width, bias=bias)  # W_i^P (eq. 3)
        # DualLN (eq. 5) over the model width, i.e. all heads of a token jointly (as the authors' code)
        self.norm_short: nn.Module = nn.LayerNorm(dim) if dual_ln else nn.Identity()
        self.norm_long: nn.Module = nn.LayerNorm(dim) if dual_ln else nn.Identity()

    def short_norm(self, t: Tensor) -> Tensor:
        """LN_S on [B, H, L, Dh]: normalise each token's concatenated heads."""
        return split_heads(self.norm_short(merge_heads(t)), self.heads)

    def long_norm(self, t: Tensor) -> Tensor:
        """LN_L on [B, H, r, Dh]: normalise each projected token's concatenated heads."""
        return split_heads(self.norm_long(merge_heads(t)), self.heads)

    def projection_logits(self, x: Tensor) -> Tensor:
        """X W^P per head: [B, H, N, r] (r = chunk_rank when causal)."""
        b, n, _ = x.shape
        return self.to_projection(x).view(b, n, self.heads, self.projection_width).transpose(1, 2)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        if uses_gpu_path(x) and isinstance(self.proj, QKVProjection):
            return self.proj.out(self._attend_gpu(x, attention_mask).transpose(1, 2))
        q, k, v = self.proj.qkv(x)
        out = long_short_attention(
            q, k, v, attention_mask,
            projection_logits=self.projection_logits(x),
            window_size=self.window_size,
            short_norm=self.short_norm,
            long_norm=self.long_norm,
            is_causal=self.causal,
            chunk_size=self.chunk_size,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj.out(out)

    def _attend_gpu(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The GPU path of the module: only q, the normalised short-term keys and values and the
        output are kept for backward (as softmax attention keeps q, k, v and its output). K, V,
        the projection logits and the norms are recomputed from x, in three separate pieces (so
        their temporaries never coexist); the projected tokens are computed from x without K or
        V (:func:`_projected_from_input`)."""
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        query = split_heads(self.proj.to_q(x), self.heads)
        dtype = output_dtype(query)
        b, n, _ = x.shape

        def short_term(x: Tensor, linear: nn.Linear) -> Tensor:  # LN_S over each token's heads, as short_norm
            return split_heads(_short_normalised(linear(x), self.norm_short, dtype), self.heads)

        def long_term(x: Tensor) -> tuple[Tensor, Tensor]:
            logits = self.projection_logits(x)
            if self.causal:  # P_c per chunk of l tokens (eq. 3 restricted to the chunk)
                chunks = -(-n // self.chunk_size)
                tail = chunks * self.chunk_size - n
                real = torch.ones(b, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
                real = F.pad(real, (0, tail)).view(b, 1, chunks, self.chunk_size, 1)
                logits = F.pad(logits, (0, 0, 0, tail)).view(b, self.heads, chunks, self.chunk_size, -1)
                proj = torch.softmax(logits.masked_fill(~real, torch.finfo(logits.dtype).min), dim=3) * real
                tokens = (F.pad(x, (0, 0, 0, tail)) if tail else x).view(b, chunks, self.chunk_size, -1)
            else:
                proj, tokens = dynamic_projection(logits, attention_mask), x
            key_long, value_long = _projected_from_input(tokens, proj, (self.proj.to_k, self.proj.to_v))
            return self.long_norm(key_long).to(dtype), self.long_norm(value_long).to(dtype)

        key_short, value_short = (recomputed(short_term, x, linear) for linear in (self.proj.to_k, self.proj.to_v))
        key_long, value_long = recomputed(long_term, x)
        return _attend_gpu(query, key_short, value_short, key_long, value_long, attention_mask, self.window_size,
                           self.causal, self.chunk_size, scale, self.dropout if self.training else 0.0)

    def extra_repr(self) -> str:
        if self.causal:
            extra = f"chunk_size={self.chunk_size}, chunk_rank={self.chunk_rank}"
        else:
            extra = f"rank={self.rank}"
        return f"{super().extra_repr()}, window_size={self.window_size}, {extra}, causal={self.causal}"

    # -- decoding: the window, the chunk being filled and the compressed completed chunks ---------
    decode_state = "chunked"

    def _completed_chunks(self, key: Tensor, value: Tensor, logits: Tensor, real: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The long-term keys and values (after LN_L) of whole chunks [B, H, C r, d] and which of them a query may
        see [B, C r] (a chunk with a real token)."""
        count = key.shape[2] // self.chunk_size
        if count == 0:
            shape = (key.shape[0], self.heads, 0, self.head_dim)
            return key.new_zeros(shape), value.new_zeros(shape), real.new_zeros(key.shape[0], 0)
        used = count * self.chunk_size
        key_c, value_c, visible = _causal_long_term(key[:, :, :used], value[:, :, :used], logits[:, :, :used],
                                                    real[:, :used], self.chunk_size, used)
        return self.long_norm(key_c), self.long_norm(value_c), visible[:, 0, -1]

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, LongShortState]:
        q, k, v = self.proj.qkv(x)
        logits = self.projection_logits(x)
        out = long_short_attention(q, k, v, attention_mask, projection_logits=logits, window_size=self.window_size,
                                   short_norm=self.short_norm, long_norm=self.long_norm, is_causal=True,
                                   chunk_size=self.chunk_size, scale=self.scale,
                                   dropout_p=self.dropout if self.training else 0.0)
        b, n = x.shape[:2]
        real = torch.ones(b, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
        key_long, value_long, long_visible = self._completed_chunks(k, v, logits, real)
        start = n // self.chunk_size * self.chunk_size  # the chunk being filled
        state = LongShortState(
            length=n, window=WindowState.start(self.short_norm(k), self.short_norm(v), real, self.window_size - 1),
            key_long=key_long, value_long=value_long, long_visible=long_visible,
            chunk_key=k[:, :, start:], chunk_value=v[:, :, start:], chunk_logits=logits[:, :, start:],
            chunk_real=real[:, start:])
        return self.proj.out(out), state

    def step_attend(self, x: Tensor, state: LongShortState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, LongShortState]:
        """The new query against the w keys ending at it and the chunks completed up to it (the chunk that it
        completes included), under one softmax (eq. 5)."""
        q, k, v = self.proj.qkv(x)
        real = ones_or(real, x.shape[0], x.device)
        state.chunk_key = torch.cat([state.chunk_key, k], 2)
        state.chunk_value = torch.cat([state.chunk_value, v], 2)
        state.chunk_logits = torch.cat([state.chunk_logits, self.projection_logits(x)], 2)
        state.chunk_real = torch.cat([state.chunk_real, real[:, None]], 1)
        if state.chunk_key.shape[2] == self.chunk_size:  # the chunk is complete: compress it to chunk_rank tokens
            key_c, value_c, visible_c = self._completed_chunks(state.chunk_key, state.chunk_value, state.chunk_logits,
                                                               state.chunk_real)
            state.key_long = torch.cat([state.key_long, key_c], 2)
            state.value_long = torch.cat([state.value_long, value_c], 2)
            state.long_visible = torch.cat([state.long_visible, visible_c], 1)
            state.chunk_key, state.chunk_value = state.chunk_key[:, :, :0], state.chunk_value[:, :, :0]
            state.chunk_logits, state.chunk_real = state.chunk_logits[:, :, :0], state.chunk_real[:, :0]
        k_win, v_win, visible_short = state.window.with_token(self.short_norm(k), self.short_norm(v), real)
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        minimum = torch.finfo(q.dtype).min
        scores = torch.cat([(q @ k_win.transpose(-1, -2)).masked_fill(~visible_short[:, None, None, :], minimum),
                            (q @ state.key_long.transpose(-1, -2)).masked_fill(~state.long_visible[:, None, None, :],
                                                                                minimum)], -1)
        weights = torch.softmax(scores * scale, dim=-1)
        if self.training and self.dropout > 0:
            weights = F.dropout(weights, p=self.dropout)
        w_short, w_long = weights.split([k_win.shape[2], state.key_long.shape[2]], dim=-1)
        out = w_short @ v_win + w_long @ state.value_long
        sees = visible_short.any(-1) | state.long_visible.any(-1)
        out = out.masked_fill(~sees[:, None, None, None], 0.0)
        state.window.slide(k_win, v_win, visible_short)
        return self.proj.out(out), state


@dataclass
class LongShortState(DecodingState):
    """Transformer-LS's decoding state: the short-term window (LN_S'd keys and values of the last w - 1 tokens),
    the long-term keys and values of the completed chunks (LN_L'd, ``chunk_rank`` per chunk) and the raw keys,
    values, projection logits and real flags of the chunk being filled."""

    window: WindowState | None = None
    key_long: Tensor | None = None
    value_long: Tensor | None = None
    long_visible: Tensor | None = None
    chunk_key: Tensor | None = None
    chunk_value: Tensor | None = None
    chunk_logits: Tensor | None = None
    chunk_real: Tensor | None = None
