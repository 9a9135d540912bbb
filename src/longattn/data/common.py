"""Shared pieces of the LRA data package: the error type, compact datasets, split names, file lookup."""

from __future__ import annotations

import functools
import os
import re
import stat
import tarfile
import zipfile
import zlib
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset

SPLITS = ("train", "val", "test")


class DatasetError(ValueError):
    """A dataset file or folder is missing or malformed, or a dataset option is invalid."""


# What reading a damaged archive raises: tarfile's own errors, a truncated stream (EOFError), a bad
# gzip header or CRC (gzip.BadGzipFile, an OSError), corrupted deflate data (zlib.error).
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)


_READ_ONCE: ContextVar[dict[tuple, Any] | None] = ContextVar("longattn_read_once", default=None)
Reader = TypeVar("Reader", bound=Callable[..., Any])


@contextmanager
def read_once() -> Iterator[None]:
    """Inside the block, a function marked :func:`once_per_block` reads its files once per set of arguments and
    hands the same result to later calls (the splits of one dataset built together all read its training
    files, and IMDb's train and test reviews share one archive). Outside any block every call reads
    again, so a file changed between two builds is never served stale. Nested blocks share the outer one's reads."""
    if _READ_ONCE.get() is not None:
        yield
        return
    token = _READ_ONCE.set({})
    try:
        yield
    finally:
        _READ_ONCE.reset(token)


def once_per_block(reader: Reader) -> Reader:
    """Mark a reader (hashable arguments, a result its callers never modify) as read once per :func:`read_once` block."""

    @functools.wraps(reader)
    def read(*args: Any) -> Any:
        reads = _READ_ONCE.get()
        if reads is None:
            return reader(*args)
        key = (reader.__module__, reader.__qualname__, args)
        if key not in reads:
            reads[key] = reader(*args)
        return reads[key]

    return read  # type: ignore[return-value]


def _check_link(entry: Path) -> None:
    if entry.is_symlink() and not entry.exists():
        raise DatasetError(f"{entry}: a symbolic link to {os.readlink(entry)}, which does not exist (a damaged or "
                           "partly moved copy?); restore its target or remove the link")


def check_real_entry(entry: Path, what: str) -> None:
    """Raise unless ``entry`` is a real folder (``what`` = "class folder") or a regular file (``what`` =
    "document"): a symbolic link (to another class: its documents counted twice or as a class of their own), a
    folder inside a class folder (a stray sub-folder, or one named like a document) or a FIFO, socket or device
    (reading it would hang or fail) is a :class:`DatasetError` naming it; nothing is skipped without a word."""
    _check_link(entry)
    if entry.is_symlink():
        raise DatasetError(f"{entry}: a symbolic link to {os.readlink(entry)}; class folders take real folders of "
                           "regular files only (copy the target in, e.g. cp -L)")
    mode = entry.lstat().st_mode
    if what == "class folder" and not stat.S_ISDIR(mode) or what == "document" and stat.S_ISDIR(mode):
        found = "a folder" if stat.S_ISDIR(mode) else "not a folder"
        raise DatasetError(f"{entry}: {found} where a {what} belongs (<root>/<class>/<document>, nothing deeper); "
                           "move it out of the data folder")
    if what == "document" and not stat.S_ISREG(mode):
        raise DatasetError(f"{entry}: not a regular file (a FIFO, socket or device) where a document belongs; "
                           "move it out of the data folder")


def class_folder_files(root: Path, suffixes: tuple[str, ...] | None = None) -> list[tuple[str, str, Path]]:
    """(class, file name, path) of every ``<root>/<class>/<file>`` (with one of ``suffixes``, if given), sorted.
    Regular files beside the class folders (BBC's README.TXT) are no class and are passed over, as are
    regular files without one of ``suffixes``; any other entry that is not a real class folder or document
    (a dangling or any other symbolic link, a sub-folder of a class folder, a FIFO) is a :class:`DatasetError`
    naming it (:func:`check_real_entry`): a document silently left out or counted twice would change the
    dataset without a word."""
    entries = []
    for folder in sorted(root.iterdir()):
        if stat.S_ISREG(folder.lstat().st_mode):
            continue
        check_real_entry(folder, "class folder")
        for file in sorted(folder.iterdir()):
            check_real_entry(file, "document")
            if suffixes is None or file.suffix.lower() in suffixes:
                entries.append((folder.name, file.name, file))
    return entries


