"""Communication shared by the sequence-parallel forms: where a shard sits in the sequence, the
collectives they use (differentiable where gradients must flow back), and a byte counter.

The collectives are torch.distributed's own, run asynchronously and waited for at most the time-out
(``LONGATTN_DIST_TIMEOUT_S``, default 900 s): a rank that hangs or dies becomes an error on the others,
whatever time-out the caller gave its process group. The differentiable ones are two small autograd
functions written here for that reason (torch.distributed.nn's take no time-out): all-reduce's backward is
an all-reduce, all-gather's a reduce-scatter (on gloo, which has none, an all-reduce of the pieces). Before
every collective, one small all-gather checks that every rank is about to run the same collective on a
tensor of the same shape, dtype and device (:func:`check_collective`): a mismatch is an error naming the
rank on every rank, never a crash inside gloo or a hang in nccl. Nothing here starts processes: torchrun
(or the caller) creates the process group.

Bytes are counted per rank and per call as the payload of the collective: an all-reduce counts the
tensor it reduces, an all-gather the gathered result; a collective run again in the backward pass
(through a gradient hook) counts there too. Ring or tree algorithms move a small constant factor
of the payload; the payload is what grows (or not) with the sequence length.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from longattn.attention.base import AttentionError

__all__ = [
    "CollectiveMismatch",
    "CommunicationLog",
    "Shard",
    "all_gather",
    "all_gather_sequence",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast",
    "check_collective",
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
    """Where this process's part of the sequence sits: tokens [offset, offset + length) of total.

    A rank that holds no token of the sequence runs the form on one padding token of its own (``virtual``:
    how many each rank added, 0 or 1); they sit after every real token, and :attr:`sequence_length` is the
    sequence's own length without them."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    lengths: tuple[int, ...]
    virtual: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        return self.lengths[self.rank]

    @property
    def offset(self) -> int:
        return sum(self.lengths[: self.rank])

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def sequence_length(self) -> int:
        """N of the sequence: the tokens of every shard, without the padding of ranks that hold none."""
        return self.total - sum(self.virtual)


class CollectiveMismatch(AttentionError):
    """The ranks of a sequence-parallel group called a collective with different inputs, or one did not come."""


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
           torch.bool, torch.complex64, torch.complex128, torch.int8, torch.int16)
_DEVICES = ("cpu", "cuda", "xpu", "mps", "meta")
_MAX_DIMS = 6


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def device_code(device: torch.device | str) -> int:
    kind = torch.device(device).type
    return _DEVICES.index(kind) if kind in _DEVICES else len(_DEVICES)


def _describe_code(field: str, value: int) -> str:
    if field == "dtype":
        return str(_DTYPES[value]) if value < len(_DTYPES) else "another dtype"
    if field == "device":
        return _DEVICES[value] if value < len(_DEVICES) else "another device"
    if field == "collective":
        return _KINDS[value] if value < len(_KINDS) else f"collective #{value}"
    return str(value)


