"""Document classification datasets of Singularformer (IJCAI 2023) section 4, from their public formats.

    from longattn.data.textcls import build_textcls, collate_textcls, stratified_folds

    train = build_textcls("r8", "train", data_dir, fold=0)   # folds 1-4 of a 5-fold split of the training set
    val = build_textcls("r8", "val", data_dir, fold=0)       # fold 0
    test = build_textcls("r8", "test", data_dir)             # the test set
    batch = collate_textcls([train[0], train[1]], pad_id=train.pad_id)
    # {"tokens": Long[B, N], "attention_mask": bool[B, N], "label": Long[B] (Float[B, C] when multi-label)}

| name | format in data_dir | classes | max_length (paper) | tokens (default) |
|---|---|---|---|---|
| r8 | `R8/{train,test}.txt`: `label<TAB>text` a line | 8 | 141 | words (whitespace) |
| bbc | `bbc/<class>/<nnn>.txt` (a folder, or any .zip / .tar / .tar.gz / .tgz) | 5 | 664 | words (regex) |
| 20news | `20news-bydate-{train,test}/<group>/<id>` (folders or any archive) | 20 | 700 | words (regex) |
| imdb | the IMDb archive or `aclImdb/` (read by data/text.py) | 2 | 539 | words (regex) |
| mimic3_50 | CAML's `{train,dev,test}_50.csv` (`HADM_ID`, `TEXT`, `LABELS` a;b;c) | 50, multi-label | 1024 | words (whitespace) |
| scope95 / scope40 | ASTRAL SCOPe FASTA `*-95-*.fa` / `*-40-*.fa` | folds (`a.1`) | 328 / 337 | amino acids |

The maximum lengths are the paper's ("141, 664, 700, 539, 1024, 328, 337, 256 on R8, BBC, 20NG, IMDb,
MIMIC-III 50, SCoPe95, SCoPe40, CIFAR 100"; CIFAR-100 is in data/image.py); longer documents keep their
first max_length tokens. Rules (see docs/data.md): files are UTF-8, and a file that is not valid UTF-8
is read as Latin-1 where the format has such files (BBC, 20 Newsgroups); an empty document raises an
error naming its file and line unless ``skip_empty=True`` drops it; a label of a test or validation
document that the training set does not have raises an error naming where it is.
"""

from __future__ import annotations

import codecs
import csv
import io
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..registry import Registry
from . import wordpiece
from .common import (
    DatasetError,
    Packed,
    archive_tree,
    check_split,
    class_folder_files,
    download_command,
    holdout_test,
    no_layout_error,
    once_per_block,
    pad_sequences,
    read_bytes,
    stratified_folds,
)

PAD_ID, UNK_ID = 0, 1  # word and amino-acid vocabularies; MiniLM's WordPiece has its own [PAD] = 0
TOKENIZERS = ("word", "wordpiece", "char")
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWYXBZUO"  # the 20 standard residues, unknown X, ambiguous B/Z, U, O
# The authors' public code lower-cases and keeps words and these punctuation marks as tokens.
WORD_PATTERN = re.compile(r"[a-z0-9]+|[,;.!?()'\"]")
WHITESPACE_PATTERN = re.compile(r"\S+")  # R8 and MIMIC-III come already tokenised


@dataclass
class Corpus:
    """Raw documents of one subset: texts, label names (a tuple of names per document when multi-label)
    and, per document, where it came from (``file`` or ``file:line``) for error messages."""

    texts: list[str] = field(default_factory=list)
    labels: list = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    latin1_files: int = 0  # files that were not UTF-8 and were read as Latin-1

    def add(self, text: str, label, source: str) -> None:
        self.texts.append(text)
        self.labels.append(label)
        self.sources.append(source)

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class TextClsSpec:
    """One dataset: its reader, the paper's maximum length and how it is tokenised by default."""

    name: str
    max_length: int
    reader: Callable[[Path, str], Corpus]  # (data_dir, "train" | "test" | "dev") -> Corpus
    tokenizer: str = "word"
    word_pattern: re.Pattern = WORD_PATTERN
    multilabel: bool = False
    official_test: bool = True  # False: the test split is a seeded stratified holdout of the documents
    official_dev: bool = False  # MIMIC-III has a dev file


TEXTCLS_DATASETS: Registry[TextClsSpec] = Registry("text classification dataset", error=DatasetError)


# ----------------------------------------------------------------------------- decoding and readers

