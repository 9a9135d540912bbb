"""Attention computed chunk by chunk, with a backward pass that recomputes one chunk at a time.

Local, BigBird and Longformer attention let each chunk of query rows read only a few keys. Run
through autograd chunk by chunk (or with ``torch.utils.checkpoint``), every chunk's backward
produces gradients the size of the whole q, k and v (the backward of a slice or a gather is a
full-size tensor of zeros), and autograd keeps q, k and v alive for the backward pass. The
function here instead

* writes each chunk's output straight into one token-major [B, N, H, Dv] buffer (returned as the
  [B, H, N, Dv] view, so merging the heads afterwards is free);
* keeps for backward only its inputs: the layer input x and the projection weights in the module
  form, q, k and v in the functional form; no mask, no chunk output, no projected key;
* in backward recomputes one chunk at a time and adds its gradients into one buffer per input at
  the positions the chunk read, so the only gradient-sized tensors are the input gradients
  themselves. In the module form the projections happen inside the chunks, so the gradients of
  q, k and v never exist at full size either: each chunk's are projected back onto x at once.

Chunks add their outputs: a row written by two chunks gets the sum (Longformer's global rows are
zero in the sliding-window chunks and come from their own chunk). Attention dropout is exact:
the random state is saved before the forward chunks and restored before they are recomputed, in
the same order. Autocast is restored around the recomputation too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from longattn.attention.base import split_heads

__all__ = ["Band", "Chunk", "SparsePattern", "chunked_attention", "chunked_projected_attention", "window_chunk",
           "windowed_attention"]

Selector = slice | Tensor


@dataclass(frozen=True)
class Chunk:
    """One piece of work: the query rows it outputs, the key positions it reads, and what its
    attention needs besides q, k, v (positions and masks are rebuilt from ``info`` each time).

    ``triple`` picks the (query, key, value) set it uses (Longformer: 0 = sliding window, 1 =
    the global rows' own projections)."""

    rows: Selector
    keys: Selector
    info: Any = None
    triple: int = 0


# core(chunk, q, k, v) -> [B, H, rows, Dv]: q are the chunk's query rows, k and v its keys, [B, H, *, D]
Core = Callable[[Chunk, Tensor, Tensor, Tensor], Tensor]


def _take(t: Tensor, axis: int, sel: Selector) -> Tensor:
    if isinstance(sel, slice):
        return t[(slice(None),) * axis + (sel,)]
    return t.index_select(axis, sel)


def _add_at(total: Tensor, axis: int, sel: Selector, part: Tensor) -> None:
    if isinstance(sel, slice):
        total[(slice(None),) * axis + (sel,)] += part
    else:
        total.index_add_(axis, sel, part)


@dataclass
class _Plan:
    chunks: Sequence[Chunk]
    length: int
    # inputs read per chunk: (source index, token axis, selector) for each leaf
    reads: Callable[[Chunk], list[tuple[int, int, Selector]]]
    # (chunk, leaves, params) -> [B, H, rows, Dv]
    attend: Callable[[Chunk, list[Tensor], Sequence[Tensor]], Tensor]
    num_sources: int
    replay_random: bool


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        sources, params = inputs[:plan.num_sources], inputs[plan.num_sources:]
        ctx.plan = plan
        ctx.save_for_backward(*inputs)
        device = sources[0].device
        ctx.autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        ctx.rng = _rng_state(device) if plan.replay_random else None
        out = None
        for chunk in plan.chunks:
            leaves = [_take(sources[i], axis, sel) for i, axis, sel in plan.reads(chunk)]
            part = plan.attend(chunk, leaves, params)  # [B, H, rows, Dv]
            if out is None:
                b, h, _, dv = part.shape
                out = part.new_zeros(b, plan.length, h, dv)  # token-major: merging heads is a view
            _add_at(out, 1, chunk.rows, part.transpose(1, 2))
        return out  # the callers see it as [B, H, N, Dv] (a view outside the function: in-place ops may follow)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        plan: _Plan = ctx.plan
        grad_out = grad_out.transpose(1, 2)
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        sources, params = inputs[:plan.num_sources], inputs[plan.num_sources:]
        grads: list[Tensor | None] = [torch.zeros_like(t) if need else None for t, need in zip(inputs, needs)]
        param_leaves = [p.detach().requires_grad_(need) for p, need in zip(params, needs[plan.num_sources:])]
        device_type, autocast_on, autocast_dtype = ctx.autocast
        with torch.random.fork_rng(devices=_rng_devices(sources[0].device), enabled=ctx.rng is not None), \
                torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on), torch.enable_grad():
            if ctx.rng is not None:
                _set_rng_state(sources[0].device, ctx.rng)
            for chunk in plan.chunks:
                reads = plan.reads(chunk)
                leaves = [_take(sources[i].detach(), axis, sel).requires_grad_(needs[i]) for i, axis, sel in reads]
                part = plan.attend(chunk, leaves, param_leaves)
                wanted = [t for t in leaves + param_leaves if t.requires_grad]
                if not wanted:
                    continue
                got = iter(torch.autograd.grad(part, wanted, _take(grad_out, 2, chunk.rows), allow_unused=True))
                for (i, axis, sel), leaf in zip(reads, leaves):
                    if leaf.requires_grad:
                        g = next(got)
                        if g is not None:
                            _add_at(grads[i], axis, sel, g)
                for j, leaf in enumerate(param_leaves):
                    if leaf.requires_grad:
                        g = next(got)
                        if g is not None:
                            grads[plan.num_sources + j] += g
        return (None, *grads)


