"""Communication shared by the sequence-parallel forms: where a shard sits in the sequence, the
collectives they use (differentiable where gradients must flow back), and a byte counter.

The collectives are torch.distributed's own (``torch.distributed.nn.functional`` for the
differentiable ones: all-reduce's backward is an all-reduce, all-gather's an all-to-all), so they
run on gloo (CPU) and nccl (GPU) alike. Nothing here starts processes: torchrun (or the caller)
creates the process group.

Bytes are counted per rank and per call as the payload of the collective: an all-reduce counts the
tensor it reduces, an all-gather the gathered result; a collective run again in the backward pass
(through a gradient hook) counts there too. Ring or tree algorithms move a small constant factor
of the payload; the payload is what grows (or not) with the sequence length.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor

from longattn.attention.base import AttentionError

__all__ = [
    "CommunicationLog",
    "Shard",
    "all_gather_sequence",
    "all_reduce_max",
    "all_reduce_sum",
    "count_communication",
    "exchange_halos",
    "locate_shard",
]


@dataclass
class CommunicationLog:
    """Bytes each rank put into collectives while the log was active (see the module doc)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    calls: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


_ACTIVE_LOGS: list[CommunicationLog] = []


@contextmanager
def count_communication() -> Iterator[CommunicationLog]:
    """Count the bytes of every collective of the sequence-parallel forms inside the block,
    including those their backward passes run later (the log stays attached to the tensors)."""
    log = CommunicationLog()
    _ACTIVE_LOGS.append(log)
    try:
        yield log
    finally:
        _ACTIVE_LOGS.remove(log)


def _record(kind: str, nbytes: int, sent: Tensor | None = None) -> None:
    """Count a collective; if ``sent`` (its input) requires grad, count its backward collective
    when the gradient of ``sent`` arrives."""
    logs = list(_ACTIVE_LOGS)
    for log in logs:
        log.forward_bytes += nbytes
        log.calls.append((kind, nbytes))
    if logs and sent is not None and sent.requires_grad:

        def count_backward(grad: Tensor) -> None:
            for log in logs:
                log.backward_bytes += nbytes
                log.calls.append((kind + " (backward)", nbytes))

        sent.register_hook(count_backward)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Shard:
    """Where this process's part of the sequence sits: tokens [offset, offset + length) of total."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    lengths: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.lengths[self.rank]

    @property
    def offset(self) -> int:
        return sum(self.lengths[: self.rank])

    @property
    def total(self) -> int:
        return sum(self.lengths)


def locate_shard(local_length: int, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> Shard:
    """Exchange the shard lengths of ``group`` (one tiny all-gather); shards follow rank order."""
    if not dist.is_available() or not dist.is_initialized():
        raise AttentionError(
            "sequence-parallel attention needs an initialised torch.distributed process group "
            "(torchrun, then torch.distributed.init_process_group)"
        )
    world = dist.get_world_size(group)
    mine = torch.tensor([local_length], dtype=torch.long, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    _record("all_gather lengths", _nbytes(mine) * world)
    lengths = tuple(int(t) for t in everyone)
    if min(lengths) <= 0:
        raise AttentionError(f"every rank needs at least one token of the sequence, got shard lengths {lengths}")
    return Shard(group=group, rank=dist.get_rank(group), world_size=world, lengths=lengths)


def all_reduce_sum(t: Tensor, shard: Shard) -> Tensor:
    """Sum of ``t`` over the ranks; differentiable (the gradient is summed back over the ranks).

    Complex tensors travel as their real view (gloo reduces real tensors only)."""
    if t.is_complex():
        return torch.view_as_complex(all_reduce_sum(torch.view_as_real(t), shard))
    if t.requires_grad:
        out = dist_fn.all_reduce(t, op=dist.ReduceOp.SUM, group=shard.group)
    else:
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=shard.group)
    _record("all_reduce", _nbytes(t), t)
    return out


def all_reduce_max(t: Tensor, shard: Shard) -> Tensor:
    """Element-wise maximum over the ranks, without gradient (used for shifts that cancel)."""
    out = t.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=shard.group)
    _record("all_reduce max", _nbytes(out))
    return out


def _gather_padded(t: Tensor, shard: Shard, dim: int) -> list[Tensor]:
    """All-gather along ``dim`` for uneven shards: pad to the longest, gather, cut each back."""
    longest = max(shard.lengths)
    pad = longest - t.shape[dim]
    if pad:
        widths = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, pad]
        t = torch.nn.functional.pad(t, widths)
    if t.requires_grad:
        pieces = list(dist_fn.all_gather(t.contiguous(), group=shard.group))
    else:
        pieces = [torch.empty_like(t) for _ in range(shard.world_size)]
        dist.all_gather(pieces, t.contiguous(), group=shard.group)
    return [p.narrow(dim, 0, n) for p, n in zip(pieces, shard.lengths)]


def all_gather_sequence(t: Tensor, shard: Shard, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard of ``t`` (shards concatenated along ``dim`` in
    rank order); differentiable: each rank gets back the gradient of its own shard, summed."""
    gathered = torch.cat(_gather_padded(t, shard, dim), dim=dim)
    _record("all_gather", _nbytes(t) // t.shape[dim] * max(shard.lengths) * shard.world_size, t)
    return gathered


def exchange_halos(t: Tensor, shard: Shard, width: int, dim: int = 1) -> tuple[Tensor, Tensor]:
    """The ``width`` tokens just before and just after this shard along ``dim`` (zeros beyond the
    ends of the sequence), for convolutions along the sequence. Every shard must hold at least
    ``width`` tokens. Differentiable: the neighbours get the gradient of what they lent."""
    if width == 0:
        empty = t.narrow(dim, 0, 0)
        return empty, empty
    if min(shard.lengths) < width:
        raise AttentionError(
            f"a convolution along the sequence needs {width} neighbouring tokens from each side, "
            f"but a shard holds only {min(shard.lengths)} tokens (shard lengths {shard.lengths})"
        )
    n = t.shape[dim]
    edges = torch.cat((t.narrow(dim, 0, width), t.narrow(dim, n - width, width)), dim=dim)
    if edges.requires_grad:
        pieces = list(dist_fn.all_gather(edges.contiguous(), group=shard.group))
    else:
        pieces = [torch.empty_like(edges) for _ in range(shard.world_size)]
        dist.all_gather(pieces, edges.contiguous(), group=shard.group)
    _record("all_gather halos", _nbytes(edges) * shard.world_size, edges)
    zeros = torch.zeros_like(t.narrow(dim, 0, width))
    left = pieces[shard.rank - 1].narrow(dim, width, width) if shard.rank > 0 else zeros
    right = pieces[shard.rank + 1].narrow(dim, 0, width) if shard.rank < shard.world_size - 1 else zeros
    return left, right