# Byte-order marks, longest first (UTF-32 LE starts as UTF-16 LE does), and the codec that reads past them.
BYTE_ORDER_MARKS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
                    (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _marked_encoding(data: bytes, where: str) -> str | None:
    """The codec of a file that starts with a byte-order mark; None without one. NUL bytes in a file without a
    mark (UTF-16 or UTF-32 without its mark, or a binary file) are a :class:`DatasetError`: the Latin-1 fallback
    would turn them into text of garbage."""
    for mark, codec in BYTE_ORDER_MARKS:
        if data.startswith(mark):
            return codec
    if b"\0" in data:
        offset = data.index(b"\0")
        line = data[:offset].count(b"\n") + 1
        raise DatasetError(f"{where}:{line}: a NUL byte at byte {offset} in a file without a byte-order mark (UTF-16 "
                           "without its mark, or not a text file?); save it as UTF-8")
    return None


def decode(data: bytes, where: str, latin1_fallback: bool) -> tuple[str, bool]:
    """UTF-8 text of a file, or the UTF-8, UTF-16 or UTF-32 its byte-order mark names; with latin1_fallback a
    file without a mark that is not UTF-8 is read as Latin-1 (every byte is a character there), returning
    (text, whether the fallback was used). NUL bytes without a mark are refused (:func:`_marked_encoding`)."""
    codec = _marked_encoding(data, where)
    if codec is not None:
        try:
            return data.decode(codec), False
        except UnicodeDecodeError as error:
            raise DatasetError(f"{where}: starts with the byte-order mark of {codec} but is not {codec} "
                               f"({error.reason} at byte {error.start})") from None
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError as error:
        if latin1_fallback:
            return data.decode("latin-1"), True
        line = data[: error.start].count(b"\n") + 1
        raise DatasetError(f"{where}:{line}: not UTF-8 ({error.reason} at byte {error.start})") from None


def _find(data_dir: Path, names: Sequence[str], what: str, download: str | None) -> Path:
    for name in names:
        if (data_dir / name).exists():
            return data_dir / name
    raise no_layout_error(what, data_dir, names, download)


def read_r8(data_dir: Path, subset: str) -> Corpus:
    """R8 as distributed with the Text GCN code: `label<TAB>text` per line."""
    path = _find(data_dir, [f"{subset}.txt", f"R8/{subset}.txt"], f"R8 {subset}",
                 download_command("r8", data_dir.parent if data_dir.name == "R8" else data_dir))
    text = decode(path.read_bytes(), str(path), latin1_fallback=False)[0]
    corpus = Corpus()
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line and number == text.count("\n") + 1:
            continue  # the final newline
        label, tab, document = line.partition("\t")
        if not tab or not label.strip():
            raise DatasetError(f"{path}:{number}: expected 'label<TAB>text'")
        corpus.add(document, label.strip(), f"{path}:{number}")
    return corpus


def _folder_documents(root: Path, where: str) -> list[tuple[str, str, bytes]]:
    """(class, file name, bytes) of every `<root>/<class>/<file>`, sorted."""
    if not root.is_dir():
        raise DatasetError(f"{where}: missing folder {root}")
    return [(label, name, read_bytes(file)) for label, name, file in class_folder_files(root)]


def _archive_documents(data_dir: Path, top: str, hint: str) -> tuple[list[tuple[str, str, bytes]], str] | None:
    """(class, file name, bytes) of the `<top>/<class>/<file>` members of the first archive in data_dir that has
    them (.zip, .tar, .tar.gz or .tgz, read by content), sorted, and where they came from; None if none has."""
    found = archive_tree(data_dir, re.compile(rf"(?:^|/){re.escape(top)}/([^/]+)/([^/]+)$"), hint)
    if found is None:
        return None
    archive, members = found
    return sorted((match.group(1), match.group(2), data) for match, data in members), f"{archive}:{top}"


def _class_folder_corpus(entries: list[tuple[str, str, bytes]], where: str, latin1_fallback: bool) -> Corpus:
    corpus = Corpus()
    for label, name, data in entries:
        source = f"{where}/{label}/{name}"
        text, fell_back = decode(data, source, latin1_fallback)
        corpus.latin1_files += fell_back
        corpus.add(text, label, source)
    return corpus


BBC_LAYOUTS = ("bbc/<class>/<nnn>.txt as a folder", "the same tree in a .zip, .tar, .tar.gz or .tgz (bbc-fulltext.zip)")


def read_bbc(data_dir: Path, subset: str) -> Corpus:
    """BBC News (Greene and Cunningham 2006): `bbc/<class>/<nnn>.txt`, as a folder or in any archive of data_dir.
    There is no official test split: every document is read and build_textcls holds a test set out."""
    if (data_dir / "bbc").is_dir() or data_dir.name == "bbc":
        root = data_dir / "bbc" if (data_dir / "bbc").is_dir() else data_dir
        entries, where = _folder_documents(root, "BBC"), str(root)
    elif (found := _archive_documents(data_dir, "bbc", "bbc")) is not None:
        entries, where = found
    else:
        raise no_layout_error("BBC", data_dir, BBC_LAYOUTS, download_command("bbc", data_dir, unverified=True))
    return _class_folder_corpus([e for e in entries if e[1].endswith(".txt")], where, latin1_fallback=True)


NEWS_LAYOUTS = ("20news-bydate-{train,test}/<group>/<id> as folders",
                "the same trees in a .zip, .tar, .tar.gz or .tgz (20news-bydate.tar.gz)")


def read_20news(data_dir: Path, subset: str) -> Corpus:
    """20 Newsgroups "bydate" (Lang 1995): `20news-bydate-{train,test}/<group>/<id>`, as folders or in any archive
    of data_dir. Documents are kept whole (headers included, as scikit-learn's fetch_20newsgroups does by default)."""
    top = f"20news-bydate-{subset}"
    if (data_dir / top).is_dir():
        entries, where = _folder_documents(data_dir / top, "20 Newsgroups"), str(data_dir / top)
    elif (found := _archive_documents(data_dir, top, "20news")) is not None:
        entries, where = found
    else:
        raise no_layout_error(f"20 Newsgroups ({top}/)", data_dir, NEWS_LAYOUTS, download_command("20news", data_dir))
    entries.sort(key=lambda e: (e[0], int(e[1]) if e[1].isdigit() else e[1]))  # numeric ids, like the release
    return _class_folder_corpus(entries, where, latin1_fallback=True)


def read_imdb_corpus(data_dir: Path, subset: str) -> Corpus:
    """IMDb (Maas et al. 2011) through data/text.py's reader (archive or extracted folder)."""
    from .text import read_imdb

    corpus = Corpus()
    # Damaged archives are errors here too; the official-count check (check_counts) is not plumbed
    # through build_textcls's options yet, so subsets and fixtures are read as they are.
    for index, (label, data) in enumerate(read_imdb(data_dir, subset, check_counts=False)):
        source = f"IMDb {subset} review {index} (sorted by label, id)"
        corpus.add(decode(data, source, latin1_fallback=False)[0], ("neg", "pos")[label], source)
    return corpus


def read_mimic3(data_dir: Path, subset: str) -> Corpus:
    """MIMIC-III top-50 codes in CAML's (Mullenbach et al. 2018) preprocessed CSV files `{subset}_50.csv`:
    a header with `TEXT` and `LABELS` (or `ICD9_CODE`), codes separated by ';'."""
    path = _find(data_dir, [f"{subset}_50.csv", f"mimic3/{subset}_50.csv"], f"MIMIC-III 50 {subset}",
                 None)  # credentialed access only (download_textcls says how)
    corpus = Corpus()
    text = decode(read_bytes(path), str(path), latin1_fallback=False)[0]  # not UTF-8: an error naming its line
    with io.StringIO(text, newline="") as handle:
        reader = csv.reader(handle)
        start = 1  # the line a row starts on (a note's text spans many lines; reader.line_num is where it ends)
        try:
            header = next(reader, None) or []
            repeated = sorted({c for c in header if header.count(c) > 1})
            if repeated:
                raise DatasetError(f"{path}:1: the header names column(s) {repeated} more than once: which one holds "
                                   "the data is ambiguous")
            label_column = next((c for c in ("LABELS", "ICD9_CODE") if c in header), None)
            if "TEXT" not in header or label_column is None:
                raise DatasetError(f"{path}:1: expected a header with TEXT and LABELS columns, found {header}")
            text_index, label_index = header.index("TEXT"), header.index(label_column)
            start = reader.line_num + 1
            for row in reader:
                source = f"{path}:{start}"
                if len(row) != len(header):
                    raise DatasetError(f"{source}: expected {len(header)} columns, found {len(row)}")
                codes = tuple(sorted({c.strip() for c in row[label_index].split(";") if c.strip()}))
                corpus.add(row[text_index], codes, source)
                start = reader.line_num + 1
        except csv.Error as error:
            raise DatasetError(f"{path}:{start}: malformed CSV ({error})") from None
    return corpus


def read_scope(identity: str) -> Callable[[Path, str], Corpus]:
    """ASTRAL SCOPe FASTA (`astral-scopedom-seqres-gd-sel-gs-bib-<identity>-<version>.fa`): a header
    `>d1dlwa_ a.1.1.1 (A:) ...` then the sequence lines; the label is the fold (`a.1`), as the
    Singularformer authors' public code takes it."""

    def read(data_dir: Path, subset: str) -> Corpus:
        files = sorted(data_dir.glob(f"*-{identity}-*.fa")) + sorted(data_dir.glob(f"*-{identity}-*.fasta"))
        if not files:
            raise no_layout_error(f"SCOPe {identity}", data_dir,
                                  [f"the ASTRAL FASTA *-{identity}-*.fa or *-{identity}-*.fasta"],
                                  download_command(f"scope{identity}", data_dir, unverified=True))
        path = files[-1]  # the newest version when several are present
        text = decode(path.read_bytes(), str(path), latin1_fallback=False)[0]
        records: list[tuple[str, str, list[str]]] = []  # (fold, source, sequence lines)
        for number, line in enumerate(text.splitlines(), 1):
            if line.startswith(">"):
                fields = line[1:].split()
                if len(fields) < 2 or fields[1].count(".") != 3:
                    raise DatasetError(f"{path}:{number}: expected '>domain class.fold.superfamily.family ...'")
                records.append((".".join(fields[1].split(".")[:2]), f"{path}:{number}", []))
            elif line.strip():
                if not records:
                    raise DatasetError(f"{path}:{number}: sequence before the first '>' header")
                records[-1][2].append(line.strip())
        corpus = Corpus()
        for fold, source, lines in records:
            corpus.add("".join(lines).upper(), fold, source)
        return corpus

    return read


for _spec in (
    TextClsSpec("r8", 141, read_r8, word_pattern=WHITESPACE_PATTERN),
    TextClsSpec("bbc", 664, read_bbc, official_test=False),
    TextClsSpec("20news", 700, read_20news),
    TextClsSpec("imdb", 539, read_imdb_corpus),
    TextClsSpec("mimic3_50", 1024, read_mimic3, word_pattern=WHITESPACE_PATTERN, multilabel=True,
                official_dev=True),
    TextClsSpec("scope95", 328, read_scope("95"), tokenizer="char", official_test=False),
    TextClsSpec("scope40", 337, read_scope("40"), tokenizer="char", official_test=False),
):
    TEXTCLS_DATASETS.register(_spec.name, _spec)


def get_textcls(name: str) -> TextClsSpec:
    return TEXTCLS_DATASETS.get(name)


# ----------------------------------------------------------------------------- tokenisation

def word_tokens(text: str, pattern: re.Pattern = WORD_PATTERN) -> list[str]:
    """Lower-cased word tokens (the dataset's pattern)."""
    return pattern.findall(text.lower())


def build_vocabulary(token_lists: Sequence[Sequence[str]], min_count: int = 1) -> list[str]:
    """["[PAD]", "[UNK]", words by descending count, ties alphabetically]: ids are list positions.
    Words seen fewer than ``min_count`` times are left out (they become [UNK])."""
    if not isinstance(min_count, int) or min_count < 1:
        raise DatasetError(f"min_count must be a positive int, got {min_count!r}")
    counts = Counter(token for tokens in token_lists for token in tokens)
    kept = [token for token, count in counts.items() if count >= min_count]
    return ["[PAD]", "[UNK]"] + sorted(kept, key=lambda token: (-counts[token], token))


def _encode_words(token_lists: Sequence[Sequence[str]], vocabulary: list[str], max_length: int) -> list[np.ndarray]:
    index = {token: i for i, token in enumerate(vocabulary)}
    return [np.asarray([index.get(t, UNK_ID) for t in tokens[:max_length]], dtype=np.int32) for tokens in token_lists]


def _encode_residues(texts: Sequence[str], max_length: int) -> list[np.ndarray]:
    table = np.full(256, UNK_ID, dtype=np.int32)
    for i, letter in enumerate(AMINO_ACIDS):
        table[ord(letter)] = i + 2
    return [table[np.frombuffer(t[:max_length].encode("ascii", "replace"), dtype=np.uint8)] for t in texts]


# ----------------------------------------------------------------------------- datasets

class TextClsDataset(Dataset):
    """Tokenised documents: ``{"tokens": LongTensor[L], "label": int}``, or a float multi-hot
    ``"label"`` of ``num_classes`` values for a multi-label dataset."""

    def __init__(self, sequences: list[np.ndarray], labels: np.ndarray, *, classes: list[str], pad_id: int,
                 vocab_size: int, multilabel: bool, sources: list[str], vocabulary: list[str] | None = None) -> None:
        self.tokens = Packed(sequences, np.int32)
        self.labels = labels
        self.classes = classes
        self.num_classes = len(classes)
        self.multilabel = multilabel
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.sources = sources
        self.vocabulary = vocabulary

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} examples")
        index %= len(self)
        label = self.labels[index]
        label = torch.from_numpy(label.astype(np.float32)) if self.multilabel else int(label)
        return {"tokens": self.tokens[index], "label": label}

    def lengths(self) -> np.ndarray:
        """Tokens per document (for length-grouped batching)."""
        return self.tokens.lengths()

    @property
    def max_len(self) -> int:
        lengths = self.tokens.lengths()
        return int(lengths.max()) if len(lengths) else 0


