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

__all__ = ["Chunk", "chunked_attention", "chunked_projected_attention"]

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
