"""GLUE (Wang et al. 2018) from the official ``glue_data/`` layout, for SKTformer / S^3 Table 3.

The eight tasks the papers use (WNLI is excluded, as BERT and the papers do):

    from longattn.data.glue import get_glue_task, build_glue, collate_glue

    task = get_glue_task("mrpc")     # GlueTask: file columns, label names, metric names
    ds = build_glue("mrpc", "dev", data_dir="glue_data")   # or the glue_data/MRPC folder itself
    batch = collate_glue([ds[0], ds[1]], pad_id=ds.pad_id)
    # {"input_ids": Long[B, N], "token_type_ids": Long[B, N], "attention_mask": bool[B, N], "labels": [B]}

Files are read by their header names (column orders differ between train/dev and test files); CoLA's
train/dev files have no header and four columns (source, label, original judgement, sentence). Every row
must have as many tab-separated fields as the header (no quoting: quotes are text); a short or long row,
an unknown label, a score that is not a number in 0..5, a header that names a column twice, or a train/dev
file without its label column raises ``DatasetError`` naming the file, line and column. MRPC's files
start with a UTF-8 byte-order mark (skipped); its train/dev split is made from ``msr_paraphrase_*.txt``
and ``dev_ids.tsv`` exactly as GLUE's download script does (``write_mrpc_splits``).

Text goes through MiniLM's uncased WordPiece tokenizer (``data/wordpiece.py``): ``[CLS] a [SEP] b [SEP]``
with token type ids 0/1, at most ``max_length=128`` tokens. Test files have no labels: their items have
no ``"label"`` and their batches no ``"labels"``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..registry import Registry
from . import wordpiece
from .common import DatasetError, Packed, download_command, no_layout_error, pad_sequences

MAX_LENGTH = 128  # SKTformer / S^3 Table 15 fine-tuning length, as BERT's GLUE runs
COLA_COLUMNS = ("source", "label", "original_label", "sentence")  # CoLA train/dev: no header


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its files are and how to read and score them (cf. run_glue's task_to_keys)."""

    name: str
    folder: str  # the task's folder in glue_data/
    text_columns: tuple[str, ...]  # header names of the one or two sentences
    label_column: str
    label_names: tuple[str, ...] | None  # label strings in id order; None: regression (STS-B)
    metrics: tuple[str, ...]  # longattn.metrics names, the official ones
    paper_metric: str  # the one SKTformer / S^3 Table 3 reports
    splits: tuple[str, ...] = ("train", "dev", "test")
    headerless: bool = False  # CoLA's train/dev files

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        """Outputs of the classifier head: the number of classes, or 1 for regression."""
        return 1 if self.label_names is None else len(self.label_names)

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2


GLUE_TASKS: Registry[GlueTask] = Registry("GLUE task", error=DatasetError)
_BINARY = ("0", "1")
_ACC_F1 = ("accuracy", "f1", "acc_and_f1")
_NLI2 = ("entailment", "not_entailment")
for _task in (
    GlueTask("cola", "CoLA", ("sentence",), "label", _BINARY, ("mcc",), "mcc", headerless=True),
    GlueTask("sst2", "SST-2", ("sentence",), "label", _BINARY, ("accuracy",), "accuracy"),
    GlueTask("mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", _BINARY, _ACC_F1, "acc_and_f1"),
    GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), "score", None,
             ("pearson", "spearman", "pearson_and_spearman"), "spearman"),
    GlueTask("qqp", "QQP", ("question1", "question2"), "is_duplicate", _BINARY, _ACC_F1, "acc_and_f1"),
    GlueTask("mnli", "MNLI", ("sentence1", "sentence2"), "gold_label", ("contradiction", "entailment", "neutral"),
             ("accuracy",), "accuracy",
             splits=("train", "dev_matched", "dev_mismatched", "test_matched", "test_mismatched")),
    GlueTask("qnli", "QNLI", ("question", "sentence"), "label", _NLI2, ("accuracy",), "accuracy"),
    GlueTask("rte", "RTE", ("sentence1", "sentence2"), "label", _NLI2, ("accuracy",), "accuracy"),
):
    GLUE_TASKS.register(_task.name, _task)