@once_per_block  # the train, val and test splits of one build all need the training documents
def _subset_corpus(spec: TextClsSpec, data_dir: Path, subset: str, skip_empty: bool) -> Corpus:
    corpus = spec.reader(data_dir, subset)
    if not len(corpus):
        raise DatasetError(f"{spec.name}: no documents for {subset!r} in {data_dir}")
    empty = [i for i, text in enumerate(corpus.texts) if not text.strip()]
    if empty and not skip_empty:
        raise DatasetError(f"{spec.name}: empty document at {corpus.sources[empty[0]]} ({len(empty)} in all); "
                           "pass skip_empty=True to drop empty documents")
    if empty:
        keep = sorted(set(range(len(corpus))) - set(empty))
        corpus = Corpus([corpus.texts[i] for i in keep], [corpus.labels[i] for i in keep],
                        [corpus.sources[i] for i in keep], corpus.latin1_files)
    return corpus


def _label_array(corpus: Corpus, classes: list[str], multilabel: bool) -> np.ndarray:
    index = {name: i for i, name in enumerate(classes)}
    if multilabel:
        array = np.zeros((len(corpus), len(classes)), dtype=np.uint8)
        for row, (codes, source) in enumerate(zip(corpus.labels, corpus.sources)):
            for code in codes:
                if code not in index:
                    raise DatasetError(f"{source}: label {code!r} is not among the {len(classes)} training labels")
                array[row, index[code]] = 1
        return array
    for label, source in zip(corpus.labels, corpus.sources):
        if label not in index:
            raise DatasetError(f"{source}: label {label!r} does not occur in the training set "
                               f"(classes: {', '.join(classes)})")
    return np.asarray([index[label] for label in corpus.labels], dtype=np.int64)


