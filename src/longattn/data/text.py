"""LRA Text: IMDb sentiment (Maas et al. 2011) at byte level.

Reads the official `aclImdb_v1.tar.gz` layout, `aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt`,
either from an archive of the data folder that holds it (.tar.gz, .tgz, .tar or .zip, any name, read by
content) or from an extracted folder. Token ids are
the UTF-8 byte values 0..255; id 256 is padding (never produced by the data); sequences are
truncated to the first `max_length` bytes (LRA: 4K). Labels: neg = 0, pos = 1.

IMDb has no validation split. LRA evaluates on the test set during training, so `val` is the test
set by default (`val_source="test"`); `val_source="holdout"` holds out a seeded `val_fraction` of
train instead (and `train` then excludes it).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .common import (DatasetError, SequenceDataset, archive_candidates, check_count, check_real_entry, check_split,
                     download_command, encode_bytes, holdout_split, iter_archive_files, no_layout_error, once_per_block,
                     read_bytes)
from .download import ARCHIVES, verify_known_archive

VOCAB_SIZE = 257
PAD_ID = 256
NUM_CLASSES = 2
LABELS = {"neg": 0, "pos": 1}
# Maas et al. 2011: 25,000 labelled reviews per split, 12,500 of each class.
OFFICIAL_COUNTS = {"neg": 12_500, "pos": 12_500}
_MEMBER = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")


LAYOUTS = ("aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt as a folder (or {train,test}/{pos,neg}/ directly)",
           "the same tree in a .tar.gz, .tgz, .tar or .zip (aclImdb_v1.tar.gz)")


def _archive_in(folder: Path) -> tuple[Path, dict[str, list[tuple[int, int, bytes]]]] | None:
    """The first archive of ``folder`` that holds IMDb reviews (by content; ones named aclImdb* are tried first)
    and its reviews by subset."""
    for archive in archive_candidates(folder, "aclImdb"):
        rows = _archive_rows(archive)
        if rows["train"] or rows["test"]:
            return archive, rows
    return None


def _read_archive(path: Path, subset: str) -> list[tuple[int, int, bytes]]:
    return list(_archive_rows(path)[subset])  # a copy: read_imdb sorts it


@once_per_block
def _archive_rows(path: Path) -> dict[str, list[tuple[int, int, bytes]]]:
    """(label, id, bytes) of every review in the archive by subset, both subsets in one pass."""
    if path.name == ARCHIVES["imdb"].filename:
        verify_known_archive(path, ARCHIVES["imdb"])
    rows: dict[str, list[tuple[int, int, bytes]]] = {"train": [], "test": []}
    for name, content in iter_archive_files(path):
        match = _MEMBER.search(name)
        if match is not None:
            rows[match.group(1)].append((LABELS[match.group(2)], int(match.group(3)), content))
    return rows


def _read_folder(root: Path, subset: str) -> list[tuple[int, int, bytes]]:
    rows = []
    for name, label in LABELS.items():
        folder = root / subset / name
        if not folder.is_dir():
            raise DatasetError(f"IMDb: missing folder {folder} (expected aclImdb/{{train,test}}/{{pos,neg}}/)")
        for file in sorted(folder.glob("*.txt")):
            match = re.fullmatch(r"(\d+)_(\d+)\.txt", file.name)
            if match is None:
                raise DatasetError(f"IMDb: unexpected file name {file} (expected <id>_<rating>.txt)")
            check_real_entry(file, "document")
            rows.append((label, int(match.group(1)), read_bytes(file)))
    return rows


def read_imdb(data_dir: str | Path, subset: str, check_counts: bool = True) -> list[tuple[int, bytes]]:
    """(label, review bytes) of the official `train` or `test` subset, sorted by (label, id).

    The official archive (by its file name) is checked against its SHA256; any archive is read to
    its end (a damaged one is an error); ``check_counts`` compares the counts per class with the
    official 12,500 (False: a deliberate subset)."""
    source = Path(data_dir)
    if source.is_file():
        rows = _read_archive(source, subset)
        where = str(source)
    elif (source / "aclImdb" / subset).is_dir():
        rows, where = _read_folder(source / "aclImdb", subset), str(source / "aclImdb")
    elif (source / subset / "pos").is_dir() or (source / subset / "neg").is_dir():
        rows, where = _read_folder(source, subset), str(source)
    elif (found := _archive_in(source)) is not None:
        rows, where = list(found[1][subset]), str(found[0])  # a copy: sorted below
    else:
        raise no_layout_error("IMDb", source, LAYOUTS, download_command("imdb", source))
    if not rows:
        raise DatasetError(f"IMDb: no reviews for {subset!r} in {where}")
    counts = {label: sum(1 for r in rows if r[0] == label) for label in LABELS.values()}
    if min(counts.values()) == 0:
        raise DatasetError(f"IMDb: {where} has reviews of only one class in {subset!r}: {counts}")
    check_count(f"IMDb {where}", repr(subset), {name: counts[label] for name, label in LABELS.items()},
                OFFICIAL_COUNTS, check_counts)
    rows.sort(key=lambda row: (row[0], row[1]))
    return [(label, text) for label, _, text in rows]


def build_text(split: str, data_dir: str | Path | None = None, *, max_length: int = 4096,
               val_source: str = "test", val_fraction: float = 0.1, split_seed: int = 0,
               check_counts: bool = True) -> SequenceDataset:
    """The byte-level IMDb dataset for `split` (``check_counts``: see :func:`read_imdb`)."""
    check_split(split)
    if data_dir is None:
        raise DatasetError("text (IMDb) needs data_dir: a folder with aclImdb_v1.tar.gz or the extracted aclImdb/")
    if max_length < 1:
        raise DatasetError(f"max_length must be >= 1, got {max_length}")
    if val_source not in ("test", "holdout"):
        raise DatasetError(f"val_source must be 'test' or 'holdout', got {val_source!r}")
    if split == "test" or (split == "val" and val_source == "test"):
        rows = read_imdb(data_dir, "test", check_counts)
    else:
        rows = read_imdb(data_dir, "train", check_counts)
        if val_source == "holdout":
            rows = [rows[i] for i in holdout_split(len(rows), split, val_fraction, split_seed)]
    sequences = [encode_bytes(text, max_length) for _, text in rows]
    return SequenceDataset(sequences, [label for label, _ in rows], pad_id=PAD_ID, vocab_size=VOCAB_SIZE,
                           dtype=np.uint8)
