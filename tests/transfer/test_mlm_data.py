"""MLM corpora and BERT masking (data/mlm.py)."""

import pytest
import torch

from longattn.data import mlm, wordpiece
from longattn.data.common import DatasetError


def test_blocks_are_cls_text_sep_from_one_stream(corpus, tokenizer):
    lines = mlm.read_lines(corpus / "wiki.train.tokens")
    assert lines[0] == "= Castle =" and "" not in lines  # stripped, blank lines dropped
    blocks = mlm.token_blocks(lines, tokenizer, max_len=16)
    stream = [i for e in tokenizer.encode_batch(lines, add_special_tokens=False) for i in e.ids]
    assert blocks.shape == (len(stream) // 14, 16)
    assert (blocks[:, 0] == wordpiece.special_id(tokenizer, "[CLS]")).all()
    assert (blocks[:, -1] == wordpiece.special_id(tokenizer, "[SEP]")).all()
    assert blocks[:, 1:-1].reshape(-1).tolist() == stream[: blocks.shape[0] * 14]  # in order, nothing skipped


def test_bad_corpus_files_name_themselves(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="does not exist"):
        mlm.read_lines(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DatasetError, match="empty.txt holds no text"):
        mlm.read_lines(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes(b"fine\nalso fine\ncaf\xe9\n")
    with pytest.raises(DatasetError, match=r"latin1.txt:3: not UTF-8"):
        mlm.read_lines(tmp_path / "latin1.txt")
    with pytest.raises(DatasetError, match="fewer than one block"):
        mlm.token_blocks(["two words"], tokenizer, max_len=64)


def test_bert_masking_15_percent_80_10_10(tokenizer):
    # Real WordPiece ids (no special tokens inside), many of them, so the rates are tight.
    torch.manual_seed(0)
    body = torch.randint(1000, 30000, (400, 126))
    cls, sep = wordpiece.special_id(tokenizer, "[CLS]"), wordpiece.special_id(tokenizer, "[SEP]")
    blocks = torch.cat([torch.full((400, 1), cls), body, torch.full((400, 1), sep)], dim=1)
    inputs, labels = mlm.Masker(tokenizer, 0.15, seed=1)(blocks)
    predicted = labels != mlm.IGNORE
    assert not predicted[:, [0, -1]].any()  # [CLS] and [SEP] are never predicted
    assert labels[predicted].tolist() == blocks[predicted].tolist()  # labels are the original tokens
    rate = predicted[:, 1:-1].float().mean().item()
    assert abs(rate - 0.15) < 0.005
    mask_id = wordpiece.special_id(tokenizer, "[MASK]")
    as_mask = (inputs[predicted] == mask_id).float().mean().item()
    kept = (inputs[predicted] == blocks[predicted]).float().mean().item()
    assert abs(as_mask - 0.8) < 0.01
    assert abs(kept - 0.1) < 0.01  # unchanged (a random word equal to the original is 1 in 30k)
    assert abs(1 - as_mask - kept - 0.1) < 0.01  # random words
    assert torch.equal(inputs[~predicted], blocks[~predicted])  # nothing else changes


def test_masking_streams(tokenizer):
    blocks = mlm.token_blocks(["the castle was built in the twelfth century"] * 40, tokenizer, max_len=12)
    # evaluation splits: their own seed, the same masks every time
    first, second = mlm.masked_split(blocks, tokenizer, 0.15, seed=3), mlm.masked_split(blocks, tokenizer, 0.15, 3)
    assert torch.equal(first.labels, second.labels) and torch.equal(first.input_ids, second.input_ids)
    assert not torch.equal(first.labels, mlm.masked_split(blocks, tokenizer, 0.15, seed=4).labels)
    # training: torch's global stream (saved in checkpoints), a new draw every call
    masker = mlm.Masker(tokenizer)
    torch.manual_seed(5)
    a = masker(blocks)[1]
    b = masker(blocks)[1]
    torch.manual_seed(5)
    assert torch.equal(masker(blocks)[1], a) and not torch.equal(a, b)
    # padded positions (attention_mask False) are never predicted
    mask = torch.ones_like(blocks, dtype=torch.bool)
    mask[:, 6:] = False
    assert (masker(blocks, mask)[1][:, 6:] == mlm.IGNORE).all()


def test_collate_and_bad_probability(tokenizer):
    blocks = mlm.token_blocks(["the castle was built in the twelfth century"] * 10, tokenizer, max_len=8)
    batch = mlm.collate_blocks([mlm.MLMBlocks(blocks)[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 8) and batch["attention_mask"].all()
    with pytest.raises(DatasetError, match="mask probability"):
        mlm.Masker(tokenizer, 1.5)