_SPLIT_ALIASES = {"val": "dev", "validation": "dev"}


def get_glue_task(name: str) -> GlueTask:
    """The task `name` (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte); WNLI is not supported."""
    if name == "wnli":
        raise DatasetError("WNLI is excluded, as in BERT and SKTformer / S^3 Table 3")
    return GLUE_TASKS.get(name)


def split_file(task: GlueTask, split: str) -> str:
    """File name of `split`; "val"/"dev" mean MNLI's dev_matched and "test" its test_matched."""
    split = _SPLIT_ALIASES.get(split, split)
    if task.name == "mnli" and split in ("dev", "test"):
        split += "_matched"  # the papers report MNLI matched
    if split not in task.splits:
        raise DatasetError(f"GLUE {task.name} has no split {split!r}; expected one of {', '.join(task.splits)}")
    return f"{split}.tsv"


def find_split(task: GlueTask, split: str, data_dir: str | Path) -> Path:
    """The file of `split` in `data_dir`: the glue_data/ root (with <Task>/ inside) or the task folder."""
    name = split_file(task, split)
    root = Path(data_dir)
    for candidate in (root / task.folder / name, root / name):
        if candidate.is_file():
            return candidate
    raise no_layout_error(f"GLUE {task.name}: no {name} in {root / task.folder} or {root}", root,
                          [f"the official glue_data/ root holding {task.folder}/{name}",
                           f"the {task.folder}/ folder itself holding {name}"], download_command("glue", root))


@dataclass
class GlueSplit:
    """The raw examples of one split: texts, labels (None for test files) and where they came from."""

    task: GlueTask
    path: Path
    first: list[str]
    second: list[str] | None
    labels: np.ndarray | None  # int64 class ids, or float32 scores for STS-B

    def __len__(self) -> int:
        return len(self.first)


