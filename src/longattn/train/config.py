"""Nested configs for LRA runs: defaults, YAML presets, ``--set a.b=value`` overrides, strict keys.

A config is a plain nested dict. :data:`DEFAULTS` lists every valid key; loading rejects any
other key with an error that names it and the valid ones, so a typo never silently falls back
to a default. A few sections are free-form because their keys belong to another component
that validates them itself:

* ``attention_options.<mechanism>``: options passed to ``longattn.attention.build`` when that
  mechanism is trained (build rejects unknown ones); one config can hold every mechanism's
  paper options, and a run uses only the entry of its own mechanism.
* ``data.options`` / ``data.train`` / ``data.val`` / ``data.test``: keyword options passed to
  ``longattn.data.lra.build_dataset`` (common, then per split).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from longattn.utils import optional_import


# Every key a config may hold, with its default (the standard LRA model of Nystromformer's code).
DEFAULTS: dict[str, Any] = {
    "task": None,
    "attention": "softmax",
    "seed": 0,
    "attention_options": {},
    "model": {
        "layers": 2,
        "dim": 64,  # embedding size
        "hidden": 128,  # FFN and classifier hidden size
        "heads": 2,
        "dropout": 0.1,  # after attention / FFN and inside the FFN
        "embedding_dropout": 0.1,
        "norm": "pre",  # "pre" (standard LRA) or "post"
        "pooling": "mean",  # "mean", "cls" or "maxmean"
        "head": "mlp",  # "mlp" or "singular" (Singularformer Figure 5 head)
    },
    "data": {
        "data_dir": None,
        "max_len": None,  # None: the task's max_len; the model's position table has this size
        "pad_to_max_len": False,  # pad every batch to max_len (else to its longest sequence)
        "truncate_to_max_len": False,  # cut longer sequences to max_len (else they are an error)
        "subset": {"train": None, "val": None, "test": None},  # use a seeded random subset of this size
        "options": {},
        "train": {},
        "val": {},
        "test": {},
    },
    "optim": {
        "lr": 1e-4,
        "optimizer": "adamw",  # "adamw" or "adam"
        "weight_decay": 0.0,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "schedule": "linear",  # "constant", "linear", "cosine", "onecycle" or "step" (per-epoch decay)
        "warmup_steps": 0,
        "min_lr_ratio": 0.0,  # floor of the linear/cosine decay, as a fraction of lr
        "step_decay": 0.5,  # schedule "step": lr * step_decay ** epoch
    },
    "train": {
        "batch_size": 32,
        "eval_batch_size": None,  # None: batch_size
        "max_steps": 1000,  # optimiser steps
        "epochs": None,  # if set: max_steps = this many passes over the training data
        "grad_accum": 1,
        "clip_norm": None,  # None: no clipping
        "precision": "fp32",  # "fp32", "bf16" or "fp16" (fp16 on CUDA only)
        "eval_every": 100,  # optimiser steps between validations
        "eval_every_epoch": False,  # validate after every epoch instead (eval_every is then ignored)
        "drop_last": False,  # drop each epoch's incomplete last training batch
        "max_steps_per_epoch": None,  # cap each epoch (for quick runs); None: full epochs
        "checkpoint_every": None,  # None: at every validation
        "patience": None,  # validations without improvement before stopping; None: never stop early
        "log_every": 10,
        "progress": True,  # tqdm bar (only on a TTY)
        "device": "auto",  # "auto", "cpu", "cuda", "cuda:1", ...
        "num_workers": 0,
        "find_unused_parameters": False,  # DDP: for mechanisms whose forward skips some parameters
    },
}

# Sections whose keys are validated by another component (see the module docstring).
FREE_FORM = {("attention_options",), ("data", "options"), ("data", "train"), ("data", "val"), ("data", "test")}


class ConfigError(ValueError):
    """A config file or override names an unknown key or has a value of the wrong kind."""


def defaults() -> dict[str, Any]:
    return copy.deepcopy(DEFAULTS)


def merge(base: dict[str, Any], update: dict[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base``, rejecting keys ``base`` does not know."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        here = path + (key,)
        if path in FREE_FORM or _inside_free_form(here):
            out[key] = merge(out.get(key, {}), value, here) if isinstance(value, dict) else value
            continue
        if key not in out:
            where = ".".join(path) or "the top level"
            valid = ", ".join(sorted(out))
            raise ConfigError(f"unknown config key {'.'.join(here)!r}; valid keys at {where}: {valid}")
        if isinstance(out[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {'.'.join(here)!r} must be a mapping, got {value!r}")
            out[key] = merge(out[key], value, here)
        else:
            out[key] = value
    return out


def _inside_free_form(path: tuple[str, ...]) -> bool:
    return any(path[: len(p)] == p and len(path) > len(p) for p in FREE_FORM)


def parse_override(text: str) -> dict[str, Any]:
    """``"optim.lr=3e-4"`` -> ``{"optim": {"lr": 0.0003}}``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.subkey=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key part")
    value = optional_import("yaml").safe_load(raw) if raw.strip() else None
    if isinstance(value, str):
        value = _yaml_float(value)
    nested: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        nested = {part: nested}
    return nested


