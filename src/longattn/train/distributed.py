"""Distributed data parallel set-up for runs launched with ``torchrun`` (or ``python -m torch.distributed.run``).

``torchrun`` sets RANK, WORLD_SIZE and LOCAL_RANK; a plain ``python`` run has none of them and
trains in one process. The backend is gloo on CPU and nccl on CUDA.

Every collective has a time-out (``LONGATTN_DIST_TIMEOUT_S`` seconds, default 900): a rank that
hangs or dies turns into an error on the others instead of blocking them forever.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from longattn.train.checkpoint import first_line


TIMEOUT_ENV = "LONGATTN_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 900.0


def timeout_seconds() -> float:
    """The process-group time-out: ``$LONGATTN_DIST_TIMEOUT_S`` or 900 s."""
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """"auto" -> this process's CUDA device if there is one, else the CPU."""
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def launched_rank() -> int:
    """This process's rank as the launcher (torchrun) set it, before the process group exists; 0 alone."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group when launched by torchrun; a no-op for single-process runs."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not available in this build")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_seconds()))
        # The group lives as long as the process (a grid trains several runs in it); see the handler for its end.
        atexit.register(_destroy_group_after_clean_run)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` in rank order (just ``[obj]`` without distribution)."""
    if not info.enabled:
        return [obj]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_mean(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean over ranks of every element of ``values`` (``values`` itself without distribution)."""
    if not info.enabled:
        return values
    reduced = values.clone(memory_format=torch.contiguous_format)  # all_reduce works in place: not on the caller's
    dist.all_reduce(reduced)
    return reduced / info.world_size


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out (gloo and nccl word it differently)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another rank's process went away."""
    text = str(error).lower()
    return any(words in text for words in ("connection closed", "connection reset", "broken pipe", "peer"))


# Training runs of this process that started and have not finished (a grid trains several in one process).
_unfinished_runs = 0


def run_started() -> None:
    """A training run begins in this process (see :func:`_destroy_group_after_clean_run`)."""
    global _unfinished_runs
    _unfinished_runs += 1


def run_finished() -> None:
    """The training run begun last ended without an error."""
    global _unfinished_runs
    _unfinished_runs = max(0, _unfinished_runs - 1)


# The exit barrier's work (see :func:`_destroy_group_after_clean_run`): released with this module's globals.
_held_to_the_end: list[Any] = []


def _destroy_group_after_clean_run() -> None:
    """At exit: meet the other ranks and destroy the process group when every run of the process finished and
    no exception is escaping; otherwise leave at once with status 1.

    Clean path. Once DistributedDataParallel has wrapped a model, destroying the group no longer stops gloo's
    worker threads (torch keeps the group alive until the process ends). A worker that releases the tensors of
    the last collective after the interpreter began shutting down needs the interpreter's lock, cannot have it
    then, and aborts the process ("terminate called without an active exception", exit -6 after a finished
    run; 1 exit in 20-30 when the cores are oversubscribed). So the ranks meet in a barrier whose work this
    process keeps to its end: the barrier holds every collective still in a worker's hands when it was issued,
    so their tensors go with the barrier's work, released by this thread as the interpreter clears its modules,
    never by a worker. A rank that left without meeting (its own output says why) turns the barrier into an
    error, and this rank leaves with status 1 as well.

    Failure path (an uncaught exception, or a run that raised and whose error the command line reported): a peer
    may be gone or mid-collective, and destroying the group, or leaving it to the interpreter's teardown,
    sometimes aborts the process (exit -6 instead of the error's 1). The error has been printed by then, so the
    process leaves at once with status 1, past the backend's teardown (the kernel releases its sockets, files and
    locks)."""
    if not dist.is_initialized():
        return
    if _unfinished_runs == 0 and getattr(sys, "last_type", None) is None:
        try:
            meeting = dist.barrier(async_op=True)
            meeting.wait()
        except RuntimeError as error:
            print(f"rank {dist.get_rank()}: another rank left without finishing ({first_line(error)}); its own "
                  "output says why", file=sys.stderr)
        else:
            _held_to_the_end.append(meeting)
            dist.destroy_process_group()
            return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
