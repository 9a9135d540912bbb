"""The run config of every experiment, and the one way it is assembled.

Layers, each a plain mapping, stacked in this order (later wins):

1. the core defaults: the fields of :class:`RunConfig`, :class:`~longattn.train.settings.TrainConfig`,
   :class:`~longattn.train.settings.OptimConfig` and the task's ``data_config``;
2. the task's ``overlay``;
3. the preset (``--preset NAME``: ``<task preset_dir>/NAME.yaml``);
4. ``--config FILE``;
5. ``--set a.b=value`` overrides, in order;
6. explicit command-line flags (``--task``, ``--attention``, ``--model``, ``--seed``...).

Inside each layer, ``models.<model name>`` holds settings that apply only when that model runs (a
forecasting file's per-model learning rate), and win over the same layer's general keys.
Model options (the ``model`` section) are checked against the registered builder's signature, whose
defaults are the model's defaults; mechanism options live under ``attention_options.<mechanism>`` so
that swapping the attention never passes one mechanism's options to another.

The resolved :class:`RunConfig` is saved as ``config.yaml`` with each run and reloads
(:func:`load_saved`) into the same dataclasses, so ``--resume`` compares like with like.
"""

from __future__ import annotations

import copy
import inspect
import typing
from pathlib import Path
from typing import Any

from longattn import attention as attention_registry
from longattn.config import ConfigError, check_value, from_dict, merge, parse_set, read_yaml, to_dict, write_yaml
from longattn.models.registry import MODELS, model_defaults, model_names
from longattn.registry import nearest
from longattn.tasks.base import Task, get_task
from longattn.train.settings import OptimConfig, RunConfig, TrainConfig
from longattn.utils import warn

__all__ = ["SCHEDULE", "RunConfig", "load_saved", "load_schedule", "model_options", "resolve_config", "save_config"]

SCHEDULE = "schedule"  # config.yaml's section of what a run trained (see save_config)


