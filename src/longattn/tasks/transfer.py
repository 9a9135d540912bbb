"""Transfer learning (SKTformer / S^3 Table 3): MLM pretraining (``mlm``) and the GLUE tasks (``glue_<name>``).

* ``mlm``: BERT's masked-language-model loss on a plain-text corpus (:mod:`longattn.data.mlm`, WikiText-2
  by default) with the ``bert_mlm`` model; validation reports the loss, perplexity and accuracy of the
  masked predictions on positions masked once per split (the same for every model).
* ``glue_cola``, ``glue_sst2``, ``glue_mrpc``, ``glue_stsb``, ``glue_qqp``, ``glue_mnli``, ``glue_qnli``,
  ``glue_rte``: fine-tuning on the official ``glue_data/`` files (:mod:`longattn.data.glue`) with the
  ``bert_glue`` model; train on ``train.tsv``, validate (select the epoch and report, as the papers'
  "GLUE validation results") on ``dev.tsv`` (MNLI: matched); the test files have no labels, so no test.
  Every official metric of the task is reported; the one Table 3 shows selects.

Presets live in ``configs/transfer/{mlm,glue}/`` (``paper``: Table 15; ``cpu``: minutes on one core).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

from longattn import metrics as metric_registry
from longattn.config import ConfigError, option
from longattn.data import glue, mlm, wordpiece
from longattn.hf import bert  # noqa: F401  (registers the bert_mlm and bert_glue models)
from longattn.tasks.base import Task, TaskData, register_task
from longattn.tasks.classification import SubsetConfig, subset_indices
from longattn.train.loop import MetricFn, StepFn, StepOutput

TRANSFER_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "transfer"
SPLITS = ("train", "val", "test")


def _subset(dataset: Dataset, size: int | None, seed: int, split: str, what: str) -> Dataset:
    keep = subset_indices(len(dataset), size, seed, split, what)
    return dataset if keep is None else Subset(dataset, keep)


def _example_subset(examples: glue.GlueSplit, size: int | None, seed: int, split: str, what: str) -> glue.GlueSplit:
    """The same subset of raw GLUE examples, taken before tokenising (SST-2 has 67k examples)."""
    keep = subset_indices(len(examples), size, seed, split, what)
    if keep is None:
        return examples
    pick = lambda texts: [texts[i] for i in keep]  # noqa: E731
    return dataclasses.replace(examples, first=pick(examples.first),
                               second=pick(examples.second) if examples.second is not None else None,
                               labels=examples.labels[keep] if examples.labels is not None else None)


def _data_dir(config: Any, what: str) -> Path:
    if not config.data.data_dir:
        raise ConfigError(f"set data.data_dir (--set data.data_dir=DIR) to the folder of {what}")
    return Path(config.data.data_dir)


# ----------------------------------------------------------------------------- MLM pretraining


@dataclass
class MLMDataConfig:
    """The ``data`` section of ``mlm``: a corpus folder with one text file per split."""

    data_dir: str | None = option(None, help="folder of the corpus files (e.g. WikiText-2's)")
    train_file: str = "wiki.train.tokens"
    val_file: str | None = option("wiki.valid.tokens", help="null: no validation")
    test_file: str | None = option("wiki.test.tokens", help="null: no test")
    tokenizer: str | None = option(None, help="tokenizer.json (or its folder); null: MiniLM's uncased WordPiece")
    max_len: int = option(128, ge=3, help="block length in WordPieces, [CLS] and [SEP] included")
    mask_probability: float = option(0.15, gt=0, lt=1, help="BERT's 15% (of which 80/10/10 mask/random/keep)")
    eval_mask_seed: int = option(0, help="seed of the fixed masks of the validation and test blocks")
    subset: SubsetConfig = option(default_factory=SubsetConfig, help="seeded random subsets, in blocks")


def mlm_metrics() -> dict[str, MetricFn]:
    """Perplexity and accuracy of the masked predictions ([M, 2] rows: negative log-likelihood, correct)."""
    return {
        "perplexity": lambda predictions, targets: float(predictions[:, 0].double().mean().exp()),
        "mlm_accuracy": lambda predictions, targets: float(predictions[:, 1].double().mean()),
    }


def mlm_step(masker: mlm.Masker) -> StepFn:
    """Cross-entropy over the masked positions; training batches are masked here, evaluation ones come masked."""

    def step(model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        if "labels" in batch:
            inputs, labels = batch["input_ids"], batch["labels"]
        else:
            inputs, labels = masker(batch["input_ids"], batch["attention_mask"])
        predict = labels != mlm.IGNORE
        logits = model(inputs, batch["attention_mask"], predict).float()  # loss in float32 under autocast
        targets = labels[predict]
        nll = F.cross_entropy(logits, targets, reduction="none")
        # predictions for the metrics: per-token NLL and hit, not [M, vocab] logits of a whole split
        rows = torch.stack([nll.detach(), (logits.detach().argmax(-1) == targets).float()], dim=1)
        return StepOutput(nll.mean(), rows, targets)

    return step


@register_task("mlm", description="BERT masked-language-model pretraining on a plain-text corpus (WikiText-2)")
class MLMTask(Task):
    family = "pretraining"
    data_config = MLMDataConfig
    overlay = {
        "optim": {"lr": 1e-4, "weight_decay": 0.01, "schedule": "linear"},
        "train": {"clip_norm": 1.0},
    }
    model_family = "mlm"
    default_model = "bert_mlm"
    model_input_names = ("vocab_size", "max_len")
    select_metric = "perplexity"
    select_mode = "min"
    preset_dir = TRANSFER_CONFIGS / "mlm"

    def _tokenizer(self, config: Any) -> Any:
        return wordpiece.load_wordpiece(config.data.tokenizer)

    def build_data(self, config: Any) -> TaskData:
        data = config.data
        folder = _data_dir(config, "the corpus (e.g. ../shared/data/wikitext2)")
        tokenizer = self._tokenizer(config)
        splits: dict[str, Dataset | None] = {}
        for split, name in zip(SPLITS, (data.train_file, data.val_file, data.test_file)):
            if name is None:
                splits[split] = None
                continue
            blocks = mlm.token_blocks(mlm.read_lines(folder / name), tokenizer, data.max_len)
            dataset = (mlm.MLMBlocks(blocks) if split == "train" else
                       mlm.masked_split(blocks, tokenizer, data.mask_probability, data.eval_mask_seed))
            splits[split] = _subset(dataset, getattr(data.subset, split), config.seed, split, f"{name} (in blocks)")
        info = {"vocab_size": tokenizer.get_vocab_size(), "masker": mlm.Masker(tokenizer, data.mask_probability)}
        return TaskData(splits["train"], splits["val"], splits["test"], mlm.collate_blocks, info)

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        return {"vocab_size": data.info["vocab_size"], "max_len": config.data.max_len}

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return mlm_step(data.info["masker"])

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        return mlm_metrics()

    def describe(self, config: Any, data: TaskData, results: dict[str, Any]) -> dict[str, Any]:
        return {"blocks": {split: len(d) for split, d in zip(SPLITS, (data.train, data.val, data.test)) if d},
                "block_tokens": config.data.max_len}


# ----------------------------------------------------------------------------- GLUE fine-tuning


@dataclass
class GlueDataConfig:
    """The ``data`` section of the GLUE tasks."""

    data_dir: str | None = option(None, help="the glue_data/ folder (or the task's own folder)")
    max_len: int = option(glue.MAX_LENGTH, ge=5, help="WordPieces per example (Table 15: 128)")
    tokenizer: str | None = option(None, help="tokenizer.json (or its folder); null: MiniLM's uncased WordPiece")
    subset: SubsetConfig = option(default_factory=SubsetConfig)


def glue_step(regression: bool) -> StepFn:
    """Cross-entropy over the labels, or mean squared error of the score (STS-B), as BERT fine-tunes."""

    def step(model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]).float()
        if regression:
            scores = logits[:, 0]
            return StepOutput(F.mse_loss(scores, batch["labels"]), scores.detach(), batch["labels"])
        return StepOutput(F.cross_entropy(logits, batch["labels"]), logits.detach(), batch["labels"])

    return step


def _glue_metric(name: str, regression: bool, predictions: torch.Tensor, targets: torch.Tensor) -> float:
    predicted = predictions if regression else predictions.argmax(-1)
    return metric_registry.compute(name, predicted, targets)


class GlueFinetuneTask(Task):
    family = "glue"
    data_config = GlueDataConfig
    overlay = {  # SKTformer / S^3 Table 15 (GLUE column); weight decay as BERT's fine-tuning
        "optim": {"lr": 1e-4, "weight_decay": 0.01, "schedule": "linear", "warmup_steps": 0},
        "train": {"batch_size": 32, "epochs": 4, "eval_every_epoch": True, "clip_norm": 1.0},
    }
    model_family = "glue"
    default_model = "bert_glue"
    model_input_names = ("vocab_size", "num_labels", "max_len")
    select_mode = "max"
    table_scale = 100.0
    preset_dir = TRANSFER_CONFIGS / "glue"
    glue_name = ""

    @property
    def glue(self) -> glue.GlueTask:
        return glue.get_glue_task(self.glue_name)

    @property
    def select_metric(self) -> str:  # type: ignore[override]
        return self.glue.paper_metric

    def build_data(self, config: Any) -> TaskData:
        data = config.data
        folder = _data_dir(config, "GLUE (glue_data/, e.g. ../shared/data/glue)")
        tokenizer = wordpiece.load_wordpiece(data.tokenizer)
        train, dev = (glue.GlueDataset(_example_subset(glue.read_glue(self.glue_name, name, folder),
                                                       getattr(data.subset, split), config.seed, split,
                                                       f"{self.glue.folder}/{name}.tsv"),
                                       tokenizer, data.max_len)
                      for name, split in (("train", "train"), ("dev", "val")))
        collate = functools.partial(glue.collate_glue, pad_id=train.pad_id)
        return TaskData(train, dev, None, collate, {"vocab_size": train.vocab_size})

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        return {"vocab_size": data.info["vocab_size"], "num_labels": self.glue.num_labels,
                "max_len": config.data.max_len}

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return glue_step(self.glue.is_regression)

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        regression = self.glue.is_regression
        return {name: functools.partial(_glue_metric, name, regression) for name in self.glue.metrics}

    def describe(self, config: Any, data: TaskData, results: dict[str, Any]) -> dict[str, Any]:
        return {"majority_class": majority_class_scores(self.glue, data.train.labels, data.val.labels)}


def majority_class_scores(task: glue.GlueTask, train_labels: Any, dev_labels: Any) -> dict[str, float] | None:
    """The dev metrics of always answering the most frequent training label: what a model that learned nothing
    from the text scores (on MRPC, F1 81 by always answering "paraphrase"). None for a regression (STS-B): the
    correlations of a constant are undefined, and 0 is their floor."""
    if task.is_regression:
        return None
    majority = int(torch.as_tensor(train_labels).bincount(minlength=task.num_labels).argmax())
    logits = F.one_hot(torch.full((len(dev_labels),), majority), task.num_labels).float()
    return {name: _glue_metric(name, False, logits, torch.as_tensor(dev_labels)) for name in task.metrics}


for _name in glue.GLUE_TASKS.names():
    _text = f"GLUE {glue.get_glue_task(_name).folder} fine-tuning (official glue_data/ files)"
    register_task(f"glue_{_name}", description=_text)(
        type(f"Glue_{_name}", (GlueFinetuneTask,), {"glue_name": _name, "description": _text}))
