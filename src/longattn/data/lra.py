"""The five Long Range Arena tasks: their table, dataset dispatch and batching with explicit masks.

    task = get_task("listops")                    # LRATask(name, vocab_size, num_classes, max_len, dual, pad_id)
    ds = build_dataset("listops", split="train", data_dir=None, num_examples=2000, min_length=50, max_length=200)
    batch = collate([ds[0], ds[1]])              # tokens [B, N], attention_mask [B, N] (True = real), label [B]

Padding is marked only by the mask: pad_id may equal a real token (pixel tasks use all 256 values).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset

from . import image, listops, pathfinder, retrieval, text
from .common import DatasetError, pad_sequences


@dataclass(frozen=True)
class LRATask:
    name: str
    vocab_size: int
    num_classes: int
    max_len: int  # longest sequence with the LRA settings (per document for dual tasks)
    dual: bool
    pad_id: int


LRA_TASKS: dict[str, LRATask] = {
    "listops": LRATask("listops", listops.VOCAB_SIZE, listops.NUM_CLASSES, 2000, False, listops.PAD_ID),
    "text": LRATask("text", text.VOCAB_SIZE, text.NUM_CLASSES, 4096, False, text.PAD_ID),
    "retrieval": LRATask("retrieval", retrieval.VOCAB_SIZE, retrieval.NUM_CLASSES, 4000, True, retrieval.PAD_ID),
    "image": LRATask("image", image.VOCAB_SIZE, image.NUM_CLASSES, image.SEQ_LEN, False, image.PAD_ID),
    "pathfinder": LRATask("pathfinder", pathfinder.VOCAB_SIZE, pathfinder.NUM_CLASSES, 1024, False,
                          pathfinder.PAD_ID),
}

_BUILDERS: dict[str, Callable[..., Dataset]] = {
    "listops": listops.build_listops,
    "text": text.build_text,
    "retrieval": retrieval.build_retrieval,
    "image": image.build_image,
    "pathfinder": pathfinder.build_pathfinder,
}


def get_task(name: str) -> LRATask:
    try:
        return LRA_TASKS[name]
    except KeyError:
        raise DatasetError(f"unknown LRA task {name!r}; choose from {', '.join(LRA_TASKS)}") from None


CACHE_VERSION = 1  # bump when a builder's output changes, so old cache files are not reused


def _cache_path(cache_dir: str | Path, name: str, split: str, data_dir: str | Path | None,
                options: dict[str, Any]) -> Path:
    source = None
    if data_dir is not None:
        path = Path(data_dir).resolve()
        source = (str(path), path.stat().st_mtime_ns if path.exists() else None)
    key = repr((CACHE_VERSION, name, split, source, sorted(options.items())))
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return Path(cache_dir) / f"{name}-{split}-{digest}.pkl"


def build_dataset(name: str, split: str = "train", data_dir: str | Path | None = None, *,
                  cache_dir: str | Path | None = None, **options: Any) -> Dataset:
    """The dataset of task `name` for `split`; options go to the task's builder (see docs/data.md).

    listops and pathfinder are generated when data_dir is None and read the official files from data_dir
    otherwise (a data_dir without them is an error); text, retrieval and image need data_dir. Unknown options raise DatasetError naming the accepted ones.
    cache_dir: keep the built dataset there (keyed by task, split, data_dir and its mtime, options),
    so slow generation or decoding (200k Pathfinder images, 50k JPEGs) happens once.
    """
    get_task(name)
    cache = _cache_path(cache_dir, name, split, data_dir, options) if cache_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            with open(cache, "rb") as handle:
                return pickle.load(handle)
        except Exception as error:  # a cache file damaged since it was written: build the data again
            print(f"warning: {cache} is damaged ({type(error).__name__}: {error}); building the dataset again",
                  file=sys.stderr)
    builder = _BUILDERS[name]
    try:
        dataset = builder(split, data_dir, **options)
    except TypeError as error:
        if "unexpected keyword argument" in str(error):
            raise DatasetError(f"{name}: {error}") from None
        raise
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
        with open(tmp, "wb") as handle:
            pickle.dump(dataset, handle, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(cache)  # atomic: concurrent builders (e.g. DDP ranks) never read a partial file
    return dataset


def collate(items: Sequence[dict], pad_to: int | None = None, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Stack items into right-padded LongTensors with bool masks (True = real token).

    Single: {"tokens", "attention_mask", "label"}; dual: {"tokens0", "attention_mask0", "tokens1",
    "attention_mask1", "label"}. The padded positions hold `pad_id`, but only the mask says what is
    padding. pad_to fixes the width (an error if an item is longer).
    """
    if not items:
        raise DatasetError("collate: empty batch")
    batch: dict[str, torch.Tensor] = {}
    keys = ("tokens0", "tokens1") if "tokens0" in items[0] else ("tokens",)
    for key in keys:
        if any(key not in item for item in items):
            raise DatasetError(f"collate: every item needs {key!r}")
        suffix = key[len("tokens"):]
        batch[key], batch["attention_mask" + suffix] = pad_sequences([item[key] for item in items], pad_id, pad_to, key)
    batch["label"] = torch.tensor([int(item["label"]) for item in items], dtype=torch.long)
    return batch