def _yaml_float(value: str) -> Any:
    # YAML 1.1 reads "1e-4" as a string (it wants "1.0e-4"); users mean a number.
    try:
        return float(value)
    except ValueError:
        return value


def _fix_yaml_floats(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_yaml_floats(v) for v in node]
    return _yaml_float(node) if isinstance(node, str) else node


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    data = optional_import("yaml").safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return _fix_yaml_floats(data)


def packaged_configs() -> Path:
    """The configs shipped inside the package (``configs/`` in a checkout links to the same folder)."""
    return Path(__file__).resolve().parents[1] / "configs"


def configs_root() -> Path:
    """The LRA configs: presets are ``configs/lra/<task>/<preset>.yaml``, sweeps ``configs/lra/sweeps/*.yaml``."""
    return packaged_configs() / "lra"


def preset_path(task: str, preset: str) -> Path:
    path = configs_root() / task / f"{preset}.yaml"
    if not path.is_file():
        folder = configs_root() / task
        found = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        raise FileNotFoundError(
            f"no preset {preset!r} for task {task!r} ({path}); available: {', '.join(found) or '(none)'}"
        )
    return path


def load_config(
    task: str | None = None,
    attention: str | None = None,
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Defaults <- preset file <- ``config_file`` <- ``overrides`` <- explicit task/attention."""
    config = defaults()
    if preset is not None:
        if task is None:
            raise ConfigError("a preset needs a task")
        config = merge(config, read_yaml(preset_path(task, preset)))
    if config_file is not None:
        config = merge(config, read_yaml(config_file))
    for text in overrides:
        config = merge(config, parse_override(text))
    if task is not None:
        config["task"] = task
    if attention is not None:
        config["attention"] = attention
    validate(config)
    return config


_CHOICES = {
    ("model", "norm"): ("pre", "post"),
    ("model", "pooling"): ("mean", "cls", "maxmean"),
    ("model", "head"): ("mlp", "singular"),
    ("optim", "schedule"): ("constant", "linear", "cosine", "onecycle", "step"),
    ("optim", "optimizer"): ("adamw", "adam"),
    ("train", "precision"): ("fp32", "bf16", "fp16"),
}


def validate(config: dict[str, Any]) -> None:
    """Value checks that a wrong type would otherwise turn into a confusing failure later."""
    for (section, key), choices in _CHOICES.items():
        if config[section][key] not in choices:
            raise ConfigError(f"{section}.{key} must be one of {choices}, got {config[section][key]!r}")
    positive = [("model", "layers"), ("model", "dim"), ("model", "hidden"), ("model", "heads"),
                ("train", "batch_size"), ("train", "max_steps"), ("train", "grad_accum"),
                ("train", "eval_every"), ("train", "log_every")]
    for section, key in positive:
        value = config[section][key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{section}.{key} must be a positive integer, got {value!r}")
    if not isinstance(config["attention_options"], dict) or not all(
        isinstance(v, dict) for v in config["attention_options"].values()
    ):
        raise ConfigError("attention_options must map mechanism names to option mappings")
    lr = config["optim"]["lr"]
    if not isinstance(lr, (int, float)) or lr <= 0:
        raise ConfigError(f"optim.lr must be a positive number, got {lr!r}")


def save_config(config: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(optional_import("yaml").safe_dump(config, sort_keys=False))