def _as_layer(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping")
    return copy.deepcopy(value)


def _without_none(tree: dict[str, Any]) -> dict[str, Any]:
    """Flags left unset (None) do not override anything, at any depth."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = _without_none(value)
        if value is not None:
            out[key] = value
    return out


def _picked(layers: list[dict[str, Any]], key: str) -> Any:
    value = None
    for layer in layers:
        if layer.get(key) is not None:
            value = layer[key]
    return value


def _fold_model_layer(layer: dict[str, Any], model_name: str) -> dict[str, Any]:
    """A layer with its ``models.<model_name>`` part merged over its general keys (other models' dropped)."""
    per_model = layer.pop("models", None) or {}
    if not isinstance(per_model, dict):
        raise ConfigError("`models` must map model names to settings")
    for name, part in per_model.items():
        if not isinstance(part, dict):
            raise ConfigError(f"models.{name} must be a mapping of settings")
        if "models" in part:
            raise ConfigError(f"models.{name} may not hold another `models` section")
    return merge(layer, per_model.get(model_name, {}))


def resolve_config(
    task: str | None = None,
    preset: str | Path | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    **explicit: Any,
) -> RunConfig:
    """Stack the layers of the module docstring and check the result; see :class:`RunConfig`.

    ``explicit`` holds command-line flags in config form (``attention="skein"``, ``seed=3``,
    ``data={"data_dir": ...}``); None values are ignored.
    """
    explicit_layer = _without_none(explicit)
    if task is not None:
        explicit_layer["task"] = task
    file_layer = read_yaml(config_file) if config_file is not None else {}
    file_layer.pop(SCHEDULE, None)  # a run's record of what it trained, not a setting: its settings say it
    set_layers = [parse_set(text) for text in overrides]
    late = [file_layer, *set_layers, explicit_layer]
    task_name = _picked(late, "task")
    if task_name is None:
        raise ConfigError("no task: pass --task (or set `task:` in the config file)")
    task_obj = get_task(task_name)
    preset_layer = read_yaml(task_obj.preset_path(preset)) if preset is not None else {}
    layers = [copy.deepcopy(task_obj.overlay), preset_layer, *late]
    model_name = _picked(layers, "model_name") or task_obj.default_model
    attention = _picked(layers, "attention")
    tree = to_dict(RunConfig())
    tree["data"] = to_dict(task_obj.data_config())
    for layer in layers:
        layer = task_obj.upgrade(_as_layer(layer, "a config layer"), model_name, attention)
        tree = merge(tree, _fold_model_layer(layer, model_name))
    tree["task"], tree["model_name"], tree["models"] = task_name, model_name, {}
    config = build_run_config(tree, task_obj)
    _warn_unused_step_budget(config, late)
    return config


def _warn_unused_step_budget(config: RunConfig, late: list[Any]) -> None:
    """``train.max_steps`` given by the user (config file, ``--set``) while the task or preset budgets in epochs:
    the epochs win (:class:`TrainConfig`), so say so instead of training a budget nobody asked for."""
    given = [layer["train"] for layer in late if isinstance(layer, dict) and isinstance(layer.get("train"), dict)]
    steps_only = any("max_steps" in t for t in given) and not any("epochs" in t for t in given)
    if steps_only and config.train.epochs is not None:
        warn(f"train.max_steps={config.train.max_steps} is not used: the budget is "
             f"train.epochs={config.train.epochs:g} (from the task or preset); add train.epochs=null to train by steps")


def build_run_config(tree: dict[str, Any], task_obj: Task | None = None) -> RunConfig:
    """A checked :class:`RunConfig` from a full mapping (resolved layers, or a saved config.yaml)."""
    config = from_dict(RunConfig, tree)
    task_obj = task_obj or get_task(config.task)
    config.data = from_dict(task_obj.data_config, config.data, "data")
    if config.model_name not in model_names(task_obj.model_family):
        valid = model_names(task_obj.model_family)
        raise ConfigError(f"unknown model {config.model_name!r} for task {config.task!r}"
                          f"{nearest(str(config.model_name), valid)}; valid: {', '.join(valid)}")
    builder_defaults = model_defaults(config.model_name)
    takes_attention = "attention" in builder_defaults
    if config.attention is not None:
        if not takes_attention:
            raise ConfigError(f"model {config.model_name!r} takes no attention mechanism")
        attention_registry.get_spec(config.attention)  # unknown names fail here, before any data is built
    elif takes_attention:
        config.attention = builder_defaults["attention"]
    for name, options in config.attention_options.items():
        if not isinstance(options, dict):
            raise ConfigError(f"attention_options.{name} must be a mapping of options")
    config.model = {**model_options(config.model_name, task_obj), **config.model}
    _check_model_keys(config, task_obj)
    if config.optim.warmup_steps > config.train.max_steps and config.train.epochs is None:
        raise ConfigError(f"optim.warmup_steps ({config.optim.warmup_steps}) exceeds train.max_steps "
                          f"({config.train.max_steps})")
    return config


def model_options(model_name: str, task_obj: Task) -> dict[str, Any]:
    """The user-settable options of a model and their defaults (its builder's signature)."""
    skip = (*task_obj.model_input_names, "attention", "attention_options")
    return model_defaults(model_name, skip)


def _check_model_keys(config: RunConfig, task_obj: Task) -> None:
    """Model options must be parameters of the builder, of the builder's annotated types."""
    builder = MODELS.get(config.model_name)
    target = builder.__init__ if isinstance(builder, type) else builder
    params = set(inspect.signature(target).parameters) - {"self"}
    hints = typing.get_type_hints(target)
    settable = params - set(task_obj.model_input_names) - {"attention", "attention_options"}
    for key, value in config.model.items():
        if key in ("attention", "attention_options"):
            raise ConfigError(f"model.{key}: choose the attention with `attention:` (--attention) and its "
                              f"options under attention_options.<mechanism>")
        if key not in settable:
            raise ConfigError(f"unknown config key 'model.{key}'{nearest(key, sorted(settable))} for model "
                              f"{config.model_name!r}; valid keys in model: {', '.join(sorted(settable))}")
        if key in hints:
            config.model[key] = check_value(hints[key], value, f"model.{key}")


def save_config(config: RunConfig, path: str | Path, schedule: dict[str, Any] | None = None,
                used: dict[str, Any] | None = None) -> None:
    """``config`` as YAML; with a run's ``schedule`` (:attr:`longattn.train.loop.Trainer.schedule`) the settings
    another one replaced hold the values the run ``used`` (dotted names), and the ``schedule`` section says what
    decided each and what was asked (so that :func:`load_saved` gives back the config as asked)."""
    tree = to_dict(config)
    for name, value in (used or {}).items():
        section, key = name.split(".")
        tree[section][key] = value
    if schedule is not None:
        tree[SCHEDULE] = schedule
    write_yaml(tree, path)


def _read_saved(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {path.parent} the --out folder of a run?")
    return read_yaml(path)


def _checked(tree: dict[str, Any], path: str | Path) -> RunConfig:
    try:
        return build_run_config(tree)
    except ConfigError as err:
        if str(path) in str(err):
            raise
        raise ConfigError(f"{path}: {err} (edited by hand, or written by another version?)") from None


def load_saved(path: str | Path, as_used: bool = False) -> RunConfig:
    """A run's saved ``config.yaml`` back into the dataclasses: the config as asked (the values its schedule
    section says were overridden put back), or with ``as_used`` as the file writes it (what ran)."""
    tree = _read_saved(path)
    schedule = tree.pop(SCHEDULE, None) or {}
    if not isinstance(schedule, dict):
        raise ConfigError(f"{path}: `{SCHEDULE}` must be a mapping (edited by hand?)")
    if not as_used:
        for entry in schedule.values():
            for name, asked in (entry.get("overrode") or {} if isinstance(entry, dict) else {}).items():
                section, key = str(name).split(".", 1)
                if isinstance(tree.get(section), dict):
                    tree[section][key] = asked
    return _checked(tree, path)


def load_schedule(path: str | Path) -> dict[str, Any] | None:
    """The ``schedule`` section of a run's saved ``config.yaml`` (None: written before runs recorded it)."""
    schedule = _read_saved(path).get(SCHEDULE)
    return schedule if isinstance(schedule, dict) else None
