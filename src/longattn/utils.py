"""Small shared helpers: seeding, RNG state capture for exact resume, strict JSON, atomic text files, optional imports."""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

# numpy and torch are imported where they are used: the command line reads note() and duration() from here
# before any command runs, and `longattn --help` must not wait for torch (tests/commands/test_cli_startup.py).


def optional_import(module: str, extra: str = "experiments") -> ModuleType:
    """Import ``module``, which the library core does not depend on, or say which extra installs it.

    The library needs only torch and numpy; configs (pyyaml), progress bars (tqdm), plots (matplotlib)
    and image data (pillow) come with ``pip install 'longattn[experiments]'`` and are imported when used.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{module} is needed here: pip install 'longattn[{extra}]'") from None


def note(text: str) -> None:
    """One line on stderr that does not mix into a command's output (e.g. a setting the run adjusted)."""
    print(f"note: {text}", file=sys.stderr, flush=True)


def warn(text: str) -> None:
    """A ``warning:`` line on stderr: the run goes on, but not as its settings said (e.g. a subset larger than
    the data)."""
    print(f"warning: {text}", file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 14 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """All RNG states, so a resumed run draws exactly the numbers an uninterrupted one would."""
    import numpy as np
    import torch

    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's key array as a tensor, so checkpoints load with torch.load(weights_only=True)
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def strict_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by None, so that
    ``json.dumps(..., allow_nan=False)`` writes standard JSON (bare NaN/Infinity are not JSON)."""
    if isinstance(obj, dict):
        return {key: strict_json(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(value) for value in obj]
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only once numpy is imported
    if isinstance(obj, float) or (numpy is not None and isinstance(obj, numpy.floating)):
        return float(obj) if math.isfinite(obj) else None
    if numpy is not None and isinstance(obj, numpy.integer):
        return int(obj)
    return obj


def dumps_strict(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` writing standard JSON: non-finite floats become null (see :func:`strict_json`)."""
    return json.dumps(strict_json(obj), allow_nan=False, **kwargs)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and one rename: a reader (or a
    resume after a kill or a full disk) sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
