"""Tasks as registered objects: what a run trains on, with which model, loss and metrics.

A task declares everything the one run path (:func:`longattn.experiment.run.run`) needs:

* ``data_config``: the dataclass of its ``data`` section (strict keys, defaults written there);
* ``overlay``: its defaults over the core ones (a mapping in config form, e.g. forecasting's Adam and
  per-epoch validation); presets in ``preset_dir`` write only differences from these;
* ``model_family`` / ``default_model``: which registered models it can train
  (:mod:`longattn.models.registry`), and :meth:`Task.model_inputs`, the builder arguments it supplies
  itself (vocabulary size, classes, channels...);
* :meth:`Task.build_data`, :meth:`Task.step_fn`, :meth:`Task.metrics`, and ``select_metric`` /
  ``select_mode``, the validation metric that picks the best checkpoint.

Register with ``@register_task("name")`` in any module of :mod:`longattn.tasks` (imported on first
use) or in a user module imported before the command line runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch.utils.data import Dataset

from longattn.config import ConfigError
from longattn.registry import Registry
from longattn.train.loop import MetricFn, StepFn
from longattn.train.settings import RunConfig

__all__ = ["Task", "TaskData", "TASKS", "get_task", "register_task", "task_names"]


@dataclass
class TaskData:
    """A task's built data: the three splits, the batching function and facts the model needs."""

    train: Dataset
    val: Dataset | None
    test: Dataset | None
    collate: Callable[[list[Any]], Any]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EmptyDataConfig:
    """For tasks whose data take no options."""


class Task:
    """Base class of every task; subclasses fill in the class attributes and the four methods."""

    name: str = ""
    family: str = ""
    description: str = ""
    data_config: type = EmptyDataConfig
    overlay: dict[str, Any] = {}
    model_family: str = "classifier"
    default_model: str = ""
    model_input_names: tuple[str, ...] = ()  # builder arguments the task supplies (see model_inputs)
    select_metric: str = "accuracy"
    select_mode: str = "max"
    preset_dir: Path | None = None
    # Report a metric scaled (100 for accuracies in %) in tables.
    table_scale: float = 1.0

    # -- presets ---------------------------------------------------------------------------------
    def presets(self) -> list[str]:
        folder = self.preset_dir
        return sorted(p.stem for p in folder.glob("*.yaml")) if folder and folder.is_dir() else []

    def preset_path(self, preset: str | Path) -> Path:
        path = Path(preset)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            return path
        candidate = (self.preset_dir or Path("/nonexistent")) / f"{preset}.yaml"
        if not candidate.is_file():
            from longattn.registry import nearest

            found = self.presets()
            raise ConfigError(f"no preset {str(preset)!r} for task {self.name!r}{nearest(str(preset), found)}; "
                              f"available: {', '.join(found) or '(none)'}")
        return candidate

    def upgrade(self, layer: dict[str, Any], model_name: str | None, attention: str | None) -> dict[str, Any]:
        """Translate older key names of one config layer (a file or ``--set``) into today's; identity here."""
        return layer

    # -- what a run needs --------------------------------------------------------------------------
    def build_data(self, config: RunConfig) -> TaskData:
        raise NotImplementedError

    def data_cache_key(self, config: RunConfig) -> Any:
        """Runs whose keys are equal share built data (the mechanisms of one comparison)."""
        return (self.name, config.seed, repr(config.data))

    def model_inputs(self, config: RunConfig, data: TaskData) -> dict[str, Any]:
        """Builder arguments the task supplies (not user options), e.g. vocab_size, num_classes."""
        return {}

    def step_fn(self, config: RunConfig, data: TaskData) -> StepFn:
        raise NotImplementedError

    def metrics(self, config: RunConfig, data: TaskData) -> dict[str, MetricFn]:
        raise NotImplementedError

    def describe(self, config: RunConfig, data: TaskData, results: dict[str, Any]) -> dict[str, Any]:
        """The task's fields of results.json (added to the Trainer's)."""
        return {}

    def validation_line(self, record: dict[str, Any]) -> str | None:
        """A line to print for one validation record (None: print nothing; the progress bar shows it)."""
        return None

    def after_run(self, config: RunConfig, data: TaskData, model: Any, out_dir: Path) -> None:
        """Anything a finished run writes besides results.json (plots)."""

    def summary(self, results: dict[str, Any]) -> dict[str, Any]:
        """A few headline numbers of a finished run, printed by ``longattn train``."""
        out = {k: results.get(k) for k in ("task", "model", "attention", "parameters", "steps", "best_step",
                                          "train_time_s", "peak_memory_mb")}
        for split in ("val", "test"):
            if results.get(split):
                out[f"{split}_{self.select_metric}"] = results[split].get(self.select_metric)
        convergence = results.get("convergence")
        if convergence is not None:
            out["converged"] = convergence["converged"]
            if not convergence["converged"]:
                out["convergence"] = convergence["text"]  # "not converged: ..." with the figures
        return out


TASKS: Registry[Task] = Registry("task", package="longattn.tasks", error=ConfigError)


def register_task(name: str, **metadata: Any) -> Callable[[Any], Any]:
    """Class decorator: register an instance of the :class:`Task` subclass under ``name``."""

    def add(cls: type[Task]) -> type[Task]:
        task = cls()
        task.name = name
        TASKS.register(name, task, family=cls.family, **metadata)
        return cls

    return add


def get_task(name: str) -> Task:
    return TASKS.get(name)


def task_names(family: str | None = None) -> list[str]:
    return TASKS.names(family=family) if family else TASKS.names()
