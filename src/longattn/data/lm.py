"""Causal language modelling on a plain-text corpus (WikiText-2): a BPE tokenizer trained on the training split,
and blocks of tokens for next-token prediction.

WikiText-2 comes tokenised into words (with ``<unk>`` for rare ones); no installed tokenizer fits a small model
trained from scratch on it (MiniLM's uncased WordPiece has 30,522 entries, most of a tiny model's parameters and
time, and lower-cases the text), so a byte-pair encoding is learned on the training split with Hugging Face
``tokenizers``: whitespace-split words, ``vocab_size`` entries (8,192 by default), ``<unk>`` kept as one token
and ``<eos>`` closing every line, as word-level WikiText models end lines. The tokenizer and the encoded splits
are cached (``LONGATTN_CACHE_DIR``, else ``~/.cache/longattn``), keyed by the training file's content and the
vocabulary size, so that every run of a grid reads the same ones.

A split is one stream of token ids, cut into blocks of ``context + 1`` tokens that overlap by one: the model
reads ``block[:-1]`` and predicts ``block[1:]``, so every token after the first is predicted once, with up to
``context`` tokens of its block before it (the last incomplete block is dropped).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .common import DatasetError, no_layout_error
from .mlm import read_lines

__all__ = ["EOS", "UNK", "LMBlocks", "bpe_tokenizer", "cache_dir", "collate_lm", "encode_lines", "lm_blocks",
           "train_file_path", "word_count"]

EOS, UNK = "<eos>", "<unk>"
TOKENIZER_VERSION = 1  # part of the cache key: a change in how the tokenizer is trained invalidates the cache


def cache_dir() -> Path:
    """Where trained tokenizers and encoded splits are kept: ``LONGATTN_CACHE_DIR``, else ``~/.cache/longattn``."""
    return Path(os.environ.get("LONGATTN_CACHE_DIR") or Path.home() / ".cache" / "longattn") / "lm"


def train_file_path(folder: Path, name: str) -> Path:
    """The training file ``name`` in ``folder``; WikiText-2 as shipped here (``wiki.train.tokens.reordered``, the
    canonical content with its articles in another order) stands in for ``wiki.train.tokens``."""
    path = folder / name
    if not path.is_file() and (folder / f"{name}.reordered").is_file():
        return folder / f"{name}.reordered"
    if not path.is_file():
        raise no_layout_error(f"corpus file {path} does not exist", folder, [name, f"{name}.reordered"], None)
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _atomic_write(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def bpe_tokenizer(train_path: Path, vocab_size: int) -> tuple[Any, str]:
    """A BPE tokenizer trained on ``train_path`` (cached), and its cache key."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 64:
        raise DatasetError(f"vocab_size must be at least 64, got {vocab_size}")
    key = f"bpe{vocab_size}-v{TOKENIZER_VERSION}-{_digest(train_path)}"
    path = cache_dir() / f"{key}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path)), key
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, UNK], show_progress=False)
    tokenizer.train_from_iterator(read_lines(train_path), trainer)
    _atomic_write(path, lambda tmp: tokenizer.save(str(tmp)))
    return tokenizer, key


def encode_lines(path: Path, tokenizer: Any, key: str) -> np.ndarray:
    """The token ids of a corpus file: its non-empty lines, each followed by ``<eos>``, as one int32 stream
    (cached under the tokenizer's key and the file's content)."""
    cached = cache_dir() / f"{key}-{_digest(path)}.npy"
    if cached.is_file():
        return np.load(cached)
    eos = tokenizer.token_to_id(EOS)
    encodings = tokenizer.encode_batch(read_lines(path), add_special_tokens=False)
    stream = np.concatenate([np.append(np.asarray(e.ids, dtype=np.int32), eos) for e in encodings])

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as file:  # a file object: np.save would add .npy to a name
            np.save(file, stream)

    _atomic_write(cached, save)
    return stream


def word_count(path: Path) -> int:
    """Words of a corpus file as word-level perplexities count them: whitespace-split words plus one ``<eos>``
    per non-empty line."""
    return sum(len(line.split()) + 1 for line in read_lines(path))


def lm_blocks(stream: np.ndarray, context: int) -> Tensor:
    """Long[count, context + 1]: block i holds tokens i * context .. (i + 1) * context of the stream."""
    if context < 1:
        raise DatasetError(f"context must be at least 1 token, got {context}")
    count = (len(stream) - 1) // context
    if count == 0:
        raise DatasetError(f"the corpus has {len(stream)} tokens, fewer than one block of {context + 1}")
    ids = torch.from_numpy(stream.astype(np.int64))
    return ids[: count * context + 1].unfold(0, context + 1, context).contiguous()


class LMBlocks(Dataset):
    """Token blocks of a split; an example is ``{"input_ids": Long[context + 1]}``."""

    def __init__(self, blocks: Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.blocks[index]}


def collate_lm(examples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {"input_ids": torch.stack([e["input_ids"] for e in examples])}
