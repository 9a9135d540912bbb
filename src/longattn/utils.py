"""Small shared helpers: seeding, RNG state capture for exact resume, optional imports."""

from __future__ import annotations

import importlib
import random
from types import ModuleType
from typing import Any

import numpy as np
import torch


def optional_import(module: str, extra: str = "experiments") -> ModuleType:
    """Import ``module``, which the library core does not depend on, or say which extra installs it.

    The library needs only torch and numpy; configs (pyyaml), progress bars (tqdm), plots (matplotlib)
    and image data (pillow) come with ``pip install 'longattn[experiments]'`` and are imported when used.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{module} is needed here: pip install 'longattn[{extra}]'") from None


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """All RNG states, so a resumed run draws exactly the numbers an uninterrupted one would."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
