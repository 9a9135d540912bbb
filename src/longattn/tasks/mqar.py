"""Multi-query associative recall (Zoology's MQAR) as a task of the one run path.

The data are generated from the run's seed (:mod:`longattn.data.mqar`; each split its own stream, nothing to
download), the model is Zoology's (:mod:`longattn.models.recall`) with any registered mechanism, and the loss
and accuracy are taken at the query positions only: cross-entropy over the whole vocabulary there, accuracy =
the fraction of queries whose most likely token is the value paired with the queried key.

Mechanisms with a causal form run it as Zoology does, as next-token prediction; the others read the whole
sequence and classify each query position (``model.causal`` forces one form). The answers are written nowhere
in the input but in their pairs of the context, so neither form can see one at a position that must predict it.

A run trains on one ``(seq_len, num_kv_pairs)`` (Zoology's Figure 2) or on a mixture of them
(``data.train_mix``, as Zoology's later MQAR configs: 100,000 sequences of (64, 4) and 20,000 of each longer
one), and is validated and tested on every ``data.eval_lengths`` configuration: the selection metric
``accuracy`` is the mean over all their sequences (Zoology's ``valid/accuracy``), ``accuracy_<N>x<K>`` the
accuracy at one of them (Zoology's slices by ``num_kv_pairs``).

Training defaults (:attr:`MQARTask.overlay`) are Zoology's Figure 2 settings: AdamW with weight decay 0.1, a
cosine schedule without warmup, validation after every epoch and a stop at 99% validation accuracy; the
presets in ``configs/mqar`` set the data sizes, epochs and batch (``paper``: Zoology's; ``cpu``: smaller).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.config import ConfigError, option
from longattn.data.mqar import IGNORE, MQARDataset, check_settings, collate, multiquery_ar
from longattn.models.recall import resolve_causal
from longattn.tasks.base import Task, TaskData, register_task
from longattn.train.loop import MetricFn, StepFn, StepOutput

__all__ = ["MQAR_CONFIGS", "MQARDataConfig", "MQARSegment", "MQARTask", "eval_lengths", "length_metric",
           "query_accuracy", "recall_step", "train_segments"]

MQAR_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "mqar"
_SPLITS = ("train", "val", "test")


@dataclass
class MQARSegment:
    """One part of a training mixture: ``examples`` sequences of ``seq_len`` tokens with ``num_kv_pairs`` pairs."""

    seq_len: int = option(64, ge=4, help="tokens per sequence (even)")
    num_kv_pairs: int = option(4, ge=1, help="key-value pairs in the context")
    examples: int = option(100_000, ge=1, help="training sequences of this configuration")


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
    val_examples: int = option(3_000, ge=1, help="validation sequences per evaluated configuration")
    test_examples: int = option(3_000, ge=1, help="test sequences per evaluated configuration")
    train_mix: list[MQARSegment] = option([], help="train on these {seq_len, num_kv_pairs, examples} together "
                                          "(Zoology's mixtures); empty: seq_len, num_kv_pairs, train_examples")
    eval_lengths: list[list[int]] = option([], help="[seq_len, num_kv_pairs] configurations validated and tested "
                                           "(each its own accuracy); empty: the training configurations")


def train_segments(data: MQARDataConfig) -> list[tuple[int, int, int]]:
    """(seq_len, num_kv_pairs, examples) of every training segment."""
    if not data.train_mix:
        return [(data.seq_len, data.num_kv_pairs, data.train_examples)]
    return [(s.seq_len, s.num_kv_pairs, s.examples) for s in data.train_mix]


def eval_lengths(data: MQARDataConfig) -> list[tuple[int, int]]:
    """(seq_len, num_kv_pairs) of every validated and tested configuration, in order."""
    if data.eval_lengths:
        return [(int(n), int(k)) for n, k in data.eval_lengths]
    return list(dict.fromkeys((n, k) for n, k, _ in train_segments(data)))


def length_metric(seq_len: int, num_kv_pairs: int) -> str:
    """The metric name of the accuracy at one evaluated configuration, e.g. ``accuracy_256x16``."""
    return f"accuracy_{seq_len}x{num_kv_pairs}"


def _check_data(data: MQARDataConfig) -> None:
    """Every configuration the generator can draw, no segment twice, evaluated ones told apart by their pairs."""
    for index, entry in enumerate(data.eval_lengths):
        if len(entry) != 2:
            raise ConfigError(f"data.eval_lengths[{index}] must be [seq_len, num_kv_pairs], got {entry!r}")
    trained, evaluated = train_segments(data), eval_lengths(data)
    for where, configs in (("data.train_mix", [(n, k) for n, k, _ in trained]), ("data.eval_lengths", evaluated)):
        for n, k in configs:
            try:
                check_settings(n, k, data.vocab_size)
            except ValueError as err:
                raise ConfigError(f"{where} ({n}, {k}): {err}") from None
        if len(set(configs)) != len(configs):
            raise ConfigError(f"{where} names a (seq_len, num_kv_pairs) twice: {configs}")
    pairs = [k for _, k in evaluated]
    if len(set(pairs)) != len(pairs):
        # a scored row is known by its number of queries (Zoology's slices by num_kv_pairs)
        raise ConfigError(f"data.eval_lengths must differ in num_kv_pairs (each configuration's accuracy is told "
                          f"apart by its number of queries), got {evaluated}")


def recall_step(model: nn.Module, batch: dict[str, Tensor], query_width: int | None = None) -> StepOutput:
    """Cross-entropy over the vocabulary at the query positions; predictions are the argmax token ids [B, K].

    Padded query slots (answer :data:`IGNORE`, after a sequence's own queries) are not scored. Predictions and
    targets come back padded with IGNORE to ``query_width`` (default: the batch's), so that the batches of an
    evaluation, whatever their configuration, have the same width; the model computes logits only at the
    batch's own slots, and nothing is read back to the host (no device sync per step)."""
    answers = batch["answers"]
    width = answers.shape[1] if query_width is None else query_width
    if width < answers.shape[1]:
        raise ValueError(f"query_width={query_width} is below the batch's {answers.shape[1]} query slots")
    logits = model(batch["tokens"], batch["query_positions"])
    # In float32 even under autocast: cross-entropy of bf16 logits over 8,192 classes is too coarse.
    loss = F.cross_entropy(logits.float().flatten(0, 1), answers.flatten(), ignore_index=IGNORE)
    padding = (0, width - answers.shape[1])
    return StepOutput(loss, F.pad(logits.detach().argmax(-1), padding, value=IGNORE),
                      F.pad(answers, padding, value=IGNORE))


def _row_accuracy(predictions: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per sequence: the fraction of its queries answered with their value, and its number of queries."""
    scored = targets != IGNORE
    queries = scored.sum(1)
    right = ((predictions.long() == targets) & scored).sum(1)
    return right.double() / queries.clamp(min=1), queries


def query_accuracy(predictions: Tensor, targets: Tensor) -> float:
    """Mean over sequences of the fraction of their queries answered with their value (Zoology's accuracy; with
    one configuration, the fraction of all queries)."""
    return float(_row_accuracy(predictions, targets)[0].mean()) if targets.numel() else float("nan")


def _accuracy_with(num_kv_pairs: int) -> Any:
    """The accuracy over the sequences with ``num_kv_pairs`` queries (one evaluated configuration)."""
    def accuracy(predictions: Tensor, targets: Tensor) -> float:
        values, queries = _row_accuracy(predictions, targets)
        chosen = values[queries == num_kv_pairs]
        return float(chosen.mean()) if chosen.numel() else float("nan")
    return accuracy


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
        _check_data(data)
        common = {"vocab_size": data.vocab_size, "power_a": data.power_a, "random_non_queries": data.random_non_queries}
        if not data.train_mix and not data.eval_lengths:
            # One configuration: one independent stream per (run seed, split), the splits never share a draw.
            sizes = {"train": data.train_examples, "val": data.val_examples, "test": data.test_examples}
            splits = {split: MQARDataset(multiquery_ar(sizes[split], data.seq_len, data.num_kv_pairs, **common,
                                                       seed=np.random.SeedSequence([config.seed, index])))
                      for index, split in enumerate(_SPLITS)}
        else:
            # A stream per (run seed, split, configuration): a configuration's sequences do not depend on which
            # others the run trains or evaluates on.
            def segment(split: int, n: int, k: int, count: int) -> Any:
                return multiquery_ar(count, n, k, **common, seed=np.random.SeedSequence([config.seed, split, n, k]))
            splits = {"train": MQARDataset([segment(0, n, k, count) for n, k, count in train_segments(data)])}
            for index, (split, count) in enumerate((("val", data.val_examples), ("test", data.test_examples)), 1):
                splits[split] = MQARDataset([segment(index, n, k, count) for n, k in eval_lengths(data)])
        width = max(k for _, k in [*eval_lengths(data), *((n, k) for n, k, _ in train_segments(data))])
        return TaskData(splits["train"], splits["val"], splits["test"], collate, info={"queries_per_example": width})

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        lengths = [n for n, _, _ in train_segments(config.data)] + [n for n, _ in eval_lengths(config.data)]
        return {"vocab_size": config.data.vocab_size, "max_len": max(lengths)}

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return partial(recall_step, query_width=data.info["queries_per_example"])

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        metrics: dict[str, MetricFn] = {"accuracy": query_accuracy}
        evaluated = eval_lengths(config.data)
        if len(evaluated) > 1:
            metrics.update({length_metric(n, k): _accuracy_with(k) for n, k in evaluated})
        return metrics

    def form(self, config: Any) -> str:
        """"causal" (next-token prediction) or "bidirectional" (token classification) for this run."""
        causal = resolve_causal(config.attention, config.model.get("causal"))
        return "causal" if causal else "bidirectional"

    def describe(self, config: Any, data: TaskData, results: dict[str, Any]) -> dict[str, Any]:
        d = config.data
        trained, evaluated = train_segments(d), eval_lengths(d)
        described = {"form": self.form(config), "width": config.model.get("dim")}
        if d.train_mix or d.eval_lengths:
            return {**described, "train_mix": [list(s) for s in trained], "eval_lengths": [list(e) for e in evaluated]}
        return {**described, "seq_len": d.seq_len, "num_kv_pairs": d.num_kv_pairs}

    def validation_line(self, record: dict[str, Any]) -> str | None:
        lengths = "".join(f", {key[len('accuracy_'):]} {100 * value:.1f}%" for key, value in record.items()
                          if key.startswith("accuracy_"))
        return (f"epoch {record['epoch']} step {record['step']}: val accuracy {100 * record['accuracy']:.2f}% "
                f"loss {record['loss']:.4f}{lengths}")