def folder_contents(folder: str | Path, shown: int = 6) -> str:
    """What a data folder holds, for an error that says why nothing usable was found there: ``holds a.csv,
    b/ and 3 more``, ``is empty`` or ``does not exist``."""
    folder = Path(folder)
    if not folder.is_dir():
        return "does not exist" if not folder.exists() else "is a file, not a folder"
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in folder.iterdir())
    if not names:
        return "is empty"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"holds {', '.join(names[:shown])}{more}"


def download_command(name: str, data_dir: str | Path, unverified: bool = False) -> str:
    """The command that fetches dataset ``name`` into ``data_dir`` (``unverified``: no checksum is published)."""
    return f"longattn data download {name} --data-dir {data_dir}" + (" --allow-unverified" if unverified else "")


def no_layout_error(what: str, folder: str | Path, layouts: Sequence[str], download: str | None) -> DatasetError:
    """The error of a reader that found none of its accepted ``layouts`` in ``folder``: what the folder holds,
    what it accepts, and the command that downloads the data (None where no download exists)."""
    fetch = f"; download it with `{download}`" if download else ""
    return DatasetError(f"{what}: no usable data in {folder}, which {folder_contents(folder)}; accepted: "
                        f"{'; '.join(layouts)}{fetch}")


def read_bytes(path: Path) -> bytes:
    """The bytes of a dataset file; a dangling link or an unreadable file is a :class:`DatasetError` naming it."""
    _check_link(path)
    try:
        return path.read_bytes()
    except OSError as error:
        raise DatasetError(f"{path}: cannot read ({error.strerror or error})") from None


def check_tar_complete(tar: tarfile.TarFile, path: str | Path) -> None:
    """Raise unless ``tar`` was read to its proper end.

    tarfile stops quietly at the first unreadable header after the first member, so a corrupted
    or truncated archive would read as a shorter one. What follows the last member must be the
    zero end-of-archive blocks; reading them to the end also verifies a compressed stream's
    checksum (gzip CRC), which catches damage inside members.
    """
    tar.fileobj.seek(tar.offset)
    trailer = 0
    while chunk := tar.fileobj.read(1 << 20):
        if chunk.count(0) != len(chunk):
            raise DatasetError(f"{path}: corrupted archive: unreadable data at byte {tar.offset + trailer} "
                               "of the unpacked stream, after the last readable member")
        trailer += len(chunk)
    if trailer < 2 * tarfile.BLOCKSIZE:
        raise DatasetError(f"{path}: truncated archive: it ends without the end-of-archive marker")


def iter_tar_files(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """(member name, content) of every regular file of the tar archive ``path`` (any compression),
    then a check that the whole archive was read (:func:`check_tar_complete`); any read error, a
    truncated member or a corrupted stream is a DatasetError naming the file."""
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if member.isfile():
                    handle = tar.extractfile(member)
                    if handle is None:
                        raise DatasetError(f"{path}: cannot read member {member.name}")
                    yield member.name, handle.read()
            check_tar_complete(tar, path)
    except ARCHIVE_ERRORS as error:
        raise DatasetError(f"{path}: not a readable archive (tar), or corrupted or truncated ({error})") from error


# A class-folder tree may come as a folder or packed in any of these, whatever the archive's name.
ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")


def archive_candidates(folder: Path, hint: str = "") -> list[Path]:
    """The archives of ``folder`` (files ending in one of :data:`ARCHIVE_SUFFIXES`, any name), sorted by name,
    those whose name holds ``hint`` (e.g. ``bbc``) first, so the likely one is read before any other."""
    if not folder.is_dir():
        return []
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(ARCHIVE_SUFFIXES))
    return sorted(files, key=lambda path: hint.lower() not in path.name.lower())