def _rows(path: Path):
    """(line number, fields) of a tab-separated UTF-8 file, split on \\n only (fields may hold \\r or quotes)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # MRPC's byte-order mark
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DatasetError(f"{path}:{number}: not UTF-8 ({error.reason} at byte {error.start})") from None
            yield number, line.rstrip("\n").removesuffix("\r").split("\t")


STSB_RANGE = (0.0, 5.0)  # STS-B similarity scores (Cer et al. 2017): 0 (unrelated) to 5 (equivalent)


def _parse_label(task: GlueTask, value: str, where: str) -> float | int:
    if task.label_names is None:
        try:
            score = float(value)
        except ValueError:
            raise DatasetError(f"{where}: score {value!r} is not a number") from None
        low, high = STSB_RANGE
        if not low <= score <= high:  # NaN and inf fail this too
            raise DatasetError(f"{where}: score {value!r} lies outside {low:g}..{high:g}, the range of "
                               f"{task.name} similarity scores")
        return score
    try:
        return task.label_names.index(value.strip())
    except ValueError:
        raise DatasetError(f"{where}: unknown label {value!r} for {task.name}; "
                           f"expected one of {', '.join(task.label_names)}") from None


def read_glue(task: str | GlueTask, split: str, data_dir: str | Path) -> GlueSplit:
    """Read `split` of `task` from the official layout (see the module docstring)."""
    task = get_glue_task(task) if isinstance(task, str) else task
    path = find_split(task, split, data_dir)
    rows = _rows(path)
    if task.headerless and not path.name.startswith("test"):
        header = list(COLA_COLUMNS)
    else:
        first_row = next(rows, None)
        if first_row is None:
            raise DatasetError(f"{path}: empty file (expected a header line)")
        header = first_row[1]
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise DatasetError(f"{path}:1: header names column(s) {', '.join(map(repr, repeated))} more than once "
                           f"({', '.join(header)}); which one holds the data is ambiguous")
    missing = [c for c in task.text_columns if c not in header]
    labelled = not path.name.startswith("test")  # train and dev files carry labels, test files do not
    if labelled and task.label_column not in header:
        missing.append(task.label_column)
    if missing:
        raise DatasetError(f"{path}:1: header has no column {', '.join(map(repr, missing))} "
                           f"(found {', '.join(header)}); is this the {task.name} file"
                           f"{' (a ' + path.stem + ' file needs its labels)' if task.label_column in missing else ''}?")
    text_index = [header.index(c) for c in task.text_columns]
    label_index = header.index(task.label_column) if task.label_column in header else None
    first, second, labels = [], [], []
    for number, fields in rows:
        where = f"{path}:{number}"
        if len(fields) != len(header):
            raise DatasetError(f"{where}: expected {len(header)} tab-separated columns "
                               f"({', '.join(header)}), found {len(fields)}")
        first.append(fields[text_index[0]])
        if task.is_pair:
            second.append(fields[text_index[1]])
        if label_index is not None:
            labels.append(_parse_label(task, fields[label_index], where))
    if not first:
        raise DatasetError(f"{path}: no examples")
    label_array = None
    if label_index is not None:
        label_array = np.asarray(labels, dtype=np.float32 if task.is_regression else np.int64)
    return GlueSplit(task, path, first, second if task.is_pair else None, label_array)


class GlueDataset(Dataset):
    """Tokenised GLUE examples: ``{"input_ids", "token_type_ids": LongTensor[L], "label"?: int | float}``."""

    def __init__(self, examples: GlueSplit, tokenizer=None, max_length: int = MAX_LENGTH) -> None:
        tokenizer = tokenizer if tokenizer is not None else wordpiece.load_wordpiece()
        ids, types = wordpiece.encode(tokenizer, examples.first, examples.second, max_length=max_length)
        self.task = examples.task
        self.input_ids = Packed(ids, np.int32)
        self.token_type_ids = Packed(types, np.int8)
        self.labels = examples.labels
        self.pad_id = wordpiece.special_id(tokenizer, "[PAD]")
        self.vocab_size = tokenizer.get_vocab_size()
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> np.ndarray:
        """WordPieces per example (what ``train.group_by_length`` sorts by)."""
        return self.input_ids.lengths()

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} examples")
        index %= len(self)
        item = {"input_ids": self.input_ids[index], "token_type_ids": self.token_type_ids[index]}
        if self.labels is not None:
            item["label"] = self.labels[index].item()
        return item


def build_glue(task: str, split: str, data_dir: str | Path, *, tokenizer=None,
               max_length: int = MAX_LENGTH) -> GlueDataset:
    """Read and tokenise `split` of `task`; `tokenizer` defaults to MiniLM's uncased WordPiece."""
    return GlueDataset(read_glue(task, split, data_dir), tokenizer, max_length)


