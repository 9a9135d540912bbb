"""Causal language modelling (``lm``): next-token prediction on a plain-text corpus, WikiText-2 first.

A BPE tokenizer learned on the training split (:mod:`longattn.data.lm`), blocks of ``context`` tokens, the
``llama_lm`` decoder with the chosen causal mechanism, cross-entropy of every next token. Validation and test
score every block of wiki.valid.tokens and wiki.test.tokens: ``perplexity`` is exp(mean negative log-likelihood
per BPE token); results.json also gives the word-level perplexity of WikiText (the same total log-likelihood per
word of the split, comparable across tokenizers). Presets in ``configs/lm/`` (``cpu``: the benchmark's CPU size;
``paper``: a 6-layer, 512-wide decoder for a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longattn.config import ConfigError, option
from longattn.data import lm
from longattn.hf import llama  # noqa: F401  (registers the llama_lm model)
from longattn.tasks.base import Task, TaskData, register_task
from longattn.tasks.classification import SubsetConfig
from longattn.train.loop import MetricFn, StepFn, StepOutput

LM_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "lm"
SPLITS = ("train", "val", "test")


@dataclass
class LMDataConfig:
    """The ``data`` section of ``lm``: a corpus folder with one text file per split."""

    data_dir: str | None = option(None, help="folder of the corpus files (WikiText-2: ../shared/data/wikitext2)")
    train_file: str = option("wiki.train.tokens", help="falls back to <name>.reordered (WikiText-2 as shipped here)")
    val_file: str | None = option("wiki.valid.tokens", help="null: no validation")
    test_file: str | None = option("wiki.test.tokens", help="null: no test")
    vocab_size: int = option(8192, ge=64, help="BPE entries learned on the training split")
    context: int = option(256, ge=1, help="tokens a block holds (and predicts)")
    subset: SubsetConfig = option(default_factory=SubsetConfig, help="seeded random subsets, in blocks")


def lm_step(model: nn.Module, batch: dict[str, Any]) -> StepOutput:
    """Mean next-token cross-entropy; predictions are [B, 2] rows (summed negative log-likelihood, tokens) so that
    a split's perplexity is one exp over all its tokens, without [tokens, vocabulary] logits."""
    ids = batch["input_ids"]
    logits = model(ids[:, :-1]).float()  # the loss in float32 under autocast
    nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)
    rows = torch.stack([nll.detach().sum(1), torch.full_like(nll[:, 0], nll.shape[1])], dim=1)
    return StepOutput(nll.mean(), rows, torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device))


def perplexity(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(total negative log-likelihood / tokens) of the rows of :func:`lm_step`."""
    totals = predictions.double().sum(0)
    return float(torch.exp(totals[0] / totals[1]))


@register_task("lm", description="causal language modelling (next token) on WikiText-2 with a Llama decoder")
class LMTask(Task):
    family = "lm"
    data_config = LMDataConfig
    overlay = {
        "optim": {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "schedule": "cosine", "min_lr_ratio": 0.1},
        "train": {"clip_norm": 1.0, "drop_last": True},
    }
    model_family = "causal_lm"
    default_model = "llama_lm"
    model_input_names = ("vocab_size", "max_len")
    select_metric = "perplexity"
    select_mode = "min"
    preset_dir = LM_CONFIGS

    def _folder(self, config: Any) -> Path:
        if not config.data.data_dir:
            raise ConfigError("set data.data_dir (--data-dir, or --set data.data_dir=DIR) to the corpus folder "
                              "(e.g. ../shared/data/wikitext2)")
        return Path(config.data.data_dir)

    def build_data(self, config: Any) -> TaskData:
        data = config.data
        folder = self._folder(config)
        train_path = lm.train_file_path(folder, data.train_file)
        tokenizer, key = lm.bpe_tokenizer(train_path, data.vocab_size)
        paths = {"train": train_path, "val": folder / data.val_file if data.val_file else None,
                 "test": folder / data.test_file if data.test_file else None}
        splits: dict[str, Any] = {}
        tokens_per_word: dict[str, float] = {}
        for split, path in paths.items():
            if path is None:
                splits[split] = None
                continue
            stream = lm.encode_lines(path, tokenizer, key)
            tokens_per_word[split] = len(stream) / lm.word_count(path)
            blocks = lm.lm_blocks(stream, data.context)
            size = getattr(data.subset, split)
            if size is not None and size < len(blocks):
                generator = torch.Generator().manual_seed(config.seed * 7919 + SPLITS.index(split))
                blocks = blocks[torch.randperm(len(blocks), generator=generator)[:size].sort().values]
            splits[split] = lm.LMBlocks(blocks)
        info = {"vocab_size": tokenizer.get_vocab_size(), "tokenizer": key, "train_file": str(train_path),
                "tokens_per_word": tokens_per_word}
        return TaskData(splits["train"], splits["val"], splits["test"], lm.collate_lm, info)

    def data_cache_key(self, config: Any) -> Any:
        return (self.name, repr(config.data), config.seed if any(vars(config.data.subset).values()) else None)

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        return {"vocab_size": data.info["vocab_size"], "max_len": config.data.context}

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return lm_step

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        return {"perplexity": perplexity}

    def describe(self, config: Any, data: TaskData, results: dict[str, Any]) -> dict[str, Any]:
        """Block counts, the tokenizer, training tokens per second and WikiText's word-level perplexities."""
        context = config.data.context
        tokens = results["steps"] * config.train.batch_size * config.train.grad_accum * context
        word = {}
        for split in ("val", "test"):
            result = results.get(split)
            if result and split in data.info["tokens_per_word"]:
                word[split] = math.exp(math.log(result["perplexity"]) * data.info["tokens_per_word"][split])
        return {"blocks": {split: len(d) for split, d in zip(SPLITS, (data.train, data.val, data.test)) if d},
                "context": context, "tokenizer": data.info["tokenizer"], "train_file": data.info["train_file"],
                "tokens_per_word": data.info["tokens_per_word"], "word_perplexity": word,
                "train_tokens": tokens,
                "train_tokens_per_s": tokens / results["train_time_s"] if results.get("train_time_s") else None}

    def validation_line(self, record: dict[str, Any]) -> str | None:
        return f"step {record['step']}: val perplexity {record['perplexity']:.2f}"