def build_textcls(name: str, split: str, data_dir: str | Path | None, *, fold: int | None = None,
                  num_folds: int = 5, seed: int = 0, tokenizer: str | None = None, max_length: int | None = None,
                  test_fraction: float = 0.2, skip_empty: bool = False, min_count: int = 1) -> TextClsDataset:
    """Dataset `name` for `split` ("train", "val", "test").

    fold=None: "train" is the whole training set, "test" the test set, and "val" exists only where the
    release has one (MIMIC-III's dev file). fold=k: "train" and "val" are the other folds and fold k of
    ``stratified_folds(training labels, num_folds, seed)`` (Singularformer's 5-fold cross-validation).
    Datasets without an official test set (BBC, SCOPe) hold out a stratified `test_fraction` first.
    `tokenizer`: "word" (the dataset's word pattern; vocabulary from the training set: [PAD] 0, [UNK] 1,
    then by frequency; words seen fewer than `min_count` times in the training set become [UNK]),
    "wordpiece" (MiniLM's uncased WordPiece, [CLS] text [SEP]) or "char" (amino acids).
    """
    check_split(split)
    spec = get_textcls(name)
    if data_dir is None:
        raise DatasetError(f"{name} needs data_dir (see docs/data.md for its files and download)")
    tokenizer = tokenizer or spec.tokenizer
    if tokenizer not in TOKENIZERS:
        raise DatasetError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    max_length = max_length or spec.max_length
    if fold is not None and not 0 <= fold < num_folds:
        raise DatasetError(f"fold must be in [0, {num_folds}), got {fold}")
    if split == "val" and fold is None and not spec.official_dev:
        raise DatasetError(f"{name} has no validation file: pass fold=k for fold k of the cross-validation")
    root = Path(data_dir)

    train = _subset_corpus(spec, root, "train", skip_empty)
    if not spec.official_test:  # one pool of documents: hold the test set out, stratified and seeded
        keep_train, keep_test = holdout_test(train.labels, test_fraction, seed)
        pool = train
        train = _take(pool, keep_train)
        test = _take(pool, keep_test) if split == "test" else None
    if spec.multilabel:
        classes = sorted({code for codes in train.labels for code in codes})
    else:
        classes = sorted(set(train.labels))
    if split == "test":
        corpus = test if not spec.official_test else _subset_corpus(spec, root, "test", skip_empty)
    elif split == "val" and fold is None:
        corpus = _subset_corpus(spec, root, "dev", skip_empty)
    elif fold is None:
        corpus = train
    else:
        train_labels = _label_array(train, classes, spec.multilabel)
        train_index, val_index = stratified_folds(train_labels, num_folds, seed)[fold]
        corpus = _take(train, val_index if split == "val" else train_index)
    labels = _label_array(corpus, classes, spec.multilabel)

    vocabulary = None
    if tokenizer == "word":
        vocabulary = build_vocabulary([word_tokens(t, spec.word_pattern) for t in train.texts], min_count)
        sequences = _encode_words([word_tokens(t, spec.word_pattern) for t in corpus.texts], vocabulary, max_length)
        pad_id, vocab_size = PAD_ID, len(vocabulary)
    elif tokenizer == "char":
        sequences, pad_id, vocab_size = _encode_residues(corpus.texts, max_length), PAD_ID, len(AMINO_ACIDS) + 2
    else:
        wp = wordpiece.load_wordpiece()
        sequences = [ids.astype(np.int32) for ids in wordpiece.encode(wp, corpus.texts, max_length=max_length)[0]]
        pad_id, vocab_size = wordpiece.special_id(wp, "[PAD]"), wp.get_vocab_size()
    return TextClsDataset(sequences, labels, classes=classes, pad_id=pad_id, vocab_size=vocab_size,
                          multilabel=spec.multilabel, sources=corpus.sources, vocabulary=vocabulary)


