"""The one run path: a resolved :class:`RunConfig` -> data, model, :class:`Trainer` -> results.json.

Every command that trains (``train``, ``compare``, ``sweep``, ``noise``, ``forecast``, ``forecast-table``)
comes here; this is the only place a Trainer is built. A run folder holds ``config.yaml`` (the resolved
config, reloadable by :func:`longattn.experiment.config.load_saved`), ``metrics.jsonl``, ``checkpoints/``
and ``results.json`` (with provenance).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from torch import nn

from longattn.config import ConfigError, to_dict
from longattn.experiment.config import RunConfig, build_run_config, load_saved, load_schedule, save_config
from longattn.experiment.results import now, write_results
from longattn.models.registry import build_model
from longattn.tasks.base import Task, TaskData, get_task
from longattn.train.checkpoint import load_checkpoint, load_weights
from longattn.train.distributed import launched_rank, resolve_device
from longattn.train.loop import Trainer, evaluate
from longattn.train.outputs import RESULTS, RunFiles, check_output_folder, clear_run, inspect_output, read_finished, writing
from longattn.utils import seed_everything

__all__ = ["RunStatus", "build_run_model", "config_differences", "evaluate_run", "run", "run_status"]


def build_run_model(config: RunConfig, task: Task, data: TaskData) -> nn.Module:
    """The registered model of ``config`` with the task's inputs, the user's options and the attention's."""
    kwargs: dict[str, Any] = {**task.model_inputs(config, data), **config.model}
    if config.attention is not None:
        kwargs["attention"] = config.attention
        kwargs["attention_options"] = config.chosen_attention_options()
    try:
        return build_model(config.model_name, family=task.model_family, **kwargs)
    except (RuntimeError, TypeError, ValueError) as err:  # e.g. a negative size: say which model and options
        raise ConfigError(f"model {config.model_name!r} cannot be built with {config.model}"
                          f"{' and attention ' + repr(config.attention) if config.attention else ''}: {err}") from None


def _data(task: Task, config: RunConfig, cache: dict[Any, Any] | None) -> TaskData:
    key = task.data_cache_key(config)
    if cache is not None and key in cache:
        return cache[key]
    data = task.build_data(config)
    if cache is not None:
        cache.clear()  # hold one task's data at a time (full LRA splits are large)
        cache[key] = data
    return data


def config_differences(config: RunConfig, out_dir: Path) -> list[str] | None:
    """The sections in which ``config`` differs from the config saved in ``out_dir`` (None: none saved).
    A saved config that no longer loads counts as differing everywhere (``["config.yaml"]``)."""
    saved = out_dir / "config.yaml"
    if not saved.is_file():
        return None
    try:  # the config as asked, or as the run used it (`--config` of the run's own config.yaml)
        as_asked = _sections_differing(load_saved(saved), config)
        if as_asked and not _sections_differing(load_saved(saved, as_used=True), config):
            return []
        return as_asked
    except ConfigError:
        return ["config.yaml"]


def _sections_differing(saved: RunConfig, config: RunConfig) -> list[str]:
    previous, current = to_dict(saved), to_dict(config)
    for tree in (previous, current):  # a progress bar changes nothing a run computes
        tree.get("train", {}).pop("progress", None)
        # nor do the options of the mechanisms the run does not use (a preset lists every mechanism's): giving one
        # mechanism new options must not turn the finished runs of the others into runs of "another configuration"
        options = tree.get("attention_options")
        if isinstance(options, dict):
            tree["attention_options"] = options.get(tree.get("attention") or "", {})
    return sorted(k for k in set(current) | set(previous) if current.get(k) != previous.get(k))


