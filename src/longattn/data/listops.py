"""ListOps (Nangia & Bowman 2018) as the Long Range Arena generates it, and LRA's official tsv files.

The generator follows LRA's `lra_benchmarks/data/listops.py` (re-implemented, not copied): a node is a
digit with probability 0.75 (always at the maximum depth), otherwise one of the operators MAX, MIN, MED,
SUM_MOD applied to 2..max_args random sub-trees. A tree's *length* counts operator, digit and closing-
bracket tokens (not parentheses), and only trees with min_length <= length <= max_length are kept.
LRA's defaults: max_depth 10, max_args 10, lengths 500..2000, 96k/2k/2k examples, labels 0..9.

The tsv format (`basic_{train,val,test}.tsv`): a header `Source<TAB>Target`, then one example a line;
Source is LRA's bracketed string, e.g. `( ( ( [MAX 2 ) 9 ) ] )` for `[MAX 2 9 ]`: every operator
application is written as nested pairs, so parentheses make up about half of the raw tokens.
"""

from __future__ import annotations

import csv
import io
import random
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .common import DatasetError, SequenceDataset, check_split, download_command, find_first, no_layout_error

MAX, MIN, MED, SUM_MOD, END = "[MAX", "[MIN", "[MED", "[SM", "]"
OPERATORS = (MAX, MIN, MED, SUM_MOD)
VALUE_PROBABILITY = 0.75  # LRA: a node is a digit unless random() <= 0.25

# Fixed vocabulary: id = position. Parentheses have ids even when they are dropped, so the vocabulary
# does not depend on tokenisation options; the padding id comes last and never occurs in the data.
VOCAB: tuple[str, ...] = tuple(str(d) for d in range(10)) + OPERATORS + (END, "(", ")")
TOKEN_TO_ID = {token: index for index, token in enumerate(VOCAB)}
PAD_ID = len(VOCAB)
VOCAB_SIZE = len(VOCAB) + 1
NUM_CLASSES = 10
PAREN_IDS = (TOKEN_TO_ID["("], TOKEN_TO_ID[")"])
_DIGITS = VOCAB[:10]

LRA_SPLIT_SIZES = {"train": 96_000, "val": 2_000, "test": 2_000}
# Distinct default seed streams per split, so independently built splits do not share examples.
_SPLIT_STREAM = {"train": 0, "val": 1, "test": 2}


class _TooLong(Exception):
    """Raised while growing a tree that already exceeds max_length (it would be rejected anyway)."""


def _apply(op: str, args: Sequence[int]) -> int:
    if op == MAX:
        return max(args)
    if op == MIN:
        return min(args)
    if op == MED:  # LRA: int(np.median(args)); the mean of the middle pair is truncated
        ordered = sorted(args)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) // 2
    return sum(args) % 10


def _grow(draw: Callable[[], float], depth: int, max_depth: int, max_args: int, budget: list[int],
          tokens: list[str]) -> int:
    """Append one random sub-tree's bracketed tokens to `tokens`; return its value.

    `draw` is a uniform [0, 1) source. budget[0] counts the remaining length allowed; running out
    aborts the tree early. Aborting only trees that are certain to be rejected leaves the
    distribution of accepted trees unchanged.
    """
    if depth >= max_depth or draw() < VALUE_PROBABILITY:
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooLong
        value = int(draw() * 10)
        tokens.append(_DIGITS[value])
        return value
    num_args = 2 + int(draw() * (max_args - 1))
    budget[0] -= 2  # operator and closing bracket
    if budget[0] < 0:
        raise _TooLong
    # LRA draws the operator after the arguments; drawing it first has the same distribution and
    # lets the tokens be written in order. LRA nests ((op, v0), v1), ..., END) and writes every
    # pair as "( left right )", hence num_args + 1 opening parentheses.
    op = OPERATORS[int(draw() * 4)]
    tokens.extend(["("] * (num_args + 1))
    tokens.append(op)
    values = []
    for _ in range(num_args):
        values.append(_grow(draw, depth + 1, max_depth, max_args, budget, tokens))
        tokens.append(")")
    tokens.append(END)
    tokens.append(")")
    return _apply(op, values)


