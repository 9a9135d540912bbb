"""LRA Retrieval: ACL Anthology Network citation pairs, byte level, two towers.

The official files are `new_aan_pairs.{train,eval,test}.tsv` (folder `tsv_data/` of lra_release):
no header, five tab-separated columns `label  id1  id2  text1  text2`, label 0/1 (sometimes
written `0.0`/`1.0`). Each document becomes its UTF-8 bytes (ids 0..255), truncated to
`max_length` (LRA: 4000 per document); id 256 is padding. Our split `val` reads the `eval` file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .common import DatasetError, PairDataset, check_split, download_command, encode_bytes, find_first, no_layout_error

VOCAB_SIZE = 257
PAD_ID = 256
NUM_CLASSES = 2
FILE_SPLIT = {"train": "train", "val": "eval", "test": "test"}


def tsv_path(data_dir: str | Path, split: str) -> Path | None:
    name = f"new_aan_pairs.{FILE_SPLIT[check_split(split)]}.tsv"
    # lra_release.gz unpacks to lra_release/lra_release/tsv_data/ (as LRA's own dataset_setup.sh reads it)
    return find_first(data_dir, [name, f"tsv_data/{name}", f"lra_release/tsv_data/{name}",
                                 f"lra_release/lra_release/tsv_data/{name}"])


def read_pairs(path: str | Path) -> list[tuple[int, str, str, bytes, bytes]]:
    """(label, id1, id2, text1 bytes, text2 bytes) rows of one AAN pairs file, validated."""
    path = Path(path)
    rows = []
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            fields = line.split(b"\t")
            if len(fields) != 5:
                raise DatasetError(f"{path}:{line_number}: expected 5 tab-separated columns "
                                   f"(label, id1, id2, text1, text2), got {len(fields)}")
            try:
                value = float(fields[0])
            except ValueError:
                raise DatasetError(f"{path}:{line_number}: label {fields[0][:20]!r} is not a number") from None
            if value not in (0.0, 1.0):
                raise DatasetError(f"{path}:{line_number}: label {fields[0][:20]!r} is not 0 or 1")
            rows.append((int(value), fields[1].decode("utf-8", "replace"), fields[2].decode("utf-8", "replace"),
                         fields[3], fields[4]))
    if not rows:
        raise DatasetError(f"{path}: no document pairs")
    return rows


def build_retrieval(split: str, data_dir: str | Path | None = None, *, max_length: int = 4000) -> PairDataset:
    check_split(split)
    expected = f"new_aan_pairs.{FILE_SPLIT[split]}.tsv"
    if data_dir is None:
        raise DatasetError(f"retrieval (AAN) needs data_dir: a folder with {expected} (lra_release/tsv_data/)")
    if max_length < 1:
        raise DatasetError(f"max_length must be >= 1, got {max_length}")
    path = tsv_path(data_dir, split)
    if path is None:
        raise no_layout_error(f"retrieval (AAN): no {expected}", Path(data_dir),
                              [f"{expected} in the folder", f"tsv_data/{expected}",
                               "the unpacked LRA release: lra_release/tsv_data/ or lra_release/lra_release/tsv_data/"],
                              download_command("lra_release", data_dir, unverified=True))
    rows = read_pairs(path)
    first = [encode_bytes(row[3], max_length) for row in rows]
    second = [encode_bytes(row[4], max_length) for row in rows]
    return PairDataset(first, second, [row[0] for row in rows], pad_id=PAD_ID, vocab_size=VOCAB_SIZE,
                       dtype=np.uint8)