@dataclass(frozen=True)
class RunStatus:
    """What a run folder holds for ``config``: nothing of a run (``empty``), its ``finished`` run (``results``),
    an ``interrupted`` one, or a run of ``another`` configuration (``differences``: the sections)."""

    state: Literal["empty", "finished", "interrupted", "another"]
    files: RunFiles
    results: dict[str, Any] | None = None
    differences: tuple[str, ...] = ()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def run_status(folder: str | Path, config: RunConfig | None) -> RunStatus:
    """Whether ``folder`` holds the finished run of ``config``: its finished marker (written last, atomically)
    and a saved config equal to ``config`` (``config=None``: any finished run). A folder with ``results.json``
    and ``config.yaml`` only (an archived run: checkpoints and log left out) counts as finished too; a
    ``results.json`` beside checkpoints or a log but without the marker is an interrupted run, whatever its age."""
    folder = Path(folder)
    files = inspect_output(folder)
    if files.empty:
        return RunStatus("empty", files)
    results = _read_json(folder / RESULTS)
    differences = [] if config is None else config_differences(config, folder)
    if differences is None and results is not None and isinstance(results.get("config"), dict):
        try:  # an archived run without its config.yaml: the config recorded in its results
            differences = _sections_differing(build_run_config(results["config"]), config)
        except ConfigError:
            differences = ["config"]
    if differences:
        return RunStatus("another", files, differences=tuple(differences))
    if differences is None:  # no saved config at all: nothing says whose run this is
        return RunStatus("another", files, differences=("config.yaml missing",))
    finished = read_finished(folder) if files.finished else None
    if finished is not None:
        return RunStatus("finished", files, results if results is not None else finished["results"])
    if results is not None and not files.has_checkpoints and not files.finished:
        return RunStatus("finished", files, results)
    return RunStatus("interrupted", files)


def check_resume(config: RunConfig, out_dir: Path) -> RunConfig:
    """``--resume`` must continue the same settings: compare with the saved config, section by section; the
    run continues as the saved config asked (the same fingerprint, whichever form of it ``config`` is)."""
    changed = config_differences(config, out_dir)
    if changed:
        raise ConfigError(f"--resume: the config differs from the one saved in {out_dir / 'config.yaml'} (sections "
                          f"{changed}); resume with the same options, replace the run with --overwrite, or train "
                          "into a new --out folder")
    return config if changed is None else load_saved(out_dir / "config.yaml")


def check_same_schedule(trainer: Trainer, out_dir: Path) -> None:
    """A resumed run must train the schedule its config.yaml records (a training set of another size would
    change the steps per epoch, and with them the run's length and validation interval)."""
    path = out_dir / "config.yaml"
    saved = load_schedule(path) if path.is_file() else None
    if saved is None:  # nothing to resume, or saved before runs recorded their schedule
        return
    differing = [f"{name} {entry.get('value')} recorded, {trainer.schedule[name]['value']} now"
                 for name, entry in saved.items() if isinstance(entry, dict) and name in trainer.schedule
                 and entry.get("value") != trainer.schedule[name]["value"]]
    if differing:
        trainer.release()
        raise ConfigError(f"--resume: this run's schedule differs from the one in {out_dir / 'config.yaml'} "
                          f"({'; '.join(differing)}): has the training data changed? Resume with the same data, "
                          "or train into a new --out folder")