def collate_glue(items: Sequence[dict], pad_id: int = 0, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch with Hugging Face's key names: input_ids, token_type_ids, attention_mask (bool,
    True = real token) and labels (long class ids, float scores for STS-B; absent for test items)."""
    if not items:
        raise DatasetError("collate: empty batch")
    input_ids, mask = pad_sequences([item["input_ids"] for item in items], pad_id, pad_to, "input_ids")
    token_type_ids, _ = pad_sequences([item["token_type_ids"] for item in items], 0, pad_to, "token_type_ids")
    batch = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": mask}
    labelled = ["label" in item for item in items]
    if any(labelled):
        if not all(labelled):
            raise DatasetError("collate: some items have a label and some do not")
        labels = [item["label"] for item in items]
        dtype = torch.float32 if isinstance(labels[0], float) else torch.long
        batch["labels"] = torch.tensor(labels, dtype=dtype)
    return batch


# ----------------------------------------------------------------------------- MRPC and downloads

MRPC_HEADER = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"  # as in msr_paraphrase_*.txt, BOM kept
MRPC_TEST_HEADER = "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n"


def _msr_rows(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise DatasetError(f"MRPC: missing {path}")
    rows = []
    for number, fields in _rows(path):
        if number == 1:
            continue  # header
        fields = "\t".join(fields).strip().split("\t")
        if len(fields) != 5:
            raise DatasetError(f"{path}:{number}: expected 5 tab-separated columns "
                               f"(Quality, #1 ID, #2 ID, #1 String, #2 String), found {len(fields)}")
        rows.append(fields)
    return rows


def write_mrpc_splits(folder: str | Path) -> None:
    """Write GLUE's MRPC train.tsv / dev.tsv / test.tsv from msr_paraphrase_{train,test}.txt and
    dev_ids.tsv in `folder`, as GLUE's download script makes them: pairs listed in dev_ids.tsv go to dev,
    the other training pairs to train (both under the source header), the test file is re-indexed."""
    folder = Path(folder)
    ids_file = folder / "dev_ids.tsv"
    if not ids_file.is_file():
        raise DatasetError(f"MRPC: missing {ids_file}")
    dev_ids = set()
    for number, fields in _rows(ids_file):
        if len(fields) != 2:
            raise DatasetError(f"{ids_file}:{number}: expected 2 tab-separated ids, found {len(fields)}")
        dev_ids.add(tuple(fields))
    train_rows = _msr_rows(folder / "msr_paraphrase_train.txt")
    test_rows = _msr_rows(folder / "msr_paraphrase_test.txt")
    outputs = {"train.tsv": [MRPC_HEADER], "dev.tsv": [MRPC_HEADER], "test.tsv": [MRPC_TEST_HEADER]}
    for row in train_rows:
        outputs["dev.tsv" if (row[1], row[2]) in dev_ids else "train.tsv"].append("\t".join(row) + "\n")
    for index, row in enumerate(test_rows):
        outputs["test.tsv"].append("\t".join([str(index)] + row[1:]) + "\n")
    for name, lines in outputs.items():
        (folder / name).write_text("".join(lines), encoding="utf-8", newline="")


def download_glue(dest: str | Path, tasks: Sequence[str] | None = None, *, base_url: str | None = None,
                  progress: bool = True, allow_unverified: bool = False) -> Path:
    """Fetch the official files of `tasks` (default: all eight) into `dest` as glue_data/<Task>/ folders.

    Each file is checksum-verified by ``data.download`` (QQP's re-released archive has no published
    checksum: it needs allow_unverified=True). Returns dest.
    """
    from .download import download

    dest = Path(dest)
    for name in tasks if tasks is not None else GLUE_TASKS.names():
        task = get_glue_task(name)
        if task.name == "mrpc":
            for part in ("glue_mrpc_train", "glue_mrpc_test", "glue_mrpc_dev_ids"):
                download(part, dest / task.folder, base_url=base_url, progress=progress)
            write_mrpc_splits(dest / task.folder)
        else:
            download(f"glue_{task.name}", dest, base_url=base_url, progress=progress,
                     allow_unverified=allow_unverified)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longattn.data.glue",
                                     description="Download GLUE into the official glue_data/ layout.")
    parser.add_argument("command", choices=["download"])
    parser.add_argument("dest")
    parser.add_argument("--tasks", nargs="+", choices=GLUE_TASKS.names(), default=None)
    parser.add_argument("--base-url", default=None, help="mirror folder URL (file names are appended)")
    parser.add_argument("--allow-unverified", action="store_true", help="needed for QQP (no published checksum)")
    args = parser.parse_args(argv)
    try:
        print(download_glue(args.dest, args.tasks, base_url=args.base_url, allow_unverified=args.allow_unverified))
    except DatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
