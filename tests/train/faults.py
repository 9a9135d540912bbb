"""Faults for the resume tests: a disk that fills up during the nth write of a checkpoint or a log append,
and a torn last line. Used in-process by test_train_reliability.py and by the DDP worker."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import longattn.train.loop as loop

DEV_FULL = Path("/dev/full")  # every write to it fails with ENOSPC, from the kernel


def full_disk_in_write(nth: int, name: str = "last.pt", after_bytes: int | None = None, patch=setattr) -> None:
    """The ``nth`` atomic write of checkpoint ``name`` meets a full disk: its temporary file is /dev/full
    (``after_bytes=None``: the kernel's own ENOSPC on the first write that reaches the disk), or a file
    that takes ``after_bytes`` bytes and then fails as a full disk does. ``patch``: ``setattr``, or a test's
    ``monkeypatch.setattr`` (undone after the test)."""
    real_mkstemp, real_fdopen, writes = tempfile.mkstemp, os.fdopen, []

    def mkstemp(*args, prefix=None, **kwargs):
        fd, path = real_mkstemp(*args, prefix=prefix, **kwargs)
        if prefix == f".{name}.":
            writes.append(path)
            if len(writes) == nth and after_bytes is None:
                os.close(fd)
                return os.open(DEV_FULL, os.O_WRONLY), path
        return fd, path

    def fdopen(fd, *args, **kwargs):
        handle = real_fdopen(fd, *args, **kwargs)
        if after_bytes is not None and len(writes) == nth and "b" in (args[0] if args else kwargs.get("mode", "r")):
            return _FillingFile(handle, after_bytes)
        return handle

    patch(tempfile, "mkstemp", mkstemp)
    patch(os, "fdopen", fdopen)


class _FillingFile:
    """A file on a disk with ``room`` bytes left: the write that goes past them fails with ENOSPC."""

    def __init__(self, handle, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.handle.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def full_disk_in_log_append(nth: int, patch=setattr) -> None:
    """The ``nth`` append to metrics.jsonl writes half its line, then the disk is full."""
    real_append, appends = loop.append_line, []

    def append_line(path, line):
        appends.append(line)
        if len(appends) == nth:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(line[: len(line) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_append(path, line)

    patch(loop, "append_line", append_line)


def tear_last_line(path: Path) -> str:
    """Append half a record to a JSON-lines log, as a kill during an append leaves it; returns it."""
    torn = '{"split": "train", "step": 99, "lo'
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(torn)
    return torn
