"""What a run's output folder holds, and the one rule for starting a run in a folder that holds one.

A run writes ``metrics.jsonl``, ``checkpoints/{last,last.prev,best}.pt``, ``results.json`` and, last and
atomically, ``checkpoints/finished.json``: its presence means the run is complete. A folder holding any of
these holds work, and a run started there without being told what to do with it is refused
(:func:`check_output_folder`): ``resume`` continues it (a finished run is returned as it is), ``overwrite``
replaces it (:func:`clear_run` removes the finished marker first, so an interrupted replacement never looks
finished). Every command and grid that trains goes through this one rule (``--resume`` / ``--overwrite``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from longattn.utils import write_text_atomic

__all__ = ["FINISHED", "LogError", "NoSpaceError", "OutputFolderError", "RunFiles", "TrainingError",
           "append_line", "check_not_in_use", "check_output_folder", "lock_output_folder",
           "clear_run", "inspect_output", "is_out_of_space", "writing", "read_finished", "read_jsonl", "write_text_atomic"]

CHECKPOINTS = "checkpoints"
FINISHED = f"{CHECKPOINTS}/finished.json"
RESULTS = "results.json"
METRICS = "metrics.jsonl"
CHECKPOINT_FILES = (f"{CHECKPOINTS}/last.pt", f"{CHECKPOINTS}/last.prev.pt", f"{CHECKPOINTS}/best.pt")
# the files that hold a run's work, the finished marker first: clear_run removes them in this order
WORK_FILES = (FINISHED, RESULTS, *CHECKPOINT_FILES, METRICS)


class TrainingError(ValueError):
    """A run cannot go on: a non-finite loss, an output folder in use, an incompatible checkpoint."""


class OutputFolderError(TrainingError):
    """An output folder is in use by another run, or holds a run that this run would replace unasked."""


class NoSpaceError(OSError):
    """The output folder's device is full (or over quota): what was written before is intact."""


class LogError(ValueError):
    """A JSON-lines log has a damaged line other than a torn last one."""


def is_out_of_space(error: BaseException) -> bool:
    return isinstance(error, NoSpaceError) or (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT))


@contextlib.contextmanager
def writing(out_dir: str | os.PathLike, what: str, kept: str = "what was written before is intact") -> Iterator[None]:
    """Around a write of ``what`` into the output folder ``out_dir``: a full disk (or quota) becomes one
    :class:`NoSpaceError` that names the folder, says what is kept and how to go on (the outermost of nested
    ones words it: it knows best what is kept)."""
    try:
        yield
    except OSError as error:
        if not is_out_of_space(error):
            raise
        raise NoSpaceError(f"no space left on --out {out_dir} while writing {what}; {kept}; free some space, then "
                           "run again with --resume") from None


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` and a newline to ``path`` (a JSON-lines log). A kill or a full disk can cut the append
    short: :func:`read_jsonl` drops such a torn last line."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


def read_jsonl(path: str | os.PathLike, torn_last_line: Literal["drop", "error"] = "drop") -> list[dict[str, Any]]:
    """The records of a JSON-lines log. A last line that does not parse (an append cut by a kill or a full
    disk) is dropped with a warning naming the file (``torn_last_line="drop"``); any other damaged line is a
    :class:`LogError` naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise LogError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            last = all(not rest.strip() for rest in lines[number:])
            if last and torn_last_line == "drop":
                print(f"warning: {path}:{number}: dropped a torn last line (an append cut short by a kill or a full "
                      f"disk: {error})", file=sys.stderr)
                continue
            raise LogError(f"{path}:{number}: not a JSON record ({error}); fix or delete that line") from None
        records.append(record)
    return records


@dataclass(frozen=True)
class RunFiles:
    """The work files present in a run folder (relative paths, in :data:`WORK_FILES` order)."""

    folder: Path
    present: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not self.present

    @property
    def finished(self) -> bool:
        """The run's finished marker is there (it is written last, atomically)."""
        return FINISHED in self.present

    @property
    def has_checkpoints(self) -> bool:
        return any(name in self.present for name in CHECKPOINT_FILES) or METRICS in self.present

    def describe(self) -> str:
        if self.finished:
            return f"a finished run ({FINISHED})"
        if self.has_checkpoints:
            return f"an interrupted run ({', '.join(n for n in self.present if n != RESULTS)})"
        return f"the results of a run ({', '.join(self.present)})"


def inspect_output(folder: str | os.PathLike) -> RunFiles:
    folder = Path(folder)
    return RunFiles(folder, tuple(name for name in WORK_FILES if (folder / name).is_file()))


LOCK = ".lock"


def lock_output_folder(folder: str | os.PathLike) -> Any:
    """An exclusive lock on ``folder`` (``folder/.lock``, flock: released by the kernel when the process dies,
    so a killed run never leaves a stale lock); the open lock file, to be closed to release it. A folder that
    another run holds (this process or another) is :class:`OutputFolderError` naming the holder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise OutputFolderError(f"output folder {folder} is in use by another run ({holder}); wait for it to finish "
                                "or choose another output folder") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def check_not_in_use(folder: str | os.PathLike) -> None:
    """:class:`OutputFolderError` if another run holds ``folder`` (a probe: takes the lock and lets it go)."""
    if (Path(folder) / LOCK).is_file():
        lock_output_folder(folder).close()


def check_output_folder(folder: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
                        locked: bool = False) -> RunFiles:
    """The rule for starting a run in ``folder``: allowed when it holds no run's work, or when asked to
    ``resume`` it or ``overwrite`` it; otherwise :class:`OutputFolderError` naming the folder and what it holds
    (or the run that is using it). Writes nothing (``overwrite`` is carried out by :func:`clear_run`, by the
    process that holds the folder's lock). ``locked``: the caller holds the lock (no probe for another run)."""
    if resume and overwrite:
        raise OutputFolderError("--resume and --overwrite exclude each other: continue the run in the output "
                                "folder, or replace it")
    if not locked:
        check_not_in_use(folder)
    files = inspect_output(folder)
    if files.empty or resume or overwrite:
        return files
    raise OutputFolderError(f"output folder {files.folder} already holds {files.describe()}; pass --resume to "
                            "continue it (resume=True), --overwrite to replace it (overwrite=True), or choose "
                            "another output folder")


def clear_run(folder: str | os.PathLike) -> None:
    """Remove a run's work from ``folder``, its finished marker first; evaluations of its checkpoints
    (``eval_*.json``) go with it. Anything else in the folder is left alone."""
    folder = Path(folder)
    for name in WORK_FILES:
        (folder / name).unlink(missing_ok=True)
    for stale in folder.glob("eval_*.json"):
        stale.unlink(missing_ok=True)


def read_finished(folder: str | os.PathLike) -> dict | None:
    """The content of the finished marker (``{"fingerprint", "results"}``), or None when there is none or it
    does not parse (a marker is written atomically, so an unreadable one was damaged afterwards)."""
    path = Path(folder) / FINISHED
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("results"), dict) else None