def run(
    config: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    data_cache: dict[Any, Any] | None = None,
    on_step_end: Callable[[Trainer, int], None] | None = None,
    log: Callable[[str], Any] | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Train ``config`` into ``out_dir`` and return the results (also written to results.json).

    A folder that holds a run is refused unless ``resume`` (continue exactly from ``checkpoints/last.pt``;
    refused if the config differs from the saved one) or ``overwrite`` (replace it) says what to do
    (:func:`longattn.train.outputs.check_output_folder`). Runs sharing a ``data_cache`` dict reuse built data when the task's cache key matches.
    ``log`` receives one line per validation (tasks that have something to say, e.g. forecasting's epochs).
    """
    started = now()
    task = get_task(config.task)
    out_dir = Path(out_dir)
    for folder in (out_dir, *out_dir.parents):
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--out {out_dir}: {folder} is a file, not a folder; choose another output folder")
    # before any data is built; only the main process probes the folder's lock: another rank's probe could find
    # the lock the main process's Trainer already holds and refuse its own run
    check_output_folder(out_dir, resume=resume, overwrite=overwrite, locked=launched_rank() != 0)
    if resume:
        config = check_resume(config, out_dir)
    data = _data(task, config, data_cache)
    seed_everything(config.seed)  # identical initial weights on every rank and every resume
    model = build_run_model(config, task, data)
    logged: list[int] = []

    def step_end(trainer: Trainer, step: int) -> None:
        if log is not None:
            history = trainer.progress.history
            if not logged:  # a resumed run logged its earlier validations before
                logged.append(sum(1 for record in history if record["step"] < step))
            for record in history[logged[0]:]:
                line = task.validation_line(record)
                if line:
                    log(line)
            logged[0] = len(history)
        if on_step_end is not None:
            on_step_end(trainer, step)

    def finish(results: dict[str, Any]) -> None:
        results.update(task.describe(config, data, results))
        write_results(out_dir / "results.json", results, config=config, seeds=[config.seed], started=started)

    trainer = Trainer(
        model, data.train, data.val, data.test, data.collate, task.step_fn(config, data), task.metrics(config, data),
        train=config.train, optim=config.optim, seed=config.seed, out_dir=out_dir,
        select_metric=task.select_metric, select_mode=task.select_mode,
        run_info={"task": config.task, "model": config.model_name, "attention": config.attention,
                  "options": config.chosen_attention_options(), "config": to_dict(config)},
        on_step_end=step_end, fingerprint=config.hash(), write_results=finish,
    )
    if resume:
        check_same_schedule(trainer, out_dir)
    if trainer.dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if overwrite:  # the old run goes before the new config is written: never its marker beside our config
            clear_run(out_dir)
        with writing(out_dir, "config.yaml", "nothing of this run was written yet"):
            save_config(config, out_dir / "config.yaml", trainer.schedule, trainer.schedule_settings)
    results = trainer.fit(resume=resume, overwrite=overwrite)
    if not trainer.dist.is_main:  # the main process added these in finish()
        results.update(task.describe(config, data, results))
    if trainer.dist.is_main and plots:
        task.after_run(config, data, model, out_dir)
    return results


def evaluate_run(out_dir: str | Path, split: str = "test", checkpoint: str = "best",
                 data_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate the ``best``/``last`` (or a path) checkpoint of a finished run on ``split``.

    ``data_options`` are extra dataset options for this evaluation only (e.g. ``noise_amplitude``), for
    tasks whose splits take options.
    """
    out_dir = Path(out_dir)
    config = load_saved(out_dir / "config.yaml")
    task = get_task(config.task)
    if split not in ("train", "val", "test"):
        raise ConfigError(f"split must be train, val or test, got {split!r}")
    if data_options:
        if not hasattr(task, "split"):
            raise ConfigError(f"task {config.task!r} takes no per-evaluation data options")
        dataset = task.split(config, split, **data_options)
        data = TaskData(dataset, None, None, task.make_collate(config))
    else:
        data = task.build_data(config)
        dataset = getattr(data, split)
    model = build_run_model(config, task, data)
    path = out_dir / "checkpoints" / f"{checkpoint}.pt" if checkpoint in ("best", "last") else Path(checkpoint)
    device = resolve_device(config.train.device)
    load_weights(model, load_checkpoint(path, map_location="cpu")["model"], path)  # another run's weights: an error
    model.to(device)
    result = evaluate(
        model, dataset, data.collate, task.step_fn(config, data), task.metrics(config, data),
        batch_size=config.train.eval_batch_size or config.train.batch_size, device=device,
        precision=config.train.precision, split=split,
    )
    return {"task": config.task, "model": config.model_name, "attention": config.attention, "split": split,
            "schedule": load_schedule(out_dir / "config.yaml"), "checkpoint": str(path), "data_overrides": data_options or {}, **result}
