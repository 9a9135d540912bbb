"""Checkpoints that are atomic, checksummed and safe to load.

* Atomic: written to a temporary file in the same folder, fsynced, then renamed over the target,
  so a crash mid-write never destroys the previous checkpoint and the target never goes missing; with
  ``keep_previous`` the file it replaces is kept as ``<name>.prev.pt`` (the fallback when the newest turns
  out damaged).
* Checksummed: the file holds ``{"format", "sha256", "payload"}`` where ``payload`` is the
  ``torch.save`` bytes of the state; a truncated file, or one with bytes changed anywhere, fails
  the check (torch itself does not verify tensor data, so damage there would load silently).
* Safe: both layers load with ``torch.load(weights_only=True)``: tensors, containers and plain
  values only, never code.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT = "longattn-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or not a longattn checkpoint."""


def previous_path(path: str | os.PathLike) -> Path:
    """Where :func:`save_atomic` keeps the checkpoint that ``path`` replaced: ``last.pt`` -> ``last.prev.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_atomic(obj: Any, path: str | os.PathLike, keep_previous: bool = False) -> None:
    """Write ``obj`` (tensors, containers, plain values) to ``path`` checksummed and atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    record = {"format": FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _save_to(record, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.is_file():
            _keep_copy(path, previous_path(path))
        os.replace(tmp, path)  # ``path`` exists at every instant: an interrupt leaves the old or the new file
        _fsync_folder(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _WriteRecorder:
    """A file's ``write`` that remembers the OSError it raised: torch's zip writer sometimes swallows it and
    raises its own ``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos ...`` instead."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def _save_to(obj: Any, file: Any) -> None:
    """``torch.save(obj, file)`` where a failed write (a full disk) always comes out as the OSError it was."""
    recorder = _WriteRecorder(file)
    try:
        torch.save(obj, recorder)
    except (OSError, RuntimeError) as error:
        if recorder.error is not None and recorder.error is not error:
            raise recorder.error from None
        raise


def _keep_copy(path: Path, copy: Path) -> None:
    """Atomically make ``copy`` a copy of ``path``, leaving ``path`` in place: a hard link (free) where the
    file system has them, else a byte copy, each made under a temporary name and renamed over ``copy``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{copy.name}.", suffix=".tmp", dir=copy.parent)
    os.close(fd)
    try:
        os.unlink(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, copy)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_temporary_files(folder: str | os.PathLike, names: tuple[str, ...] | None = None) -> list[Path]:
    """Delete the temporary files a killed atomic write (:func:`save_atomic`, ``write_text_atomic``) left in
    ``folder`` (only those of the files ``names``, if given); returns them. Only call it while no other
    process writes there (the Trainer holds the output-folder lock)."""
    folder = Path(folder)
    patterns = [".*.tmp"] if names is None else [f".{name}.*.tmp" for name in names]
    stale = sorted({p for pattern in patterns for p in folder.glob(pattern)}) if folder.is_dir() else []
    for file in stale:
        file.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """Load a checkpoint written by :func:`save_atomic` after verifying its checksum.

    Raises :class:`CheckpointError` naming the file when it is missing, truncated, damaged or not
    a longattn checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, pickle errors, EOFError, ... for damaged files
        raise CheckpointError(f"checkpoint {path} is damaged or truncated ({first_line(error)})") from None
    if not (isinstance(record, dict) and record.get("format") == FORMAT and isinstance(record.get("payload"), bytes)):
        raise CheckpointError(f"{path} is not a {FORMAT} file (written by another version, or not a checkpoint)")
    if hashlib.sha256(record["payload"]).hexdigest() != record.get("sha256"):
        raise CheckpointError(f"checkpoint {path} is damaged: its SHA256 does not match its content")
    try:
        return torch.load(io.BytesIO(record["payload"]), map_location=map_location, weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint {path} holds data that does not load with weights_only=True "
                              f"({first_line(error)})") from None


def load_with_fallback(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> tuple[Any, Path]:
    """Load ``path``, or the previous checkpoint it replaced when ``path`` is missing or damaged.

    Returns ``(state, the file it came from)``; prints a warning when it falls back. Raises
    :class:`CheckpointError` listing every file tried when none is usable.
    """
    failures = []
    for candidate in (Path(path), previous_path(path)):
        try:
            state = load_checkpoint(candidate, map_location)
        except CheckpointError as error:
            failures.append(str(error))
            continue
        if failures:
            print(f"warning: {failures[0]}; falling back to {candidate}", file=sys.stderr)
        return state, candidate
    raise CheckpointError("no usable checkpoint: " + "; ".join(failures)
                          + "; delete the folder (or use another output folder) to start afresh")


def model_layout(model: nn.Module) -> dict[str, list[Any]]:
    """{name: [shape..., dtype]} of every parameter and buffer: what a checkpoint of ``model`` must hold."""
    return {name: [*tensor.shape, str(tensor.dtype).removeprefix("torch.")] for name, tensor in model.state_dict().items()}


def layout_difference(saved: dict[str, list[Any]], current: dict[str, list[Any]]) -> str:
    """A short account of how two :func:`model_layout` differ (the first few names of each kind)."""
    missing = [name for name in current if name not in saved]
    unexpected = [name for name in saved if name not in current]
    changed = [f"{name} {saved[name]} vs {current[name]}" for name in current
               if name in saved and saved[name] != current[name]]
    parts = [f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
             for label, names in (("missing", missing), ("unexpected", unexpected), ("shape", changed)) if names]
    return "; ".join(parts)


def non_finite_tensors(state: dict[str, Any]) -> list[str]:
    """The names of the floating tensors of ``state`` that hold a NaN or an infinity (one pass over them)."""
    return [name for name, t in state.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def check_finite_weights(state: dict[str, Any], source: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming the tensors of ``state`` (loaded from ``source``) that hold a NaN or an
    infinity: a file whose bytes were overwritten (safetensors checks no data) loads them without a word."""
    broken = non_finite_tensors(state)
    if broken:
        first = state[broken[0]]
        count = int((~torch.isfinite(first)).sum())
        more = " ..." if len(broken) > 3 else ""
        raise CheckpointError(f"{source}: non-finite weights in {', '.join(broken[:3])}{more} ({count} of the "
                              f"{first.numel()} values of {broken[0]}); the file is damaged or was saved from a "
                              "diverged run (check_finite=False loads it anyway)")


def load_weights(model: torch.nn.Module, state: dict[str, Any], source: str | os.PathLike,
                 ignore: Callable[[str], bool] = lambda name: False,
                 hint: str = "use the checkpoint of a run with this model and settings",
                 check_finite: bool = True) -> None:
    """``model.load_state_dict(state)`` after checking that ``state`` (from ``source``) has the model's
    parameters and buffers with their shapes: a checkpoint of another model is a :class:`CheckpointError`
    naming the file and the first differences, not torch's long error. ``ignore``: names allowed to be
    missing from ``state`` (they keep the model's values); ``hint``: what to do, in the error; ``check_finite``:
    refuse non-finite weights (:func:`check_finite_weights`)."""
    current = {name: spec for name, spec in model_layout(model).items() if not (ignore(name) and name not in state)}
    saved = {name: [*tensor.shape, str(tensor.dtype).removeprefix("torch.")] if isinstance(tensor, torch.Tensor) else []
             for name, tensor in state.items()}
    # dtypes may differ (a float32 checkpoint into a float64 model): load_state_dict copies across them
    shapes = lambda layout: {name: spec[:-1] for name, spec in layout.items()}  # noqa: E731
    if shapes(saved) != shapes(current):
        raise CheckpointError(f"{source} holds the weights of another model ({layout_difference(saved, current)}); "
                              f"{hint}")
    if check_finite:
        check_finite_weights(state, source)
    try:
        model.load_state_dict(state, strict=not any(ignore(name) for name in model.state_dict()))
    except (RuntimeError, ValueError) as error:
        raise CheckpointError(f"{source} does not load into this model ({first_line(error)})") from None


def first_line(error: BaseException) -> str:
    """The exception's type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