def iter_zip_files(path: Path) -> Iterator[tuple[str, bytes]]:
    """(member name, content) of every file of the zip archive ``path``; a damaged one is a DatasetError."""
    try:
        with zipfile.ZipFile(path) as handle:
            for info in handle.infolist():
                if not info.is_dir():
                    yield info.filename, handle.read(info)
    except (zipfile.BadZipFile, *ARCHIVE_ERRORS) as error:
        raise DatasetError(f"{path}: not a readable archive (zip), or corrupted or truncated ({error})") from error


def iter_archive_files(path: Path) -> Iterator[tuple[str, bytes]]:
    """(member name, content) of every file of a zip or tar archive (any compression), told apart by content,
    not by the file's name (mirrors repack a ``.zip`` as ``.tar.gz`` under the same stem)."""
    return iter_zip_files(path) if zipfile.is_zipfile(path) else iter_tar_files(path)


def archive_tree(folder: Path, member: re.Pattern, hint: str = "") -> tuple[Path, list[tuple[re.Match, bytes]]] | None:
    """The first archive of ``folder`` (:func:`archive_candidates`) with members whose name ``member`` matches
    (searched, so any leading folders are allowed), and (match, content) of those members; None if none has any."""
    for archive in archive_candidates(folder, hint):
        entries = [(match, data) for name, data in iter_archive_files(archive) if (match := member.search(name))]
        if entries:
            return archive, entries
    return None


def check_count(where: str, what: str, counts: dict[str, int], expected: dict[str, int], check: bool) -> None:
    """Compare the example counts of a split (per class) with the dataset's documented counts.

    ``check=False`` accepts a deliberate subset; otherwise a difference is an error (a partial
    extraction, a damaged copy), never a run on part of the data.
    """
    if check and counts != expected:
        raise DatasetError(
            f"{where}: {what} has {sum(counts.values()):,} examples {counts}, the official dataset "
            f"{sum(expected.values()):,} {expected}; a partial or damaged copy? Fetch it again, or pass "
            "check_counts=False (--set data.options.check_counts=false) to use a deliberate subset"
        )


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split


def find_first(data_dir: str | Path, candidates: Iterable[str]) -> Path | None:
    """The first of `candidates` (paths relative to data_dir) that exists, else None."""
    root = Path(data_dir)
    for name in candidates:
        path = root / name
        if path.exists():
            return path
    return None


class Packed:
    """Variable-length integer sequences stored in one flat array plus offsets.

    Keeping 100k sequences as one array (instead of 100k tensors) keeps memory small and
    makes datasets cheap to pickle into DataLoader workers.
    """

    def __init__(self, sequences: Sequence[np.ndarray], dtype: np.dtype | type = np.int16) -> None:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        self.offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        self.flat = (np.concatenate(sequences).astype(dtype, copy=False) if len(sequences)
                     else np.zeros(0, dtype=dtype))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> torch.Tensor:
        start, end = self.offsets[index], self.offsets[index + 1]
        return torch.from_numpy(self.flat[start:end].astype(np.int64))

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _check_index(index: int, size: int) -> int:
    if index < 0:
        index += size
    if not 0 <= index < size:
        raise IndexError(f"index {index} out of range for a dataset of {size} examples")
    return index


class SequenceDataset(Dataset):
    """Single-sequence classification examples: `{"tokens": LongTensor[L], "label": int}`."""

    def __init__(self, sequences: Sequence[np.ndarray], labels: Sequence[int], *, pad_id: int,
                 vocab_size: int, dtype: np.dtype | type = np.int16) -> None:
        if len(sequences) != len(labels):
            raise DatasetError(f"{len(sequences)} sequences but {len(labels)} labels")
        self.tokens = Packed(sequences, dtype)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.pad_id = pad_id
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        index = _check_index(index, len(self))
        return {"tokens": self.tokens[index], "label": int(self.labels[index])}

    @property
    def max_len(self) -> int:
        """Length of the longest example (0 for an empty dataset)."""
        lengths = self.tokens.lengths()
        return int(lengths.max()) if len(lengths) else 0


