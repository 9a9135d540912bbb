"""Multi-query associative recall (Zoology's MQAR) as a task of the one run path.

The data are generated from the run's seed (:mod:`longattn.data.mqar`; each split its own stream, nothing to
download), the model is Zoology's (:mod:`longattn.models.recall`) with any registered mechanism, and the loss
and accuracy are taken at the query positions only: cross-entropy over the whole vocabulary there, accuracy =
the fraction of queries whose most likely token is the value paired with the queried key.

Mechanisms with a causal form run it as Zoology does, as next-token prediction; the others read the whole
sequence and classify each query position (``model.causal`` forces one form). The answers are written nowhere
in the input but in their pairs of the context, so neither form can see one at a position that must predict it.

Training defaults (:attr:`MQARTask.overlay`) are Zoology's Figure 2 settings: AdamW with weight decay 0.1, a
cosine schedule without warmup, validation after every epoch and a stop at 99% validation accuracy; the
presets in ``configs/mqar`` set the data sizes, epochs and batch (``paper``: Zoology's; ``cpu``: smaller).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.config import ConfigError, option
from longattn.data.mqar import MQARDataset, check_settings, collate, multiquery_ar
from longattn.models.recall import resolve_causal
from longattn.tasks.base import Task, TaskData, register_task
from longattn.train.loop import MetricFn, StepFn, StepOutput

__all__ = ["MQAR_CONFIGS", "MQARDataConfig", "MQARTask", "query_accuracy", "recall_step"]

MQAR_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "mqar"
_SPLITS = ("train", "val", "test")


@dataclass
class MQARDataConfig:
    """The ``data`` section of an MQAR run: the generator's settings and the split sizes."""

    seq_len: int = option(64, ge=4, help="tokens per sequence (even)")
    num_kv_pairs: int = option(4, ge=1, help="key-value pairs in the context, each queried once")
    vocab_size: int = option(8192, ge=4, help="keys from the first half, values from the second (Zoology: 8,192)")
    power_a: float = option(0.01, gt=0, help="query slot g has probability proportional to (g + 1) ** (power_a - 1)")
    random_non_queries: bool = option(False, help="fill the query region's empty positions with random tokens "
                                      "(false: token 0, as Zoology's Figure 2)")
    train_examples: int = option(100_000, ge=1)
    val_examples: int = option(3_000, ge=1)
    test_examples: int = option(3_000, ge=1)


def recall_step(model: nn.Module, batch: dict[str, Tensor]) -> StepOutput:
    """Cross-entropy over the vocabulary at the query positions; predictions are the argmax token ids [B, K]."""
    logits = model(batch["tokens"], batch["query_positions"])
    # In float32 even under autocast: cross-entropy of bf16 logits over 8,192 classes is too coarse.
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch["answers"].flatten())
    return StepOutput(loss, logits.detach().argmax(-1), batch["answers"])


def query_accuracy(predictions: Tensor, targets: Tensor) -> float:
    """Fraction of queries answered with their value (every example has the same number of queries)."""
    return float((predictions.long() == targets).double().mean()) if targets.numel() else float("nan")


@register_task("mqar", description="multi-query associative recall (Zoology), generated from the seed")
class MQARTask(Task):
    family = "recall"
    description = "multi-query associative recall (Zoology), generated from the seed"
    data_config = MQARDataConfig
    model_family = "recall"
    default_model = "zoology"
    model_input_names = ("vocab_size", "max_len")
    select_metric = "accuracy"
    select_mode = "max"
    table_scale = 100.0
    preset_dir = MQAR_CONFIGS
    overlay = {
        "optim": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": 0},
        "train": {"epochs": 64, "batch_size": 512, "eval_every_epoch": True, "stop_at": 0.99},
    }

    def build_data(self, config: Any) -> TaskData:
        data = config.data
        try:
            check_settings(data.seq_len, data.num_kv_pairs, data.vocab_size)
        except ValueError as err:
            raise ConfigError(f"data: {err}") from None
        sizes = {"train": data.train_examples, "val": data.val_examples, "test": data.test_examples}
        # One independent stream per (run seed, split): the splits never share a draw.
        splits = {split: MQARDataset(multiquery_ar(
            sizes[split], data.seq_len, data.num_kv_pairs, vocab_size=data.vocab_size, power_a=data.power_a,
            random_non_queries=data.random_non_queries, seed=np.random.SeedSequence([config.seed, index])))
            for index, split in enumerate(_SPLITS)}
        return TaskData(splits["train"], splits["val"], splits["test"], collate,
                        info={"queries_per_example": data.num_kv_pairs})

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        return {"vocab_size": config.data.vocab_size, "max_len": config.data.seq_len}

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return recall_step

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        return {"accuracy": query_accuracy}

    def form(self, config: Any) -> str:
        """"causal" (next-token prediction) or "bidirectional" (token classification) for this run."""
        causal = resolve_causal(config.attention, config.model.get("causal"))
        return "causal" if causal else "bidirectional"

    def describe(self, config: Any, data: TaskData, results: dict[str, Any]) -> dict[str, Any]:
        d = config.data
        return {"form": self.form(config), "seq_len": d.seq_len, "num_kv_pairs": d.num_kv_pairs,
                "width": config.model.get("dim")}

    def validation_line(self, record: dict[str, Any]) -> str | None:
        return (f"epoch {record['epoch']} step {record['step']}: val accuracy {100 * record['accuracy']:.2f}% "
                f"loss {record['loss']:.4f}")