def _group_timeout(group: dist.ProcessGroup | None) -> float | None:
    """The time-out (seconds) the group's own collectives have, where torch says it; None otherwise."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        device = "cuda" if dist.get_backend(group) == dist.Backend.NCCL else "cpu"
        return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
    except Exception:  # a private API: when it is not there, every collective waits with a time-out of its own
        return None


def _run(kind: str, group: dist.ProcessGroup | None, launch: Any) -> None:
    """Run a collective, ``launch(wait)`` (``wait``: its async_op), bounded by the time-out
    (``LONGATTN_DIST_TIMEOUT_S``): a rank that hangs, died or skipped this layer becomes an error here instead
    of a wait without end. A group whose own time-out is no longer runs it plainly (its collectives already
    fail after that time); otherwise it runs asynchronously and is waited for at most the time-out."""
    from longattn.train.distributed import TIMEOUT_ENV, is_lost_peer, is_timeout, timeout_seconds

    limit = timeout_seconds()
    own = _group_timeout(group)
    try:
        if own is not None and own <= limit:
            launch(False)
        else:
            launch(True).wait(timeout=timedelta(seconds=limit))
    except RuntimeError as error:
        rank = dist.get_rank(group)
        waited = min(limit, own) if own is not None else limit
        if is_timeout(error):
            raise CollectiveMismatch(
                f"rank {rank}: the sequence-parallel {kind} did not complete within {waited:g} s: another rank of the "
                f"group is hung, stopped, or is not running this layer (set {TIMEOUT_ENV} to wait longer); the "
                "process group cannot be used any more") from None
        if is_lost_peer(error):
            raise CollectiveMismatch(f"rank {rank}: lost another rank of the group during the sequence-parallel "
                                     f"{kind} (it stopped: its own output says why)") from None
        raise


def _all_gather_codes(codes: list[int], group: dist.ProcessGroup | None, device: torch.device | str,
                      kind: str) -> list[list[int]]:
    """Every rank's ``codes`` (one small all-gather, bounded by the time-out)."""
    mine = torch.tensor(codes, dtype=torch.long, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _run(kind, group, lambda wait: dist.all_gather(everyone, mine, group=group, async_op=wait))
    return [t.tolist() for t in everyone]


# fields whose values are flags or checksums, said in words
_WORDS = {"input check": ("failed its checks (that rank's own error says why)", "passed"),
          "mask": ("not given", "given"), "training mode": ("off", "on")}


def _difference(field: str, rank: int, mine: int, first: int) -> str:
    if field == "layer":
        return f"rank {rank} runs another layer than rank 0 (its name, options or parameter shapes differ)"
    if field == "weights":
        return (f"rank {rank}'s layer holds other weights than rank 0's (their fingerprints differ: load the same "
                "state on every rank, or broadcast rank 0's)")
    if field in _WORDS:
        return f"rank {rank}'s {field}: {_WORDS[field][mine]}, rank 0's: {_WORDS[field][first]}"
    return f"rank {rank}'s {field} is {_describe_code(field, mine)}, rank 0's {_describe_code(field, first)}"


def _compare(fields: list[str], gathered: list[list[int]], what: str, group: dist.ProcessGroup | None) -> None:
    """:class:`CollectiveMismatch` naming the first rank whose fields differ from rank 0's (on every rank)."""
    for rank, codes in enumerate(gathered[1:], 1):
        for field, mine, first in zip(fields, codes, gathered[0]):
            if mine != first:
                raise CollectiveMismatch(
                    f"sequence-parallel attention, {what}: {_difference(field, rank, mine, first)} (seen on rank "
                    f"{dist.get_rank(group)}); every rank of the group must run the same layer on inputs of the same "
                    "batch, width, dtype and device")


_KINDS = ("lengths", "all_reduce", "all_reduce max", "all_gather", "all_gather halos", "all_gather states",
          "broadcast features")


def check_collective(kind: str, t: Tensor, shard: Shard) -> None:
    """Before a collective: one small all-gather of what every rank is about to send (which collective, its
    shape, dtype and device); any difference is a :class:`CollectiveMismatch` naming the rank, on every rank,
    instead of gloo's "Received data size doesn't match" or a hang."""
    shape = list(t.shape)[-_MAX_DIMS:]
    codes = [_KINDS.index(kind.removesuffix(" (backward)")), t.dim(), *shape, *[-1] * (_MAX_DIMS - len(shape)),
             dtype_code(t.dtype), device_code(t.device)]
    fields = ["collective", "number of dimensions", *(f"size of dimension {i}" for i in range(_MAX_DIMS)), "dtype",
              "device"]
    _compare(fields, _all_gather_codes(codes, shard.group, t.device, kind), f"before {kind}", shard.group)


def locate_shard(local_length: int, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 describe: dict[str, int] | None = None, virtual: int = 0) -> Shard:
    """Exchange the shard lengths of ``group`` (one tiny all-gather); shards follow rank order. ``describe``:
    what must be equal on every rank (batch, width, dtype, device, the layer...), checked in the same
    all-gather; ``virtual``: 1 if this rank's one token is the padding of a rank that holds none."""
    if not dist.is_available() or not dist.is_initialized():
        raise AttentionError(
            "sequence-parallel attention needs an initialised torch.distributed process group "
            "(torchrun, then torch.distributed.init_process_group)"
        )
    describe = describe or {}
    world = dist.get_world_size(group)
    gathered = _all_gather_codes([local_length, virtual, *describe.values()], group, device, "lengths")
    _record("all_gather lengths", 8 * (2 + len(describe)) * world)
    _compare(list(describe), [codes[2:] for codes in gathered], "its input", group)
    lengths = tuple(codes[0] for codes in gathered)
    padding = tuple(codes[1] for codes in gathered)
    real = [n - v for n, v in zip(lengths, padding)]
    if 0 in real and any(real[real.index(0):]):
        raise AttentionError(f"ranks without tokens must come after every rank with tokens, got shard lengths "
                             f"{tuple(real)}")
    return Shard(group=group, rank=dist.get_rank(group), world_size=world, lengths=lengths, virtual=padding)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks; the gradient is summed back over the ranks (as torch.distributed.nn's all_reduce),
    with every wait bounded by the time-out."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, shard: Shard) -> Tensor:
        ctx.shard = shard
        out = t.clone(memory_format=torch.contiguous_format)
        _run("all_reduce", shard.group,
             lambda wait: dist.all_reduce(out, op=dist.ReduceOp.SUM, group=shard.group, async_op=wait))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        _run("all_reduce (backward)", ctx.shard.group,
             lambda wait: dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.shard.group, async_op=wait))
        return out, None


class _AllGather(torch.autograd.Function):
    """Every rank's equal-shaped ``t`` in rank order; each rank's gradient is the sum over the ranks of the
    gradients of its piece (a reduce-scatter; gloo has none, so there an all-reduce of all the pieces)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, shard: Shard, kind: str) -> tuple[Tensor, ...]:
        ctx.shard, ctx.kind = shard, kind
        pieces = [torch.empty_like(t) for _ in range(shard.world_size)]
        _run(kind, shard.group, lambda wait: dist.all_gather(pieces, t.contiguous(), group=shard.group, async_op=wait))
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None]:
        shard, kind = ctx.shard, ctx.kind + " (backward)"
        grads = [g.contiguous() for g in grads]
        if dist.get_backend(shard.group) == dist.Backend.NCCL:
            mine = torch.empty_like(grads[shard.rank])
            _run(kind, shard.group, lambda wait: dist.reduce_scatter(mine, grads, group=shard.group, async_op=wait))
            return mine, None, None
        stacked = torch.stack(grads)
        _run(kind, shard.group, lambda wait: dist.all_reduce(stacked, group=shard.group, async_op=wait))
        return stacked[shard.rank], None, None


def all_gather(t: Tensor, shard: Shard, kind: str = "all_gather") -> list[Tensor]:
    """Every rank's ``t`` (same shape on every rank), checked and bounded; differentiable."""
    check_collective(kind, t, shard)
    if t.requires_grad:
        return list(_AllGather.apply(t, shard, kind))
    pieces = [torch.empty_like(t) for _ in range(shard.world_size)]
    _run(kind, shard.group, lambda wait: dist.all_gather(pieces, t.contiguous(), group=shard.group, async_op=wait))
    return pieces


def all_reduce_sum(t: Tensor, shard: Shard) -> Tensor:
    """Sum of ``t`` over the ranks; differentiable (the gradient is summed back over the ranks).

    Complex tensors travel as their real view (gloo reduces real tensors only)."""
    if t.is_complex():
        return torch.view_as_complex(all_reduce_sum(torch.view_as_real(t), shard))
    check_collective("all_reduce", t, shard)
    if t.requires_grad:
        out = _AllReduceSum.apply(t, shard)
    else:
        out = t.clone(memory_format=torch.contiguous_format)
        _run("all_reduce", shard.group,
             lambda wait: dist.all_reduce(out, op=dist.ReduceOp.SUM, group=shard.group, async_op=wait))
    _record("all_reduce", _nbytes(t), t)
    return out


def all_reduce_max(t: Tensor, shard: Shard) -> Tensor:
    """Element-wise maximum over the ranks, without gradient (used for shifts that cancel)."""
    out = t.detach().clone(memory_format=torch.contiguous_format)
    check_collective("all_reduce max", out, shard)
    _run("all_reduce max", shard.group,
         lambda wait: dist.all_reduce(out, op=dist.ReduceOp.MAX, group=shard.group, async_op=wait))
    _record("all_reduce max", _nbytes(out))
    return out


def broadcast(t: Tensor, shard: Shard, kind: str) -> None:
    """``t`` of the group's first rank on every rank, in place (no gradient), checked and bounded."""
    check_collective(kind, t, shard)
    source = 0 if shard.group is None else dist.get_global_rank(shard.group, 0)
    _run(kind, shard.group, lambda wait: dist.broadcast(t, src=source, group=shard.group, async_op=wait))
    _record(kind, _nbytes(t))


def _gather_padded(t: Tensor, shard: Shard, dim: int) -> list[Tensor]:
    """All-gather along ``dim`` for uneven shards: pad to the longest, gather, cut each back."""
    longest = max(shard.lengths)
    pad = longest - t.shape[dim]
    if pad:
        widths = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, pad]
        t = torch.nn.functional.pad(t, widths)
    return [p.narrow(dim, 0, n) for p, n in zip(all_gather(t, shard), shard.lengths)]


