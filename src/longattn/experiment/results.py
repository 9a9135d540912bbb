"""The one writer of results files, and the provenance every results.json carries.

``write_results(path, payload, config=..., seeds=..., started=...)`` writes ``payload`` plus a
``provenance`` block (longattn version, git commit when run from a checkout, torch version, device,
command line, config hash, seeds, start and end time) atomically and as strict JSON: NaN and infinities
become null, so every reader can parse it.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from longattn.config import config_hash
from longattn.train.outputs import writing
from longattn.utils import dumps_strict, write_text_atomic

__all__ = ["markdown_table", "now", "provenance", "write_results"]


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@functools.lru_cache(maxsize=1)
def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("longattn")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def _git() -> dict[str, Any] | None:
    """Commit and dirtiness of the checkout this package runs from (None when not in a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())}


# Read now, with the code the process imports: a long run (a forecast grid) on an editable install keeps the code
# it started with while its checkout moves on, and must record that commit, not the one current at its first write.
_git()


def _device() -> str:
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def provenance(config: Any = None, seeds: list[int] | None = None, started: str | None = None) -> dict[str, Any]:
    """Where a result comes from: code, library versions, machine, command line, config, seeds, times."""
    return {
        "longattn_version": _version(),
        "git": _git(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": _device(),
        "torch_threads": torch.get_num_threads(),
        "argv": list(sys.argv),
        "config_hash": config_hash(config) if config is not None else None,
        "seeds": list(seeds) if seeds is not None else None,
        "started": started,
        "finished": now(),
    }


def write_results(path: str | Path, payload: dict[str, Any], *, config: Any = None, seeds: list[int] | None = None,
                  started: str | None = None) -> Path:
    """Write ``payload`` + ``provenance`` to ``path`` (atomically: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {**payload, "provenance": provenance(config, seeds, started)}
    with writing(path.parent, path.name):  # a full disk: one line naming the folder; the old file stays whole
        write_text_atomic(path, dumps_strict(document, indent=2, default=str) + "\n")
    return path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """The human table beside a results file: a markdown table with aligned columns."""
    text = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in text]
    return "\n".join(lines)
