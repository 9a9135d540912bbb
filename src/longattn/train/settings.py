"""The training loop's settings: the ``train`` and ``optim`` sections of every run config, and the run config
itself (:class:`RunConfig`, assembled by :func:`longattn.experiment.config.resolve_config`).

These two dataclasses are the one place the loop's defaults are written (the standard LRA settings of
Nystromformer's code); tasks change them with an overlay, presets and ``--set`` with theirs. Values
are checked when a config is loaded (:func:`longattn.config.from_dict`): a negative clip norm, an
infinite learning rate or zero epochs are refused before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from longattn.config import config_hash, option

__all__ = ["OptimConfig", "RunConfig", "TrainConfig"]


@dataclass
class OptimConfig:
    """Optimiser and learning-rate schedule (see :func:`longattn.train.loop.build_scheduler`)."""

    lr: float = option(1e-4, gt=0, help="peak learning rate")
    optimizer: Literal["adamw", "adam"] = option("adamw", help="adamw: decoupled weight decay; adam: L2 in the gradient")
    weight_decay: float = option(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = option(1e-8, gt=0)
    schedule: Literal["constant", "linear", "cosine", "onecycle", "step"] = option(
        "linear", help="after warmup: constant, linear or cosine decay, OneCycle, or per-epoch step decay")
    warmup_steps: int = option(0, ge=0, help="linear warmup steps (OneCycle: its rising phase)")
    warmup_epochs: float | None = option(None, ge=0, help="if set: warmup_steps = this many passes over the "
                                         "training data (Singularformer's 4 warm-up epochs)")
    warmup_ratio: float | None = option(None, ge=0, le=1, help="if set: warmup_steps = this fraction of the run's "
                                        "optimiser steps (transformers' warmup_ratio; 0.06 = RoBERTa's GLUE runs)")
    min_lr_ratio: float = option(0.0, ge=0, le=1, help="floor of the linear/cosine decay, as a fraction of lr")
    step_decay: float = option(0.5, gt=0, help="schedule step: lr * step_decay ** epoch (0.5 = FEDformer's type1)")
    new_lr: float | None = option(None, gt=0, help="peak learning rate of the parameters the model marks as new "
                                  "(its new_parameters(): e.g. a converted mechanism's); null: lr for all")


@dataclass
class TrainConfig:
    """Batches, budget, evaluation, checkpoints, precision and device of a run."""

    batch_size: int = option(32, ge=1)
    eval_batch_size: int | None = option(None, ge=1, help="null: batch_size")
    max_steps: int = option(1000, ge=1, help="optimiser steps")
    epochs: float | None = option(None, ge=1, help="if set: max_steps = this many passes over the training data")
    min_steps: int | None = option(None, ge=1, help="with epochs: at least this many optimiser steps (a small "
                                   "training set still gets a real run); null: the epochs alone")
    grad_accum: int = option(1, ge=1)
    clip_norm: float | None = option(None, gt=0, help="gradient-norm clipping; null: none")
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", help="fp16 on CUDA only")
    eval_every: int = option(100, ge=1, help="optimiser steps between validations")
    eval_every_epoch: bool = option(False, help="validate after every epoch instead (eval_every is then ignored)")
    evals: int | None = option(None, ge=1, help="if set: validate this many times, evenly spaced over the run, "
                               "whatever its length (eval_every and eval_every_epoch are then ignored)")
    min_evals: int = option(5, ge=1, help="validate at least this many times per run: an interval that leaves "
                            "fewer is shortened (with a note; a warning when it exceeds the whole run)")
    drop_last: bool = option(False, help="drop each epoch's incomplete last training batch")
    group_by_length: bool = option(False, help="batch examples of similar length (less padding): each window of "
                                   "length_window shuffled batches is sorted by length, then the batches are "
                                   "shuffled; needs a training set with lengths()")
    length_window: int = option(50, ge=1, help="batches per window sorted by length (group_by_length): larger "
                                "windows pad less, smaller ones keep each batch closer to a random sample")
    max_steps_per_epoch: int | None = option(None, ge=1, help="cap each epoch (quick runs); null: full epochs")
    checkpoint_every: int | None = option(None, ge=1, help="null: at every validation")
    patience: int | None = option(None, ge=1, help="early stopping: validations without improvement of the "
                                  "selection metric before stopping (never before min_evals validations); null: never")
    stop_at: float | None = option(None, help="stop once the validation selection metric reaches this value "
                                   "(at least it when higher is better, at most it otherwise); null: never")
    log_every: int = option(10, ge=1)
    progress: bool = option(True, help="a tqdm bar on a terminal; off a terminal (nohup, a batch job, CI) a "
                            "line on stdout every progress_every_s seconds")
    progress_every_s: float = option(60.0, ge=0, help="off a terminal: seconds between progress lines (0: one at "
                                     "every log_every steps)")
    device: str = option("auto", help="auto, cpu, cuda, cuda:1, ...")
    num_workers: int = option(0, ge=0)
    find_unused_parameters: bool = option(False, help="DDP: for models whose forward skips some parameters")
    ema_decay: float | None = option(None, gt=0, lt=1, help="validate, select and test an exponential moving "
                                     "average of the weights with this decay (e.g. 0.999); null: the weights")


@dataclass
class RunConfig:
    """One run: which task, model and attention, with what data, model, optimiser and loop settings."""

    task: str | None = None
    model_name: str | None = None  # a registered model of the task's family; null: the task's default
    attention: str | None = None  # a registered mechanism; null: the model builder's default
    seed: int = 0
    data: Any = field(default_factory=dict)  # the task's data_config
    model: dict[str, Any] = field(default_factory=dict)  # builder options (checked against its signature)
    attention_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-model layers, folded in by resolve

    def hash(self) -> str:
        return config_hash(self)

    def chosen_attention_options(self) -> dict[str, Any]:
        return dict(self.attention_options.get(self.attention or "", {}))