def _take(corpus: Corpus, index: np.ndarray) -> Corpus:
    return Corpus([corpus.texts[i] for i in index], [corpus.labels[i] for i in index],
                  [corpus.sources[i] for i in index], corpus.latin1_files)


def collate_textcls(items: Sequence[dict], pad_id: int = 0, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """{"tokens": Long[B, N], "attention_mask": bool[B, N] (True = real token), "label": Long[B], or
    Float[B, C] multi-hot for a multi-label dataset}."""
    if not items:
        raise DatasetError("collate: empty batch")
    tokens, mask = pad_sequences([item["tokens"] for item in items], pad_id, pad_to, "tokens")
    labels = [item["label"] for item in items]
    label = torch.stack(labels) if isinstance(labels[0], torch.Tensor) else torch.tensor(labels, dtype=torch.long)
    return {"tokens": tokens, "attention_mask": mask, "label": label}


def download_textcls(name: str, dest: str | Path, *, base_url: str | None = None, progress: bool = True,
                     allow_unverified: bool = False) -> Path:
    """Fetch the public files of `name` (r8, bbc, 20news, imdb, scope95, scope40) into dest, checksum-verified
    where a checksum is known (BBC and SCOPe have none published: allow_unverified=True). MIMIC-III needs
    credentialed PhysioNet access and is never downloaded. Returns the folder to pass as data_dir."""
    from .download import download

    get_textcls(name)
    dest = Path(dest)
    options = dict(base_url=base_url, progress=progress)
    if name == "r8":
        for part in ("r8_train", "r8_test"):
            download(part, dest / "R8", **options)
        return dest / "R8"
    if name == "mimic3_50":
        raise DatasetError("MIMIC-III needs credentialed access (physionet.org); build CAML's *_50.csv files "
                           "from it and pass their folder as data_dir")
    download(name, dest, allow_unverified=allow_unverified, **options)  # archive names are the dataset names
    return dest


__all__ = ["TEXTCLS_DATASETS", "TextClsDataset", "build_textcls", "collate_textcls", "download_textcls",
           "get_textcls", "holdout_test", "stratified_folds"]
