"""Plain-text corpora for masked-language-model pretraining (BERT, Devlin et al. 2019), WikiText-2 first.

A corpus is one UTF-8 text file per split (WikiText's ``wiki.train.tokens``, ``wiki.valid.tokens``,
``wiki.test.tokens``, or any plain text with one paragraph a line). Its non-empty lines are WordPiece
tokenised (MiniLM's uncased vocabulary, :mod:`longattn.data.wordpiece`, the one GLUE uses), joined into one
stream and cut into blocks of ``max_len`` tokens: ``[CLS]`` + ``max_len - 2`` tokens + ``[SEP]``, so no
block is padded (the last incomplete piece is dropped).

Masking is BERT's (15% of the non-special tokens are predicted; of those 80% become ``[MASK]``, 10% a
random word, 10% stay), done by transformers' ``DataCollatorForLanguageModeling``:

* :class:`Masker` masks a training batch with torch's global random stream (so checkpoints, which save
  it, resume exactly, and DDP ranks, seeded apart, draw different masks); every epoch masks anew;
* :func:`masked_split` masks an evaluation split once with its own seed: every model is scored on the
  same masked positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from . import wordpiece
from .common import DatasetError

IGNORE = -100  # label of positions without a prediction (transformers' and torch's cross-entropy convention)


def read_lines(path: str | Path) -> list[str]:
    """The non-empty lines of a UTF-8 text file; a missing, empty or non-UTF-8 file names itself."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"corpus file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 ({error.reason})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise DatasetError(f"corpus file {path} holds no text")
    return lines


def token_blocks(lines: list[str], tokenizer: Any, max_len: int) -> Tensor:
    """The lines' WordPieces as one stream, cut into ``[CLS] ... [SEP]`` blocks: Long[num_blocks, max_len]."""
    if max_len < 3:
        raise DatasetError(f"max_len={max_len} leaves no room for text beside [CLS] and [SEP]")
    tokenizer.no_truncation()
    encodings = tokenizer.encode_batch(lines, add_special_tokens=False)
    stream = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
    body = max_len - 2
    count = len(stream) // body
    if count == 0:
        raise DatasetError(f"the corpus has {len(stream)} tokens, fewer than one block of {body}")
    blocks = torch.from_numpy(stream[: count * body].reshape(count, body))
    cls = torch.full((count, 1), wordpiece.special_id(tokenizer, "[CLS]"), dtype=torch.long)
    sep = torch.full((count, 1), wordpiece.special_id(tokenizer, "[SEP]"), dtype=torch.long)
    return torch.cat([cls, blocks, sep], dim=1)


class Masker:
    """BERT's masking of a batch of blocks (transformers' ``DataCollatorForLanguageModeling``)."""

    def __init__(self, tokenizer: Any, probability: float = 0.15, seed: int | None = None) -> None:
        from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

        if not 0 < probability < 1:
            raise DatasetError(f"mask probability must lie in (0, 1), got {probability}")
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                       cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
        self.collator = DataCollatorForLanguageModeling(fast, mlm_probability=probability, seed=seed)
        if seed is not None:  # its own stream (the collator's __call__ would make it; torch_mask_tokens does not)
            self.collator.generator = self.collator.get_generator(seed)
        self.special = torch.tensor(sorted(fast.all_special_ids))

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(masked inputs, labels): labels hold the original id where a prediction is due, else -100."""
        special = torch.isin(input_ids, self.special.to(input_ids.device))
        if attention_mask is not None:
            special |= ~attention_mask
        inputs, labels = self.collator.torch_mask_tokens(input_ids.clone().cpu(), special.cpu())
        return inputs.to(input_ids.device), labels.to(input_ids.device)


@dataclass
class MLMBlocks(Dataset):
    """Blocks of a corpus: ``{"input_ids": Long[N]}``, plus fixed ``"labels"`` when masked once."""

    input_ids: Tensor
    labels: Tensor | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        item = {"input_ids": self.input_ids[index]}
        if self.labels is not None:
            item["labels"] = self.labels[index]
        return item


def masked_split(blocks: Tensor, tokenizer: Any, probability: float, seed: int) -> MLMBlocks:
    """An evaluation split masked once with ``seed`` (the same positions for every model and every run)."""
    inputs, labels = Masker(tokenizer, probability, seed=seed)(blocks)
    return MLMBlocks(inputs, labels)


def collate_blocks(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack equal-length blocks; no padding, so every position is real."""
    if not items:
        raise DatasetError("collate: empty batch")
    batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"], dtype=torch.bool)
    return batch
