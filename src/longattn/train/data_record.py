"""What data a run trains on, recorded in its checkpoints so that ``--resume`` refuses other data.

The config fingerprint says which files a run reads (``data.data_dir``, the options), not what they hold: a data
file replaced, re-downloaded from another mirror or edited under the same name would otherwise let a resumed run
continue its weights, optimiser state and schedule on data it was never trained on, and report a mixture as one
run. Each split is recorded as its number of examples and a digest of every example, as the loop sees them
(after tokenisation, vocabulary and scaling), so a change that alters nothing the model sees is no change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["SPLIT_NAMES", "data_differences", "dataset_record"]

SPLIT_NAMES = {"train": "the training set", "val": "the validation set", "test": "the test set"}


def _digest_value(digest: Any, value: Any) -> None:
    """Feed one example (a mapping, sequence, tensor, array or scalar, nested) into ``digest``, with the keys,
    dtypes and shapes, so that examples with the same bytes in another arrangement differ."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(f"<{key}>".encode())
            _digest_value(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}]".encode())
        for item in value:
            _digest_value(digest, item)
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
    else:
        digest.update(repr(value).encode())


def dataset_record(dataset: Dataset | None) -> dict[str, Any] | None:
    """``{"examples": n, "sha256": ...}`` of a split (None for a split the run does not have): the digest covers
    every example in order, read once through ``dataset[index]``."""
    if dataset is None:
        return None
    digest = hashlib.sha256()
    size = len(dataset)  # type: ignore[arg-type]
    for index in range(size):
        _digest_value(digest, dataset[index])
    return {"examples": size, "sha256": digest.hexdigest()}


def data_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between two records of the splits (``{split: dataset_record}``), one phrase per split, e.g.
    ``the training set: 5,000 examples when the checkpoint was written, 4,990 now``; empty when none does."""
    differences = []
    for split, name in SPLIT_NAMES.items():
        before, now = recorded.get(split), current.get(split)
        if before == now:
            continue
        if before is None or now is None:
            was = "none" if before is None else f"{before['examples']:,} examples"
            is_now = "none" if now is None else f"{now['examples']:,} examples"
            differences.append(f"{name}: {was} when the checkpoint was written, {is_now} now")
        elif before["examples"] != now["examples"]:
            differences.append(f"{name}: {before['examples']:,} examples when the checkpoint was written, "
                               f"{now['examples']:,} now")
        else:
            differences.append(f"{name}: the same {now['examples']:,} examples in number, but other ones")
    return differences