def all_gather_sequence(t: Tensor, shard: Shard, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard of ``t`` (shards concatenated along ``dim`` in
    rank order); differentiable: each rank gets back the gradient of its own shard, summed."""
    gathered = torch.cat(_gather_padded(t, shard, dim), dim=dim)
    _record("all_gather", _nbytes(t) // max(1, t.shape[dim]) * max(shard.lengths) * shard.world_size, t)
    return gathered


def exchange_halos(t: Tensor, shard: Shard, width: int, dim: int = 1) -> tuple[Tensor, Tensor]:
    """The ``width`` tokens just before and just after this shard along ``dim`` (zeros beyond the
    ends of the sequence), for convolutions along the sequence. Shards shorter than ``width`` are fine:
    the halo then reaches over several ranks. Differentiable: the neighbours get the gradient of what
    they lent."""
    if width == 0:
        empty = t.narrow(dim, 0, 0)
        return empty, empty
    n = t.shape[dim]
    take = min(width, n)
    # every rank lends its first and last min(width, n) tokens, zero-padded to ``width`` each
    first, last = t.narrow(dim, 0, take), t.narrow(dim, n - take, take)
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, width - take]
    edges = torch.cat((torch.nn.functional.pad(first, pad), torch.nn.functional.pad(last, pad)), dim=dim)
    pieces = all_gather(edges, shard, "all_gather halos")
    _record("all_gather halos", _nbytes(edges) * shard.world_size, edges)
    held = [min(width, length) for length in shard.lengths]
    shape = list(t.shape)
    shape[dim] = width
    zeros = t.new_zeros(shape)
    # left: the last ``width`` tokens of everything before this shard (each earlier rank's tail is enough)
    before = [zeros] + [pieces[r].narrow(dim, width, held[r]) for r in range(shard.rank)]
    left = torch.cat(before, dim=dim)
    left = left.narrow(dim, left.shape[dim] - width, width)
    after = [pieces[r].narrow(dim, 0, held[r]) for r in range(shard.rank + 1, shard.world_size)] + [zeros]
    right = torch.cat(after, dim=dim).narrow(dim, 0, width)
    return left, right