def generate_listops(num_examples: int, *, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
                     max_args: int = 10, seed: int = 0, max_attempts: int | None = None
                     ) -> list[tuple[str, int]]:
    """`num_examples` distinct (Source string, label) pairs with min_length <= length <= max_length.

    Deterministic in `seed`. Raises DatasetError when the bounds are so narrow that `max_attempts`
    trees (default 2000 per requested example) yield too few examples.
    """
    if num_examples < 0:
        raise DatasetError(f"num_examples must be >= 0, got {num_examples}")
    if not 1 <= min_length <= max_length:
        raise DatasetError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    if max_depth < 1 or max_args < 2:
        raise DatasetError(f"need max_depth >= 1 and max_args >= 2, got {max_depth}, {max_args}")
    rng = random.Random(seed)
    attempts_left = max_attempts if max_attempts is not None else 2000 * max(num_examples, 1)
    seen: set[str] = set()
    examples: list[tuple[str, int]] = []
    while len(examples) < num_examples:
        if attempts_left <= 0:
            raise DatasetError(f"generated only {len(examples)} of {num_examples} ListOps examples with "
                               f"lengths in [{min_length}, {max_length}]; widen the bounds or raise max_attempts")
        attempts_left -= 1
        tokens: list[str] = []
        budget = [max_length]
        try:
            value = _grow(rng.random, 1, max_depth, max_args, budget, tokens)
        except _TooLong:
            continue
        if max_length - budget[0] < min_length:
            continue
        source = " ".join(tokens)
        if source in seen:  # LRA keeps a set of trees: no duplicates
            continue
        seen.add(source)
        examples.append((source, value))
    return examples


def evaluate_source(source: str) -> int:
    """The value of a ListOps Source string (with or without parentheses); a check on labels."""
    stack: list[list] = []
    result: int | None = None
    for token in source.split():
        if token in ("(", ")"):
            continue
        if token in OPERATORS:
            stack.append([token])
        elif token == END:
            if not stack or len(stack[-1]) < 2:
                raise DatasetError(f"unbalanced ListOps expression: {source[:80]!r}")
            op, *args = stack.pop()
            value = _apply(op, args)
            if stack:
                stack[-1].append(value)
            else:
                result = value
        elif token in TOKEN_TO_ID:
            if stack:
                stack[-1].append(int(token))
            else:
                result = int(token)
        else:
            raise DatasetError(f"unknown ListOps token {token!r}")
    if stack or result is None:
        raise DatasetError(f"incomplete ListOps expression: {source[:80]!r}")
    return result


def tokenize(source: str, *, keep_parens: bool = False, where: str = "") -> np.ndarray:
    """Token ids of a Source string. Parentheses are dropped by default (see docs/data.md)."""
    ids = []
    for token in source.split():
        token_id = TOKEN_TO_ID.get(token)
        if token_id is None:
            raise DatasetError(f"{where}unknown ListOps token {token!r}; vocabulary: {' '.join(VOCAB)}")
        if keep_parens or token_id not in PAREN_IDS:
            ids.append(token_id)
    return np.asarray(ids, dtype=np.int16)


def write_tsv(examples: Sequence[tuple[str, int]], path: str | Path) -> None:
    """Write examples in LRA's tsv format (header Source, Target); written to a temp file then renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
        writer.writerow(["Source", "Target"])
        for source, label in examples:
            writer.writerow([source, label])
    tmp.replace(path)


def read_tsv(path: str | Path) -> list[tuple[str, int]]:
    """(Source, label) rows of an LRA ListOps tsv file, validated."""
    return [(source, label) for _, source, label in _read_rows(path)]


def _read_rows(path: str | Path) -> list[tuple[int, str, int]]:
    """(line number in the file, Source, label) of every example of a ListOps tsv file (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"ListOps file not found: {path}")
    rows = []
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 ({error.reason} at byte {error.start})") from None
    with io.StringIO(text, newline="") as handle:
        reader = csv.reader(handle, delimiter="\t")
        start = 1  # the line the next row starts on
        try:
            header = next(reader, None)
            if header is None or [h.strip() for h in header[:2]] != ["Source", "Target"]:
                raise DatasetError(f"{path}: expected the header 'Source<TAB>Target', got {header!r}")
            start = reader.line_num + 1
            for row in reader:
                line, start = start, reader.line_num + 1
                if not row:
                    continue
                if len(row) != 2:
                    raise DatasetError(f"{path}:{line}: expected 2 tab-separated columns, got {len(row)}")
                try:
                    label = int(float(row[1]))
                except ValueError:
                    raise DatasetError(f"{path}:{line}: Target {row[1]!r} is not a number") from None
                if not 0 <= label < NUM_CLASSES or float(row[1]) != label:
                    raise DatasetError(f"{path}:{line}: Target {row[1]!r} is not a digit 0..9")
                rows.append((line, row[0], label))
        except csv.Error as error:
            raise DatasetError(f"{path}:{start}: malformed tsv ({error})") from None
    return rows