def _rng_devices(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def chunked_attention(core: Core, chunks: Sequence[Chunk], triples: Sequence[tuple[Tensor, Tensor, Tensor]],
                      *, replay_random: bool = False) -> Tensor:
    """Functional form: ``triples`` of (query, key, value) on [B, H, N, D]; returns [B, H, N, Dv],
    each chunk's ``core`` output added at its rows."""
    sources = [t for triple in triples for t in triple]

    def reads(chunk: Chunk) -> list[tuple[int, int, Selector]]:
        first = 3 * chunk.triple
        return [(first, 2, chunk.rows), (first + 1, 2, chunk.keys), (first + 2, 2, chunk.keys)]

    def attend(chunk: Chunk, leaves: list[Tensor], params: Sequence[Tensor]) -> Tensor:
        return core(chunk, *leaves)

    plan = _Plan(chunks, sources[0].shape[2], reads, attend, len(sources), replay_random)
    return _ChunkedAttention.apply(plan, *sources).transpose(1, 2)


def chunked_projected_attention(core: Core, chunks: Sequence[Chunk], x: Tensor,
                                triples: Sequence[tuple[nn.Linear, nn.Linear, nn.Linear]], heads: int,
                                *, replay_random: bool = False) -> Tensor:
    """Module form: the (query, key, value) projections of ``triples`` are applied to the rows of
    ``x`` [B, N, dim] each chunk reads, inside the chunk (recomputed in backward), so no
    full-length q, k or v, nor their gradients, ever exist. Returns [B, H, N, Dv]."""
    linears: list[nn.Linear] = []
    for linear in (lin for triple in triples for lin in triple):
        if all(linear is not seen for seen in linears):
            linears.append(linear)
    params = [t for linear in linears for t in (linear.weight, linear.bias) if t is not None]
    slots = []  # per linear: (weight index, bias index or None) in params
    position = 0
    for linear in linears:
        has_bias = linear.bias is not None
        slots.append((position, position + 1 if has_bias else None))
        position += 1 + has_bias
    triple_slots = [tuple(slots[next(i for i, seen in enumerate(linears) if seen is lin)] for lin in triple)
                    for triple in triples]

    def reads(chunk: Chunk) -> list[tuple[int, int, Selector]]:
        return [(0, 1, chunk.rows), (0, 1, chunk.keys)]

    def attend(chunk: Chunk, leaves: list[Tensor], params: Sequence[Tensor]) -> Tensor:
        x_rows, x_keys = leaves

        def project(t: Tensor, slot: tuple[int, int | None]) -> Tensor:
            weight, bias = slot
            return split_heads(F.linear(t, params[weight], None if bias is None else params[bias]), heads)

        q_slot, k_slot, v_slot = triple_slots[chunk.triple]
        return core(chunk, project(x_rows, q_slot), project(x_keys, k_slot), project(x_keys, v_slot))

    plan = _Plan(chunks, x.shape[1], reads, attend, 1, replay_random)
    return _ChunkedAttention.apply(plan, x, *params).transpose(1, 2)


def chunked_sequence_op(op: Callable[[Chunk, list[Tensor], Sequence[Tensor]], Tensor], chunks: Sequence[Chunk],
                        sources: Sequence[Tensor], reads: Callable[[Chunk], Sequence[Selector]],
                        params: Sequence[Tensor]) -> Tensor:
    """Any other op whose output rows read ranges of positions, by the same machinery: ``op(chunk,
    leaves, params)`` -> [B, H, rows, D], the leaves being ``sources`` ([B, H, N, *]) at the
    positions ``reads(chunk)`` gives for each, ``params`` used whole by every chunk. Only the
    inputs are kept for backward; each chunk's temporaries exist one chunk at a time."""
    def source_reads(chunk: Chunk) -> list[tuple[int, int, Selector]]:
        return [(i, 2, sel) for i, sel in enumerate(reads(chunk))]

    plan = _Plan(chunks, sources[0].shape[2], source_reads, op, len(sources), replay_random=False)
    return _ChunkedAttention.apply(plan, *sources, *params).transpose(1, 2)


# ----------------------------------------------------------------------------- the GPU path
#
# On a GPU the chunks above are one kernel launch (or several) each; there the same patterns run
# over all chunks at once. A pattern is described once, by position rules the Triton kernel
# (_blocksparse_triton.py) evaluates tile by tile and the batched PyTorch path below evaluates on
# all windows at once: a band of keys around each query, optional per-head lists of key blocks
# (BigBird's random blocks) and a few extra keys outside the sequence's own keys (global tokens,
# Transformer-LS's projected tokens).


@dataclass(frozen=True)
class Band:
    """The keys a query sees by position: query i sees key j when ``lo(i) <= j < hi(i)`` with
    ``lo(i) = (i // step) * step + start`` and ``hi(i) = (i // step) * step + stop``, and
    ``(j - i) % dilation == 0``. ``step = 1`` is a sliding window around each query; a larger
    ``step`` gives every query of a segment of ``step`` tokens the same keys (blocked windows)."""

    step: int
    start: int
    stop: int
    dilation: int = 1

    def __post_init__(self) -> None:
        if self.step < 1 or self.dilation < 1 or self.start > 0 or self.stop < 1:
            raise ValueError(f"a band needs step, dilation >= 1, start <= 0 < stop, got {self}")

    def allowed(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """Whether each query position sees each key position (broadcast)."""
        segment = torch.div(query_pos, self.step, rounding_mode="floor") * self.step
        ok = (key_pos >= segment + self.start) & (key_pos < segment + self.stop)
        if self.dilation > 1:
            ok = ok & ((key_pos - query_pos) % self.dilation == 0)
        return ok


@dataclass(frozen=True)
class SparsePattern:
    """Which keys each query row sees, as rules (nothing of size N x N).

    Query row r sits at position ``r + query_offset`` of the key sequence. It sees
    * the keys its ``band`` allows,
    * with ``blocks`` ([H, query blocks, L], -1 = none): whole key blocks of ``block_size``
      listed for its query block (of ``block_size`` rows) in its head; ``blocks_by_key``
      ([H, key blocks, L'], -1 = none) lists the query blocks that list each key block (the
      backward pass reads it),
    * every extra key (``extra_pos`` [E], ``extra_valid`` [B, E]): keys held apart from the
      sequence (global tokens, projected tokens), seen when valid and, if ``causal``, when their
      position is at most the query's,
    where band and block keys must also be real (``key_valid`` [B, N_keys]) and, if ``causal``,
    not after the query. The three sets must not overlap (a key listed twice would count twice).
    """

    band: Band
    causal: bool = False
    key_valid: Tensor | None = None
    query_offset: int = 0
    block_size: int = 0
    blocks: Tensor | None = None
    blocks_by_key: Tensor | None = None
    extra_pos: Tensor | None = None
    extra_valid: Tensor | None = None

    def dense_mask(self, batch: int, heads: int, n_queries: int, n_keys: int, n_extra: int = 0) -> Tensor:
        """The pattern as an explicit [B, H, N_queries, N_keys + E] mask: references and tests only."""
        device = self.key_valid.device if self.key_valid is not None else None
        i = torch.arange(n_queries, device=device)[:, None] + self.query_offset
        j = torch.arange(n_keys, device=device)[None, :]
        seen = self.band.allowed(i, j).expand(batch, heads, -1, -1)
        if self.blocks is not None:
            listed = torch.zeros(heads, n_queries, n_keys, dtype=torch.bool, device=device)
            qblock = torch.arange(n_queries, device=device) // self.block_size
            for slot in range(self.blocks.shape[-1]):
                kb = self.blocks[:, qblock, slot].long()  # [H, N_queries]
                listed |= (j[None] // self.block_size == kb[..., None]) & (kb[..., None] >= 0)
            seen = seen | listed[None]
        if self.key_valid is not None:
            seen = seen & self.key_valid[:, None, None, :]
        if self.causal:
            seen = seen & (j <= i)
        if n_extra:
            extra = torch.ones(batch, 1, n_queries, n_extra, dtype=torch.bool, device=device)
            if self.extra_valid is not None:
                extra = extra & self.extra_valid[:, None, None, :]
            if self.causal:
                extra = extra & (self.extra_pos[None, :] <= i)
            seen = torch.cat([seen, extra.expand(batch, heads, -1, -1)], dim=-1)
        return seen


def window_chunk(band: Band, minimum: int = 64) -> int:
    """Query rows per chunk of :func:`windowed_attention`: about half the band's width (the
    window then spans 1.5x the keys a query needs), at least ``minimum``, a multiple of the step."""
    rows = max(minimum, (band.stop - band.start) // 2)
    return -(-rows // band.step) * band.step


def windowed_attention(query: Tensor, key: Tensor, value: Tensor, pattern: SparsePattern, chunk: int, *,
                       extra_key: Tensor | None = None, extra_value: Tensor | None = None, scale: float,
                       dropout_p: float = 0.0) -> Tensor:
    """A band pattern (no block lists, queries at offset 0) over all chunks at once: queries in
    chunks of ``chunk`` rows (a multiple of the band's step), each against the window of keys
    its rows' bands span (an ``unfold`` of the padded keys) plus the extra keys, all chunks in one
    call of SDPA's fused kernel (which keeps no [rows, keys] weights for backward). Returns the
    output token-major, [B, N, H, Dv]."""
    band = pattern.band
    b, h, n, _ = query.shape
    if chunk % band.step or pattern.blocks is not None or pattern.query_offset:
        raise ValueError("windowed_attention takes band patterns with chunks a multiple of the band's step")
    chunks = -(-n // chunk)
    span = chunk - band.step + band.stop - band.start  # keys of one chunk's window
    before = -band.start  # chunk t's window starts at key t * chunk + band.start
    after = (chunks - 1) * chunk + span - before - n
    device = query.device

    def windows(t: Tensor, extra: Tensor | None) -> Tensor:  # [B, H, N, D] -> [B * chunks, H, span (+ E), D]
        padded = F.pad(t.transpose(1, 2), (0, 0, 0, 0, before, after))  # token-major [B, L, H, D]
        window = padded.unfold(1, span, chunk).transpose(-1, -2)  # [B, chunks, H, span, D], a view
        if extra is not None:
            window = torch.cat([window, extra[:, None].expand(-1, chunks, -1, -1, -1)], dim=3)
        return window.reshape(b * chunks, h, -1, t.shape[-1])

    queries = F.pad(query.transpose(1, 2), (0, 0, 0, 0, 0, chunks * chunk - n))  # [B, chunks * chunk, H, D]
    queries = queries.reshape(b * chunks, chunk, h, -1).transpose(1, 2)
    rows = torch.arange(chunk, device=device)
    cols = torch.arange(span, device=device) + band.start  # key position - chunk start
    # every chunk starts at a multiple of the step, so the band relative to it is the same for all
    allowed = band.allowed(rows[:, None], cols[None, :])
    if pattern.causal:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    valid = pattern.key_valid
    valid = torch.ones(1, n, dtype=torch.bool, device=device) if valid is None else valid
    key_ok = F.pad(valid, (before, after), value=False).unfold(1, span, chunk)  # [B or 1, chunks, span]
    mask = allowed & key_ok[:, :, None, :]  # [B or 1, chunks, chunk, span]
    if extra_key is not None:
        extra_ok = torch.ones(1, 1, 1, extra_key.shape[2], dtype=torch.bool, device=device)
        if pattern.extra_valid is not None:
            extra_ok = pattern.extra_valid[:, None, None, :]
        if pattern.causal:
            positions = torch.arange(chunks * chunk, device=device).view(chunks, chunk, 1)
            extra_ok = extra_ok & (pattern.extra_pos <= positions)
        lead = torch.broadcast_shapes(mask.shape[:-1], extra_ok.shape[:-1])
        mask = torch.cat([mask.expand(*lead, -1), extra_ok.expand(*lead, -1)], dim=-1)
    mask = mask.expand(b, -1, -1, -1).reshape(b * chunks, 1, chunk, -1)
    out = F.scaled_dot_product_attention(queries, windows(key, extra_key), windows(value, extra_value),
                                         attn_mask=mask, dropout_p=dropout_p, scale=scale)
    out = torch.where(mask.any(-1, keepdim=True), out, 0.0)  # queries that see no key output zeros
    return out.transpose(1, 2).reshape(b, chunks * chunk, h, -1)[:, :n]
