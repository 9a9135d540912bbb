"""Long Range Arena runs: config -> datasets + model -> :class:`~longattn.train.loop.Trainer`.

The data come from ``longattn.data.lra`` (``get_task``, ``build_dataset``, ``collate``); any
object with those three callables can stand in for it (``data_api=``), which the tests use.
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from longattn.models.classifier import build_classifier
from longattn.train.checkpoint import load_checkpoint
from longattn.train.config import load_config, save_config, validate
from longattn.train.loop import StepOutput, Trainer, TrainSettings, accuracy, evaluate
from longattn.train.distributed import resolve_device
from longattn.utils import dumps_strict, seed_everything

LRA_TASK_NAMES = ("listops", "text", "retrieval", "image", "pathfinder")
SPLITS = ("train", "val", "test")


def lra_data_api() -> ModuleType:
    """``longattn.data.lra``, with a clear error when the data module is not installed."""
    try:
        return importlib.import_module("longattn.data.lra")
    except ImportError as err:
        raise ValueError(f"the LRA data module longattn.data.lra is not available: {err}") from err


def build_datasets(config: dict[str, Any], data_api: Any) -> tuple[Any, dict[str, Any]]:
    """The task description and its train/val/test datasets, built with the config's data options."""
    task = data_api.get_task(config["task"])
    datasets = {split: build_split(config, data_api, split) for split in SPLITS}
    return task, datasets


def build_split(config: dict[str, Any], data_api: Any, split: str, **extra_options: Any) -> Any:
    """One split with the common, per-split and extra options; subsampled if ``data.subset`` says so."""
    data = config["data"]
    options = {**data["options"], **data[split], **extra_options}
    dataset = data_api.build_dataset(config["task"], split=split, data_dir=data["data_dir"], **options)
    size = data["subset"][split]
    if size is not None and size < len(dataset):
        # A seeded random subset (not the first rows: files are often sorted by label).
        generator = torch.Generator().manual_seed(config["seed"] * 7919 + SPLITS.index(split))
        indices = torch.randperm(len(dataset), generator=generator)[:size].sort().values.tolist()
        dataset = torch.utils.data.Subset(dataset, indices)
    return dataset


def model_max_len(config: dict[str, Any], task: Any) -> int:
    return int(config["data"]["max_len"] or task.max_len)


def attention_options(config: dict[str, Any]) -> dict[str, Any]:
    """The options of the configured mechanism (``attention_options.<name>``)."""
    return dict(config["attention_options"].get(config["attention"], {}))


def build_model(config: dict[str, Any], task: Any) -> nn.Module:
    return build_classifier(
        vocab_size=task.vocab_size,
        num_classes=task.num_classes,
        max_len=model_max_len(config, task),
        dual=task.dual,
        attention=config["attention"],
        attention_options=attention_options(config),
        **config["model"],
    )


def classification_step(dual: bool) -> Callable[[nn.Module, dict[str, Any]], StepOutput]:
    """Cross-entropy on the logits of a single- or dual-tower classifier."""

    def step(model: nn.Module, batch: dict[str, Any]) -> StepOutput:
        if dual:
            logits = model(batch["tokens0"], batch["attention_mask0"], batch["tokens1"], batch["attention_mask1"])
        else:
            logits = model(batch["tokens"], batch["attention_mask"])
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
                value = torch.nn.functional.pad(value, (0, max_len - value.shape[1]))
        fitted[key] = value
    return fitted


def make_collate(config: dict[str, Any], task: Any, data_api: Any) -> Callable[[list[Any]], Any]:
    max_len = model_max_len(config, task)
    pad = bool(config["data"]["pad_to_max_len"])
    if config["data"]["truncate_to_max_len"]:
        return functools.partial(_collate_truncated, collate=data_api.collate, max_len=max_len, pad=pad)
    return functools.partial(data_api.collate, pad_to=max_len if pad else None)


def run_info(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "task": config["task"],
        "attention": config["attention"],
        "options": attention_options(config),
        "config": config,
    }


def run_lra(
    config: dict[str, Any],
    out_dir: str | Path,
    resume: bool = False,
    data_api: Any = None,
    on_step_end: Callable[[Trainer, int], None] | None = None,
    dataset_cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``config`` (see longattn.train.config) into ``out_dir``; returns the results dict.

    The config is saved as ``out_dir/config.yaml`` next to ``results.json``. Runs that share a
    ``dataset_cache`` dict (e.g. the mechanisms of one comparison) build identical datasets once.
    """
    validate(config)
    if config["task"] is None:
        raise ValueError("the config names no task")
    data_api = data_api or lra_data_api()
    out_dir = Path(out_dir)
    cache_key = json.dumps([config["task"], config["seed"], config["data"]], sort_keys=True, default=str)
    if dataset_cache is not None and cache_key in dataset_cache:
        task, datasets = dataset_cache[cache_key]
    else:
        task, datasets = build_datasets(config, data_api)
        if dataset_cache is not None:
            dataset_cache.clear()  # hold one task's data at a time (full LRA splits are large)
            dataset_cache[cache_key] = (task, datasets)
    seed_everything(config["seed"])  # identical initial weights on every rank and every resume
    model = build_model(config, task)
    trainer = Trainer(
        model, datasets["train"], datasets["val"], datasets["test"],
        collate_fn=make_collate(config, task, data_api),
        step_fn=classification_step(task.dual),
        metrics={"accuracy": accuracy},
        settings=TrainSettings.from_config(config),
        out_dir=out_dir,
        run_info=run_info(config),
        on_step_end=on_step_end,
    )
    if trainer.dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, out_dir / "config.yaml")
    return trainer.fit(resume=resume)


def load_run_config(out_dir: str | Path) -> dict[str, Any]:
    """The config saved by :func:`run_lra` in ``out_dir`` (for ``--resume`` and ``eval``)."""
    path = Path(out_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {out_dir} the --out folder of a training run?")
    return load_config(config_file=path)


def evaluate_run(
    out_dir: str | Path,
    split: str = "test",
    checkpoint: str = "best",
    data_api: Any = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate the ``best``/``last`` (or a path) checkpoint of a finished run on ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    config = load_run_config(out_dir)
    data_api = data_api or lra_data_api()
    task = data_api.get_task(config["task"])
    dataset = build_split(config, data_api, split, **(overrides or {}))
    model = build_model(config, task)
    path = Path(out_dir) / "checkpoints" / f"{checkpoint}.pt" if checkpoint in ("best", "last") else Path(checkpoint)
    device = resolve_device(config["train"]["device"])
    model.load_state_dict(load_checkpoint(path, map_location="cpu")["model"])
    model.to(device)
    result = evaluate(
        model, dataset, make_collate(config, task, data_api), classification_step(task.dual), {"accuracy": accuracy},
        batch_size=config["train"]["eval_batch_size"] or config["train"]["batch_size"], device=device,
        precision=config["train"]["precision"], split=split,
    )
    return {"task": config["task"], "attention": config["attention"], "split": split,
            "checkpoint": str(path), "data_overrides": overrides or {}, **result}


def write_json(obj: Any, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dumps_strict(obj, indent=2, default=str))  # NaN/inf as null: standard JSON

