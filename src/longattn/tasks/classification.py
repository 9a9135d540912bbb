"""Sequence classification tasks: token sequences (single or paired) to one label, scored by accuracy.

:class:`ClassificationTask` is the base of the LRA tasks and of any new classification task: a subclass
sets ``vocab_size``, ``num_classes``, ``max_len`` (and ``dual`` for paired inputs) and implements
:meth:`ClassificationTask.build_split`, which returns a dataset of ``{"tokens": LongTensor, "label": int}``
items (``tokens0``/``tokens1`` when dual). Batching with explicit masks, the model (the registered
``lra_classifier``), the cross-entropy step and accuracy come from here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

from longattn.config import option
from longattn.data.lra import collate as pad_collate
from longattn.tasks.base import Task, TaskData
from longattn.train.loop import MetricFn, StepFn, StepOutput, accuracy
from longattn.utils import warn

__all__ = ["ClassificationDataConfig", "ClassificationTask", "classification_step", "subset_indices"]

SPLITS = ("train", "val", "test")


@dataclass
class SubsetConfig:
    """Train on a seeded random subset of this many examples per split (null: all)."""

    train: int | None = option(None, ge=1)
    val: int | None = option(None, ge=1)
    test: int | None = option(None, ge=1)


def subset_indices(count: int, size: int | None, seed: int, split: str, what: str) -> list[int] | None:
    """The ``data.subset.<split>`` subset of a split of ``count`` examples: ``size`` of them drawn at random with a
    seeded generator (not the first rows: files are often sorted by label), sorted; None for all of them. A size
    larger than the split is a warning naming both numbers (the whole split is used)."""
    if size is None:
        return None
    if size > count:
        warn(f"data.subset.{split}={size:,} is larger than the {split} split of {what} ({count:,} examples); "
             f"using all {count:,}")
    if size >= count:
        return None
    generator = torch.Generator().manual_seed(seed * 7919 + SPLITS.index(split))
    return torch.randperm(count, generator=generator)[:size].sort().values.tolist()


@dataclass
class ClassificationDataConfig:
    """The ``data`` section of classification tasks; ``options``/``train``/``val``/``test`` go to the
    dataset builder (common, then per split), which validates them."""

    data_dir: str | None = None
    max_len: int | None = option(None, ge=1, help="null: the task's; the model's position table has this size")
    pad_to_max_len: bool = option(False, help="pad every batch to max_len (else to its longest sequence)")
    truncate_to_max_len: bool = option(False, help="cut longer sequences to max_len (else they are an error)")
    subset: SubsetConfig = option(default_factory=SubsetConfig)
    options: dict[str, Any] = option(default_factory=dict)
    train: dict[str, Any] = option(default_factory=dict)
    val: dict[str, Any] = option(default_factory=dict)
    test: dict[str, Any] = option(default_factory=dict)


def classification_step(dual: bool, input_key: str = "tokens") -> StepFn:
    """Cross-entropy on the logits of a single- or dual-tower classifier; a single tower reads
    ``batch[input_key]`` (token ids, or e.g. image patches)."""

    def step(model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        if dual:
            logits = model(batch["tokens0"], batch["attention_mask0"], batch["tokens1"], batch["attention_mask1"])
        else:
            logits = model(batch[input_key], batch["attention_mask"])
        # The loss in float32 even under autocast: cross-entropy of bf16 logits is too coarse.
        loss = F.cross_entropy(logits.float(), batch["label"])
        return StepOutput(loss, logits.detach(), batch["label"])

    return step


def _collate_truncated(items: list[Any], collate: Callable[..., Any], max_len: int, pad: bool) -> Any:
    batch = collate(items, pad_to=None)
    fitted = {}
    for key, value in batch.items():
        if value.dim() == 2:  # tokens and masks (also the dual tower's): [B, N]
            value = value[:, :max_len]
            if pad and value.shape[1] < max_len:
                # padded positions are masked out (False), so the token filler is irrelevant
                value = F.pad(value, (0, max_len - value.shape[1]))
        fitted[key] = value
    return fitted


class ClassificationTask(Task):
    family = "classification"
    data_config = ClassificationDataConfig
    model_family = "classifier"
    default_model = "lra_classifier"
    model_input_names = ("vocab_size", "num_classes", "max_len", "dual")
    select_metric = "accuracy"
    select_mode = "max"
    table_scale = 100.0
    vocab_size: int = 0
    num_classes: int = 0
    max_len: int = 0
    dual: bool = False

    def build_split(self, config: Any, split: str, **options: Any) -> Dataset:
        """The dataset of ``split`` built with ``options`` (data.options, then data.<split>)."""
        raise NotImplementedError

    def collate_items(self, items: list[Any], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        return pad_collate(items, pad_to=pad_to)

    def split(self, config: Any, split: str, **extra_options: Any) -> Dataset:
        """One split with the common, per-split and extra options; subsampled if ``data.subset`` says so."""
        data = config.data
        options = {**data.options, **getattr(data, split), **extra_options}
        dataset = self.build_split(config, split, **options)
        indices = subset_indices(len(dataset), getattr(data.subset, split), config.seed, split, config.task)
        return dataset if indices is None else Subset(dataset, indices)

    def model_max_len(self, config: Any) -> int:
        return int(config.data.max_len or self.max_len)

    def make_collate(self, config: Any) -> Callable[[list[Any]], Any]:
        max_len = self.model_max_len(config)
        pad = config.data.pad_to_max_len
        if config.data.truncate_to_max_len:
            return functools.partial(_collate_truncated, collate=self.collate_items, max_len=max_len, pad=pad)
        return functools.partial(self.collate_items, pad_to=max_len if pad else None)

    def build_data(self, config: Any) -> TaskData:
        splits = {name: self.split(config, name) for name in SPLITS}
        return TaskData(splits["train"], splits["val"], splits["test"], self.make_collate(config))

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "num_classes": self.num_classes,
                "max_len": self.model_max_len(config), "dual": self.dual}

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return classification_step(self.dual)

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        return {"accuracy": accuracy}
