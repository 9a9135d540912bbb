"""Singularformer's document classification benchmarks (Wu et al., IJCAI 2023, section 4) as tasks.

One task per dataset of its Table 4 (loaders in :mod:`longattn.data.textcls`, CIFAR-100 in
:mod:`longattn.data.image`): ``r8``, ``bbc``, ``20news``, ``imdb``, ``scope95``, ``scope40``
(tokens), ``mimic3_50`` (multi-label: binary cross-entropy, selected on micro-F1) and ``cifar100``
(256 tokens of 2x2x3 pixels). The ``data`` section adds the fold of the
paper's 5-fold cross-validation: ``data.fold=k`` trains on the other folds of the training set and
validates on fold k (the best epoch is kept); the test set is the dataset's own (BBC and SCOPe: a
seeded stratified holdout). ``data.fold=null`` trains on the whole training set without validation.
``longattn crossval`` (:mod:`longattn.experiment.crossval`) runs every fold and reports mean ± std.

Presets (``configs/doccls/``): ``paper`` (Table 2), ``cpu`` (minutes on a CPU core per fold on R8),
``cpu_reduced`` (the cpu schedule at half the width, on shorter documents and fewer of them, for IMDb and
the long sets).
The models are the seven of Table 4 (:mod:`longattn.models.doc_classifier`); the default is
``singularformer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

from longattn import metrics
from longattn.config import option
from longattn.data.common import read_once
from longattn.data.image import (CIFAR100_PATCH_DIM, CIFAR100_TOKENS, build_cifar10_patches, build_cifar100,
                                 collate_patches)
from longattn.data.textcls import build_textcls, collate_textcls, get_textcls
from longattn.tasks.base import TaskData, register_task
from longattn.tasks.classification import ClassificationDataConfig, ClassificationTask, classification_step
from longattn.train.loop import MetricFn, StepFn, StepOutput

__all__ = ["DOCCLS_CONFIGS", "DocDataConfig", "DocClassificationTask", "MultiLabelDocTask", "PatchClassificationTask"]

DOCCLS_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "doccls"


@dataclass
class DocDataConfig(ClassificationDataConfig):
    """The ``data`` section of the document classification tasks: the classification options plus the
    cross-validation fold. ``max_len`` (null: the paper's length of the dataset) also truncates documents."""

    fold: int | None = option(0, ge=0, help="validation fold of the cross-validation (the others train); "
                              "null: train on the whole training set, no validation")
    num_folds: int = option(5, ge=2, help="folds of the cross-validation (the paper: 5)")
    fold_seed: int = option(0, ge=0, help="seed of the fold split (and of the test holdout of BBC and SCOPe)")
    min_count: int = option(1, ge=1, help="words seen fewer times in the training set are read as [UNK] "
                            "(word tokenizer; 5 is Text GCN's cleaning of R8)")


def _base(dataset: Dataset) -> Any:
    """The dataset under a ``data.subset`` wrapper (vocabulary and classes live there)."""
    return dataset.dataset if isinstance(dataset, Subset) else dataset


class DocClassificationTask(ClassificationTask):
    """A dataset of :mod:`longattn.data.textcls` (single-label) with the cross-validation folds."""

    family = "doccls"
    data_config = DocDataConfig
    default_model = "singularformer"
    model_input_names = ("vocab_size", "input_dim", "num_classes", "max_len")
    preset_dir = DOCCLS_CONFIGS
    dataset: str = ""

    @property
    def max_len(self) -> int:  # type: ignore[override]
        return get_textcls(self.dataset).max_length

    def fold_options(self, config: Any) -> dict[str, Any]:
        data = config.data
        return {"fold": data.fold, "num_folds": data.num_folds, "seed": data.fold_seed}

    def build_split(self, config: Any, split: str, **options: Any) -> Dataset:
        return build_textcls(self.dataset, split, config.data.data_dir, max_length=self.model_max_len(config),
                             min_count=config.data.min_count, **self.fold_options(config), **options)

    def has_validation(self, config: Any) -> bool:
        return config.data.fold is not None or get_textcls(self.dataset).official_dev

    def build_data(self, config: Any) -> TaskData:
        with read_once():  # every split reads the training documents (vocabulary, folds): from disk once
            train = self.split(config, "train")
            val = self.split(config, "val") if self.has_validation(config) else None
            test = self.split(config, "test")
        base = _base(train)
        info = {"num_classes": base.num_classes, "vocab_size": getattr(base, "vocab_size", 0),
                "input_dim": getattr(base, "patch_dim", None)}
        return TaskData(train, val, test, self.make_collate(config), info)

    def collate_items(self, items: list[Any], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        return collate_textcls(items, pad_to=pad_to)  # padding is marked by the mask, whatever the pad id

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        inputs = {"vocab_size": data.info["vocab_size"], "num_classes": data.info["num_classes"],
                  "max_len": self.model_max_len(config)}
        if data.info["input_dim"] is not None:
            inputs["input_dim"] = data.info["input_dim"]
        return inputs


class PatchClassificationTask(DocClassificationTask):
    """CIFAR-100 (or CIFAR-10, its stand-in) as 256 tokens, each a 2x2 pixel patch (12 values in [0, 1])
    embedded by a linear map."""

    max_len = CIFAR100_TOKENS  # type: ignore[assignment]
    build_patches = staticmethod(build_cifar100)

    def build_split(self, config: Any, split: str, **options: Any) -> Dataset:
        return self.build_patches(split, config.data.data_dir, **self.fold_options(config), **options)

    def has_validation(self, config: Any) -> bool:
        return config.data.fold is not None

    def make_collate(self, config: Any) -> Callable[[list[Any]], Any]:
        return collate_patches

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return classification_step(dual=False, input_key="patches")


def _multilabel_metric(name: str) -> MetricFn:
    """A :mod:`longattn.metrics` multi-label score of the logits, each label predicted where sigmoid > 0.5."""

    def score(logits: torch.Tensor, targets: torch.Tensor) -> float:
        return metrics.compute(name, (logits > 0).long(), targets.long())

    return score


def multilabel_step(model: nn.Module, batch: dict[str, Any]) -> StepOutput:
    """Binary cross-entropy per label on the logits (multi-hot float targets)."""
    logits = model(batch["tokens"], batch["attention_mask"])
    loss = F.binary_cross_entropy_with_logits(logits.float(), batch["label"].float())
    return StepOutput(loss, logits.detach(), batch["label"])


class MultiLabelDocTask(DocClassificationTask):
    """MIMIC-III 50: one sigmoid per code, binary cross-entropy, selected on micro-F1.

    The paper reports an "ACC" for MIMIC-III 50 without saying what it is for several labels; the
    metrics here are micro-F1 (selection), macro-F1 and subset accuracy (``accuracy``: every code right).
    """

    select_metric = "micro_f1"

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return multilabel_step

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        return {name: _multilabel_metric(name) for name in ("micro_f1", "macro_f1", "accuracy")}


_DATASETS = {
    "r8": "R8: Reuters-21578 news, 8 topics (max length 141)",
    "bbc": "BBC News, 5 topics (max length 664)",
    "20news": "20 Newsgroups bydate, 20 groups (max length 700)",
    "imdb": "IMDb movie reviews, word tokens, 2 classes (max length 539)",
    "scope95": "SCOPe 2.x at 95% identity: protein fold from the amino acids (max length 328)",
    "scope40": "SCOPe 2.x at 40% identity: protein fold from the amino acids (max length 337)",
}
for _name, _text in _DATASETS.items():
    register_task(_name, description=_text)(
        type(f"DocCls_{_name}", (DocClassificationTask,), {"dataset": _name, "description": _text}))
register_task("mimic3_50", description="MIMIC-III top-50 ICD-9 codes, multi-label (max length 1024; "
              "credentialed data, CAML's *_50.csv files)")(
    type("DocCls_mimic3_50", (MultiLabelDocTask,), {"dataset": "mimic3_50"}))
register_task("cifar100", description=f"CIFAR-100 as {CIFAR100_TOKENS} tokens of 2x2 pixel patches "
              f"({CIFAR100_PATCH_DIM} values each), 100 classes")(
    type("DocCls_cifar100", (PatchClassificationTask,), {"dataset": "cifar100"}))
register_task("cifar10", description=f"CIFAR-10 as {CIFAR100_TOKENS} tokens of 2x2 pixel patches, 10 classes "
              "(the CIFAR-100 layout; a stand-in where CIFAR-100 is absent)")(
    type("DocCls_cifar10", (PatchClassificationTask,), {"dataset": "cifar10",
                                                          "build_patches": staticmethod(build_cifar10_patches)}))