class PairDataset(Dataset):
    """Two-sequence (dual tower) examples: `{"tokens0", "tokens1", "label"}`."""

    def __init__(self, first: Sequence[np.ndarray], second: Sequence[np.ndarray], labels: Sequence[int],
                 *, pad_id: int, vocab_size: int, dtype: np.dtype | type = np.int16) -> None:
        if not len(first) == len(second) == len(labels):
            raise DatasetError(f"{len(first)} first documents, {len(second)} second, {len(labels)} labels")
        self.tokens0 = Packed(first, dtype)
        self.tokens1 = Packed(second, dtype)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.pad_id = pad_id
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        index = _check_index(index, len(self))
        return {"tokens0": self.tokens0[index], "tokens1": self.tokens1[index],
                "label": int(self.labels[index])}

    @property
    def max_len(self) -> int:
        lengths = np.concatenate([self.tokens0.lengths(), self.tokens1.lengths()])
        return int(lengths.max()) if len(lengths) else 0


def encode_bytes(text: str | bytes, max_length: int | None) -> np.ndarray:
    """UTF-8 bytes as token ids 0..255 (byte value = id), truncated to the first max_length bytes."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    if max_length is not None:
        raw = raw[:max_length]
    return np.frombuffer(raw, dtype=np.uint8).copy()


def holdout_split(n: int, split: str, val_fraction: float, seed: int | None) -> np.ndarray:
    """Indices of `split` ("train" or "val") when a validation set is held out of n training examples.

    seed=None keeps the original order and takes the last val_fraction (like TFDS's `train[90%:]`);
    an integer seed holds out a seeded random subset (for sources whose file order is grouped by class).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DatasetError(f"val_fraction must be in (0, 1), got {val_fraction}")
    num_val = int(round(n * val_fraction))
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    chosen = order[n - num_val:] if split == "val" else order[: n - num_val]
    return np.sort(chosen)


def pad_sequences(sequences: Sequence[torch.Tensor], pad_id: int, pad_to: int | None = None, key: str = "tokens"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D integer tensors into a LongTensor [B, N] and its bool mask (True = real token).

    pad_to fixes N (an error naming `key` if an item is longer); otherwise N is the longest item.
    """
    lengths = [len(s) for s in sequences]
    width = max(lengths, default=0)
    if pad_to is not None:
        if width > pad_to:
            raise DatasetError(f"collate: an item's {key!r} has {width} tokens, more than pad_to={pad_to}")
        width = pad_to
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = True
    return tokens, mask


def stratified_folds(labels: Sequence, num_folds: int = 5, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Deterministic (train indices, validation indices) of each fold, by scikit-learn's shuffled
    StratifiedKFold (KFold for multi-label indicator rows, which StratifiedKFold does not support)."""
    from sklearn.model_selection import KFold, StratifiedKFold  # imported here: scikit-learn is slow to import

    labels = np.asarray(labels)
    if num_folds < 2 or num_folds > len(labels):
        raise DatasetError(f"num_folds must be in [2, {len(labels)}], got {num_folds}")
    if labels.ndim == 2:
        splitter = KFold(num_folds, shuffle=True, random_state=seed)
    else:
        counts = Counter(labels.tolist())
        if max(counts.values()) < num_folds:
            raise DatasetError(f"no class has {num_folds} documents: cannot stratify into {num_folds} folds")
        splitter = StratifiedKFold(num_folds, shuffle=True, random_state=seed)
    return [(np.sort(train), np.sort(val)) for train, val in splitter.split(np.zeros(len(labels)), labels)]


def holdout_test(labels: Sequence, test_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices): a seeded stratified holdout (scikit-learn's train_test_split) for
    datasets without an official test set; classes with a single document stay in train."""
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise DatasetError(f"test_fraction must be in (0, 1), got {test_fraction}")
    labels = np.asarray(labels)
    counts = Counter(labels.tolist())
    several = np.array([counts[label] > 1 for label in labels.tolist()])
    index = np.flatnonzero(several)
    train, test = train_test_split(index, test_size=test_fraction, random_state=seed, stratify=labels[index])
    return np.sort(np.concatenate([train, np.flatnonzero(~several)])), np.sort(test)