# The folders of data_dir that may hold the tsv files: itself, LRA's listops-1000/, and the unpacked release
# (lra_release.gz nests a second lra_release/ folder, which LRA's own dataset_setup.sh reads).
TSV_FOLDERS = ("", "listops-1000/", "lra_release/listops-1000/", "lra_release/lra_release/listops-1000/")
LAYOUTS = ("basic_{train,val,test}.tsv (header Source<TAB>Target) in the folder or in its listops-1000/",
           "the unpacked LRA release: lra_release/listops-1000/ or lra_release/lra_release/listops-1000/",
           "no data folder (data.data_dir unset, no --data-dir): the examples are generated")


def tsv_path(data_dir: str | Path, split: str) -> Path | None:
    """The official file for `split` in the first of :data:`TSV_FOLDERS` of data_dir that holds it."""
    name = f"basic_{check_split(split)}.tsv"
    return find_first(data_dir, [folder + name for folder in TSV_FOLDERS])


def _no_tsv_error(what: str, data_dir: str | Path) -> DatasetError:
    return no_layout_error(what, data_dir, LAYOUTS, download_command("lra_release", data_dir, unverified=True))


def has_tsv(data_dir: str | Path | None) -> bool:
    return data_dir is not None and any(tsv_path(data_dir, split) is not None for split in LRA_SPLIT_SIZES)


def load_listops(data_dir: str | Path, split: str, *, keep_parens: bool = False) -> SequenceDataset:
    """The official `basic_<split>.tsv` as a dataset of token ids."""
    path = tsv_path(data_dir, split)
    if path is None:
        raise _no_tsv_error(f"ListOps: no basic_{split}.tsv", data_dir)
    rows = _read_rows(path)
    # the line of the file, blank lines counted: an error names the line an editor shows
    sequences = [tokenize(source, keep_parens=keep_parens, where=f"{path}:{line}: ") for line, source, _ in rows]
    return SequenceDataset(sequences, [label for _, _, label in rows], pad_id=PAD_ID, vocab_size=VOCAB_SIZE)


def build_listops(split: str, data_dir: str | Path | None = None, *, num_examples: int | None = None,
                  min_length: int | None = None, max_length: int | None = None, max_depth: int | None = None,
                  max_args: int | None = None, seed: int | None = None, keep_parens: bool = False
                  ) -> SequenceDataset:
    """Load `split` from LRA's tsv files in data_dir, or generate it when data_dir is None.

    A data_dir without the files is an error naming the layouts, never generated data in place of the
    files asked for. Generator options left as None take LRA's values (500..2000 tokens, depth 10, 10
    arguments, the LRA split size, seed 0); passing one while data_dir holds tsv files is an error, not
    ignored. Generated splits use the seed stream (seed, split), so each split is reproducible on its own.
    """
    check_split(split)
    generator_options = dict(num_examples=num_examples, min_length=min_length, max_length=max_length,
                             max_depth=max_depth, max_args=max_args, seed=seed)
    if data_dir is not None:
        if not has_tsv(data_dir):
            raise _no_tsv_error("ListOps", data_dir)
        given = sorted(name for name, value in generator_options.items() if value is not None)
        if given:
            raise DatasetError(f"ListOps: generator options {given} do not apply to the tsv files in {data_dir}")
        return load_listops(data_dir, split, keep_parens=keep_parens)
    count = LRA_SPLIT_SIZES[split] if num_examples is None else num_examples
    stream_seed = (seed or 0) * 3 + _SPLIT_STREAM[split]
    examples = generate_listops(count, min_length=500 if min_length is None else min_length,
                                max_length=2000 if max_length is None else max_length,
                                max_depth=10 if max_depth is None else max_depth,
                                max_args=10 if max_args is None else max_args, seed=stream_seed)
    sequences = [tokenize(source, keep_parens=keep_parens) for source, _ in examples]
    return SequenceDataset(sequences, [label for _, label in examples], pad_id=PAD_ID, vocab_size=VOCAB_SIZE)


def write_listops_splits(out_dir: str | Path, *, sizes: dict[str, int] | None = None, seed: int = 0,
                         **generator_options) -> dict[str, Path]:
    """Generate the three splits and write them as `basic_{train,val,test}.tsv` (LRA's format)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, default_size in LRA_SPLIT_SIZES.items():
        count = (sizes or {}).get(split, default_size)
        examples = generate_listops(count, seed=seed * 3 + _SPLIT_STREAM[split], **generator_options)
        paths[split] = out / f"basic_{split}.tsv"
        write_tsv(examples, paths[split])
    return paths
