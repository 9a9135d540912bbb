"""A generic, exactly resumable training loop (see docs/training.md).

:class:`Trainer` knows nothing about LRA: it takes a model, train/val/test datasets, a collate
function, a ``step_fn(model, batch) -> StepOutput`` that computes the task loss and the
predictions, and metric functions ``metric(predictions, targets) -> float``. It adds the
attention mechanisms' auxiliary losses while training, and handles AdamW, warmup + decay,
gradient accumulation and clipping, mixed precision, early stopping, atomic checkpoints,
exact resume and distributed data parallel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from longattn.attention import collect_aux_losses
from longattn.train.checkpoint import (
    first_line,
    layout_difference,
    load_checkpoint,
    load_weights,
    non_finite_tensors,
    model_layout,
    load_with_fallback,
    previous_path,
    remove_temporary_files,
    save_atomic,
)
from longattn.train.outputs import (
    METRICS,
    RESULTS,
    NoSpaceError,
    OutputFolderError,
    TrainingError,
    append_line,
    check_output_folder,
    clear_run,
    lock_output_folder,
    read_finished,
    read_jsonl,
    write_text_atomic,
    writing,
)
from longattn.train.data_record import data_differences, dataset_record
from longattn.train.settings import OptimConfig, TrainConfig
from longattn.train.distributed import (
    DistInfo,
    all_gather_objects,
    all_reduce_mean,
    barrier,
    init_distributed,
    is_lost_peer,
    is_timeout,
    resolve_device,
    run_finished,
    run_started,
    timeout_seconds,
)
from longattn.utils import (dumps_strict, duration, note, optional_import, rng_state, seed_everything, set_rng_state,
                            warn)


class StepOutput(NamedTuple):
    """What ``step_fn`` returns: the mean task loss of the batch, predictions and targets.

    ``predictions`` and ``targets`` (first dimension = batch) are what the metric functions
    receive, concatenated over the evaluated split.
    """

    loss: Tensor
    predictions: Tensor
    targets: Tensor


StepFn = Callable[[nn.Module, dict[str, Any]], StepOutput]
MetricFn = Callable[[Tensor, Tensor], float]


def accuracy(predictions: Tensor, targets: Tensor) -> float:
    """Fraction of argmax(logits) equal to the integer targets."""
    return float((predictions.argmax(-1) == targets).double().mean()) if len(targets) else float("nan")


def mse(predictions: Tensor, targets: Tensor) -> float:
    """Mean squared error over every element (computed in float64)."""
    return float((predictions.double() - targets.double()).pow(2).mean()) if targets.numel() else float("nan")


def mae(predictions: Tensor, targets: Tensor) -> float:
    """Mean absolute error over every element (computed in float64)."""
    return float((predictions.double() - targets.double()).abs().mean()) if targets.numel() else float("nan")


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, max_steps: int,
                    steps_per_epoch: int = 1) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup then constant / linear / cosine / per-epoch step decay, or torch's OneCycleLR.

    ``steps_per_epoch`` is only used by ``schedule="step"`` (``lr * step_decay ** epoch``, where optimiser
    step s belongs to epoch ``s // steps_per_epoch``).
    """
    total, warmup = max_steps, optim.warmup_steps
    if warmup > total:
        raise ValueError(f"optim.warmup_steps must lie in [0, max_steps={total}], got {warmup}")
    if optim.schedule == "onecycle":
        # The upstream LRA code uses OneCycleLR with linear annealing and torch's defaults otherwise
        # (initial lr = lr/25, momentum cycling); its warmup is the pct_start fraction.
        # torch needs at least 2 steps in each of its two phases.
        rise = max(warmup, 2)
        if total <= rise:
            raise ValueError(f"schedule 'onecycle' needs max_steps > max(warmup_steps, 2) = {rise}, got {total}")
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[group["lr"] for group in optimizer.param_groups], total_steps=total,
            pct_start=rise / total, anneal_strategy="linear",
        )
    floor = optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        if optim.schedule == "step":
            return optim.step_decay ** (step // steps_per_epoch)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if optim.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def parameter_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """The optimiser's parameter groups: one, or with ``optim.new_lr`` the parameters ``model.new_parameters()``
    names (e.g. a converted mechanism's, which start from random) at that learning rate and the others at ``lr``."""
    parameters = list(model.parameters())
    if optim.new_lr is None:
        return [{"params": parameters}]
    marked = getattr(model, "new_parameters", None)
    if not callable(marked):
        raise ValueError(f"optim.new_lr is set but {type(model).__name__} marks no new parameters (it has no "
                         "new_parameters()); unset it")
    new = {id(t) for t in marked()}
    groups = [{"params": [t for t in parameters if id(t) not in new]},
              {"params": [t for t in parameters if id(t) in new], "lr": optim.new_lr}]
    return [group for group in groups if group["params"]]


def example_lengths(dataset: Dataset) -> Sequence[int] | None:
    """Per-example lengths of a dataset that has ``lengths()`` (or a Subset of one); None otherwise."""
    if isinstance(dataset, torch.utils.data.Subset):
        inner = example_lengths(dataset.dataset)
        return None if inner is None else [inner[i] for i in dataset.indices]
    lengths = getattr(dataset, "lengths", None)
    return list(lengths()) if callable(lengths) else None


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement (CUDA allocator, or the process's RSS high-water mark)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        # Linux: writing 5 to clear_refs resets VmHWM, so each run of one process gets its own peak.
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory and what it measures: CUDA allocator peak, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024, "cpu_peak_rss"
    except OSError:
        pass
    # ru_maxrss (KiB on Linux) cannot be reset: the peak of the whole process so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss_of_process"


def precision_autocast(device: torch.device, precision: str) -> Any:
    """The autocast context of a run's ``train.precision`` (fp32: a disabled one)."""
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    collate_fn: Callable[[list[Any]], Any],
    step_fn: StepFn,
    metrics: dict[str, MetricFn],
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    dist: DistInfo = DistInfo(),
    num_workers: int = 0,
    progress: bool = False,
    split: str = "eval",
) -> dict[str, float]:
    """Mean loss, example count and every metric over ``dataset``, in eval mode.

    Every example counts exactly once: ranks evaluate disjoint shards (no padding, no
    drop_last) and the predictions are gathered before the metrics are computed.
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    indices = list(range(dist.rank, len(dataset), dist.world_size))
    batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers,
                        generator=torch.Generator().manual_seed(0))
    predictions, targets, loss_sum = [], [], 0.0
    for batch in optional_import("tqdm.auto").tqdm(loader, desc=split, leave=False, disable=not progress):
        batch = to_device(batch, device)
        with precision_autocast(device, precision):
            out = step_fn(model, batch)
        collect_aux_losses(model)  # nothing is recorded in eval mode; clear to be safe
        loss_sum += float(out.loss) * len(out.targets)
        predictions.append(out.predictions.detach().float().cpu())
        targets.append(out.targets.detach().cpu())
    model.train(was_training)
    parts = all_gather_objects((predictions, targets, loss_sum), dist)
    all_predictions = [p for part in parts for p in part[0]]
    all_targets = [t for part in parts for t in part[1]]
    count = sum(len(t) for t in all_targets)
    if count == 0:
        raise ValueError(f"the {split} dataset is empty")
    predictions_t, targets_t = torch.cat(all_predictions), torch.cat(all_targets)
    result: dict[str, float] = {"loss": sum(part[2] for part in parts) / count, "examples": count}
    result.update({name: fn(predictions_t, targets_t) for name, fn in metrics.items()})
    return result


# A selection metric that improved at the last validation by more than this fraction of its value before (0.2%)
# is still rising; smaller moves are validation noise.
CONVERGENCE_MARGIN = 0.002


def _figure(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else "-"


def convergence(history: Sequence[dict[str, Any]], metric: str, *, mode: str = "max",
                target_reached: bool = False, margin: float = CONVERGENCE_MARGIN) -> dict[str, Any] | None:
    """Did a run train to convergence? Judged from its validation records (``results["history"]``): not when its
    best point is its last validation and there its selection ``metric`` still improved (rose, or fell for
    ``mode="min"``) by more than ``margin`` times its previous value, whatever the loss did; nor when its best is
    last and the validation loss was still falling (the second reason); nor when it validated only once; unless it
    stopped because its selection metric reached its target (``target_reached``, ``train.stop_at``). None
    without validation.

    The record holds the figures: the selection ``metric`` and the validation loss at the last two validations.
    """
    if not history:
        return None
    last, previous = history[-1], history[-2] if len(history) > 1 else None
    best_at_last = bool(last.get("best"))

    def improved(key: str, sign: float, relative: float) -> bool:
        now, before = (last.get(key), previous.get(key)) if previous is not None else (None, None)
        if not isinstance(now, (int, float)) or not isinstance(before, (int, float)):
            return False
        return sign * (now - before) > relative * abs(before)

    metric_rising = improved(metric, 1.0 if mode == "max" else -1.0, margin)
    loss_falling = improved("loss", -1.0, 0.0)
    reasons = []
    if best_at_last and metric_rising:
        reasons.append(f"the {metric} is still {'rising' if mode == 'max' else 'falling'} by more than the "
                       f"{margin:.1%} noise margin ({_figure(previous.get(metric))} -> {_figure(last.get(metric))})")
    if best_at_last and loss_falling:
        reasons.append(f"the validation loss is still falling ({_figure(previous.get('loss'))} -> "
                       f"{_figure(last.get('loss'))})")
    converged = target_reached or (previous is not None and not reasons)
    record: dict[str, Any] = {
        "converged": converged, "validations": len(history), "best_at_last_validation": best_at_last,
        "metric_rising": metric_rising, "val_loss_falling": loss_falling, "noise_margin": margin, "mode": mode,
        "target_reached": target_reached, "metric": metric,
        "steps": [r.get("step") for r in (previous, last) if r is not None],
        "metric_values": [r.get(metric) for r in (previous, last) if r is not None],
        "val_losses": [r.get("loss") for r in (previous, last) if r is not None],
    }
    if not converged:
        if previous is None:
            record["text"] = (f"not converged: validated once (step {last.get('step')}, {metric} "
                              f"{_figure(last.get(metric))}), so nothing shows that training had stopped improving")
        else:
            record["text"] = (f"not converged: the best {metric} is at the last validation (step {last.get('step')}: "
                              f"{_figure(last.get(metric))}; step {previous.get('step')}: "
                              f"{_figure(previous.get(metric))}) and {' and '.join(reasons)}: a longer run would "
                              "probably score higher")
    return record


def _selection_mode(history: Sequence[dict[str, Any]], metric: str) -> str:
    """``max`` or ``min``: which way the best points of a history moved (results written before the record
    held its mode)."""
    bests = [r[metric] for r in history if r.get("best") and isinstance(r.get(metric), (int, float))]
    return "min" if len(bests) > 1 and bests[-1] < bests[0] else "max"


def run_convergence(results: dict[str, Any], metric: str) -> dict[str, Any] | None:
    """:func:`convergence` of a finished run's results, judged again from its validation history by today's rule
    (so results written under an older rule read the same as new ones), with the recorded mode and target;
    the recorded record where there is no history."""
    recorded = results.get("convergence") or {}
    history = results.get("history") or []
    if not history:
        return recorded or None
    return convergence(history, metric, mode=recorded.get("mode") or _selection_mode(history, metric),
                       target_reached=bool(recorded.get("target_reached")))


class ProgressLines:
    """What the progress bar shows, as lines on stdout for output that goes to a file (nohup, a batch
    scheduler, CI): a line once ``every_s`` seconds have passed since the last one, and at the last step: step,
    mean training loss since the previous line, throughput, elapsed time and time left.

    The loop asks after every step (:meth:`due`, a clock read), not only at its log steps, so that slow steps do
    not stretch the promised interval; a step (or a validation) longer than ``every_s`` is covered by
    :meth:`beat`, which a heartbeat thread calls (:meth:`start_heartbeat`): a line that says which step is under way. The
    clock is :attr:`clock`, replaced by a fake one in the tests."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    poll_s = 1.0  # how often the heartbeat thread looks at the clock

    def __init__(self, total: int, start: int, examples_per_step: int, every_s: float,
                 write: Callable[[str], Any] | None = None) -> None:
        self.total, self.start, self.examples_per_step, self.every_s = total, start, examples_per_step, every_s
        self.write = write or (lambda line: print(line, flush=True))
        self.started = self.last_time = self.last_line = self.clock()
        self.last_step = self.step = start
        self.step_ended = self.started  # when the last step ended: the next one has been under way since
        self.loss_sum, self.loss_count = 0.0, 0
        self._lock = threading.Lock()  # the heartbeat thread and the loop write lines
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, loss: float) -> None:
        self.loss_sum, self.loss_count = self.loss_sum + loss, self.loss_count + 1

    def stepped(self, step: int) -> None:
        """The loop ended step ``step`` (what the heartbeat names as done)."""
        self.step, self.step_ended = step, self.clock()

    def due(self) -> bool:
        """Whether ``every_s`` (when not 0) has passed since the last line."""
        return self.every_s > 0 and self.clock() - self.last_line >= self.every_s

    def _left(self, now: float, step: int) -> str:
        done = step - self.start
        return f"about {duration((now - self.started) / done * (self.total - step))} left" if done else ""

    def maybe_write(self, step: int, validation: dict[str, Any] | None, metric: str, last: bool = False) -> None:
        """A line if ``every_s`` has passed since the previous one, or if this is the ``last`` step of the run."""
        with self._lock:
            self.step = step
            now = self.clock()
            if not last and now - self.last_line < self.every_s:
                return
            rate = (step - self.last_step) / max(now - self.last_time, 1e-9)
            left = "done" if step >= self.total else "stopped early" if last else self._left(now, step)
            loss = f"{self.loss_sum / self.loss_count:.4g}" if self.loss_count else "-"
            line = (f"train step {step}/{self.total} ({100 * step / self.total:.0f}%): loss {loss}, {rate:.3g} "
                    f"steps/s ({rate * self.examples_per_step:.3g} examples/s), elapsed "
                    f"{duration(now - self.started)}, {left}")
            if validation is not None and isinstance(validation.get(metric), (int, float)):
                line += (f"; validation at step {validation['step']}: {metric} {validation[metric]:.4g}"
                         f"{' (best so far)' if validation.get('best') else ''}")
            self.write(line)
            self.last_time = self.last_line = now
            self.last_step = step
            self.loss_sum, self.loss_count = 0.0, 0

    def beat(self) -> None:
        """A line when none was written for ``every_s``: the step under way and for how long (the loop is inside
        one long step or a validation)."""
        with self._lock:
            now = self.clock()
            if self.every_s <= 0 or now - self.last_line < self.every_s or self.step >= self.total:
                return
            self.write(f"train step {self.step}/{self.total} ({100 * self.step / self.total:.0f}%): step "
                       f"{self.step + 1} (or its validation) under way for {duration(now - self.step_ended)}, elapsed "
                       f"{duration(now - self.started)}" + (f", {self._left(now, self.step)}"
                                                            if self.step > self.start else ""))
            self.last_line = now

    def start_heartbeat(self) -> None:
        """The heartbeat thread: :meth:`beat` every :attr:`poll_s` seconds until :meth:`stop_heartbeat`."""
        if self.every_s > 0 and self._thread is None:
            def run() -> None:
                while not self._stop.wait(self.poll_s):
                    self.beat()

            self._thread = threading.Thread(target=run, name="progress-lines", daemon=True)
            self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


@dataclass
class _Progress:
    """Loop position saved in checkpoints: with the RNG states it makes resume exact."""

    step: int = 0  # optimiser steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # batches of this epoch's (per-rank) order already consumed
    best_value: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    train_time_s: float = 0.0
    cpu_time_s: float = 0.0  # process CPU time (all threads) of training and validation
    stopped_early: bool = False
    window: list[float] = field(default_factory=lambda: [0.0, 0.0, 0])  # task loss, aux loss, steps since last log
    since_eval: list[float] = field(default_factory=lambda: [0.0, 0])  # task loss, steps since last validation
    last_lr: float | None = None  # learning rate of the last optimiser step
    history: list[dict[str, Any]] = field(default_factory=list)  # validation records


class Trainer:
    """Train ``model`` with ``step_fn`` on ``train_data``; select on ``val_data``; test the best.

    Writes to ``out_dir``: ``metrics.jsonl`` (one JSON record per log/eval line),
    ``checkpoints/last.pt`` (full state, for ``fit(resume=True)``; the one it replaced stays as
    ``last.prev.pt``), ``checkpoints/best.pt`` (weights of the best validation step),
    ``checkpoints/finished.json`` (the results, once the run is complete) and ``results.json``
    (``run_info`` + results). All JSON is strict (non-finite numbers are null). The Trainer holds
    an exclusive lock on ``out_dir`` (``out_dir/.lock``) from construction to the end of ``fit``.
    """

    def __init__(
        self,
        model: nn.Module,
        train_data: Dataset,
        val_data: Dataset | None,
        test_data: Dataset | None,
        collate_fn: Callable[[list[Any]], Any],
        step_fn: StepFn,
        metrics: dict[str, MetricFn],
        train: TrainConfig,
        optim: OptimConfig,
        out_dir: str | Path,
        seed: int = 0,
        select_metric: str = "accuracy",
        select_mode: str = "max",
        run_info: dict[str, Any] | None = None,
        on_step_end: Callable[["Trainer", int], None] | None = None,
        fingerprint: str | None = None,
        write_results: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``select_metric`` ("loss" or a key of ``metrics``) picks the best checkpoint (``select_mode`` max/min);
        ``write_results`` receives the final results on the main process (nothing is written without it)."""
        # torchrun's LOCAL_RANK picks this process's GPU before the process group starts.
        self.device = resolve_device(train.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.dist: DistInfo = init_distributed(self.device)
        run_started()
        if train.precision == "fp16" and self.device.type != "cuda":
            raise ValueError("precision 'fp16' needs a CUDA device; use 'bf16' or 'fp32' on CPU")
        if select_metric != "loss" and select_metric not in metrics:
            raise ValueError(f"select_metric {select_metric!r} is not one of the metrics {sorted(metrics)} or 'loss'")
        if select_mode not in ("max", "min"):
            raise ValueError(f"select_mode must be 'max' or 'min', got {select_mode!r}")
        if len(train_data) == 0:
            raise ValueError("the training dataset is empty")
        self.seed, self.select_metric, self.select_mode = seed, select_metric, select_mode
        self.settings = train
        self.model = model.to(self.device)
        self.train_data, self.val_data, self.test_data = train_data, val_data, test_data
        self._lengths = example_lengths(train_data) if train.group_by_length else None
        # Optimiser steps per epoch (a step straddles two epochs when grad_accum does not divide the batches).
        self.steps_per_epoch = max(1, math.ceil(len(self._epoch_batches(0)) / train.grad_accum))
        self._announce = self.dist.is_main  # notes and warnings: once, from the main process
        asked_train, asked_optim = train, optim
        if train.epochs is not None:
            max_steps = max(1, math.ceil(train.epochs * self.steps_per_epoch))
            if train.min_steps is not None and max_steps < train.min_steps:
                self._say(note, f"{train.epochs:g} epoch(s) of {self.steps_per_epoch} steps is {max_steps} steps; "
                          f"training {train.min_steps} steps instead (train.min_steps)")
                max_steps = train.min_steps
            train = dataclasses.replace(train, max_steps=max_steps, epochs=None)
        if train.evals is not None:
            every = math.ceil(train.max_steps / train.evals)
            train = dataclasses.replace(train, eval_every=every, eval_every_epoch=False, evals=None)
        elif train.eval_every_epoch:
            train = dataclasses.replace(train, eval_every=self.steps_per_epoch)
        interval_before = train.eval_every
        if val_data is not None:
            train = self._at_least_min_evals(train)
        if optim.warmup_epochs is not None and optim.warmup_ratio is not None:
            raise ValueError("set one of optim.warmup_epochs and optim.warmup_ratio, not both")
        if optim.warmup_epochs is not None:
            warmup = min(train.max_steps, math.ceil(optim.warmup_epochs * self.steps_per_epoch))
            optim = dataclasses.replace(optim, warmup_steps=warmup, warmup_epochs=None)
        if optim.warmup_ratio is not None:
            optim = dataclasses.replace(optim, warmup_steps=math.ceil(optim.warmup_ratio * train.max_steps),
                                        warmup_ratio=None)
        self.settings = train
        self.optim_settings = optim
        self.schedule, self.schedule_settings = self._schedule_record(
            asked_train, asked_optim, shortened=val_data is not None and train.eval_every != interval_before,
            validates=val_data is not None)
        self.collate_fn = collate_fn
        self.step_fn = step_fn
        self.metrics = metrics
        self.out_dir = Path(out_dir)
        self.run_info = {**(run_info or {}), "schedule": self.schedule}  # results.json: what ran
        self.on_step_end = on_step_end
        self.fingerprint = fingerprint
        self.write_results = write_results
        self.ddp_model: nn.Module = self.model
        if self.dist.enabled:
            self._check_ranks_agree(train, optim)
            self.ddp_model = DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=train.find_unused_parameters,
            )
        optimizer_class = torch.optim.AdamW if optim.optimizer == "adamw" else torch.optim.Adam
        self.optimizer = optimizer_class(
            parameter_groups(self.model, optim), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.scheduler = build_scheduler(self.optimizer, optim, train.max_steps, self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler("cuda", enabled=train.precision == "fp16")
        # An exponential moving average of the weights (train.ema_decay): what validation, best.pt and the
        # test see; torch's AveragedModel keeps it (parameters and buffers) and checkpoints with the run.
        self.ema = None
        if train.ema_decay is not None:
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

            self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(train.ema_decay), use_buffers=True)
        self.progress = _Progress()
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.finished_path = self.checkpoint_dir / "finished.json"
        self._saved_step: int | None = None  # step of the newest checkpoint on disk
        self._data_record: dict[str, Any] | None = None  # see data_record
        # (step, epoch, [task loss, aux loss, gradient norm] on the device) of the steps not yet read: see _read_losses
        self._unread: list[tuple[int, int, Tensor]] = []
        self._lock = self._lock_out_dir()

    def _check_ranks_agree(self, train: TrainConfig, optim: OptimConfig) -> None:
        """Every rank must train the same model with the same settings on a training set of the same size:
        one all-gather compares them, and a difference is one error naming the rank on every rank (instead of
        DDP's error about parameter shapes, or ranks that take different numbers of steps and wait forever)."""
        mine = {"the run's fingerprint": self.fingerprint, "the model's parameters": model_layout(self.model),
                "the training set's size": len(self.train_data), "the loop settings": dataclasses.asdict(train),
                "the optimiser settings": dataclasses.asdict(optim), "the seed": self.seed}
        everyone = all_gather_objects(mine, self.dist)
        for rank, theirs in enumerate(everyone[1:], 1):
            differing = [what for what in mine if theirs[what] != everyone[0][what]]
            if differing:
                raise TrainingError(f"rank {rank} was started with other settings than rank 0 ({', '.join(differing)} "
                                    f"differ; seen on rank {self.dist.rank}); start every rank with the same command")

    # ------------------------------------------------------------------ output folder lock
    def _lock_out_dir(self) -> Any:
        """The output folder's lock (:func:`longattn.train.outputs.lock_output_folder`) on the main process;
        every rank learns whether it got it, and all refuse alike when another run holds the folder."""
        handle, refusal = None, None
        if self.dist.is_main:
            try:
                handle = lock_output_folder(self.out_dir)
            except OutputFolderError as error:
                refusal = str(error)
        refusals = all_gather_objects(refusal, self.dist)
        if refusals[0] is not None:
            raise OutputFolderError(refusals[0])
        return handle

    def release(self) -> None:
        """Release the output-folder lock (``fit`` does this when it returns or fails)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # ------------------------------------------------------------------ helpers
    def _say(self, how: Callable[[str], None], text: str) -> None:
        if self._announce:
            how(text)

    def _at_least_min_evals(self, train: TrainConfig) -> TrainConfig:
        """``train`` with an interval that validates at least ``min_evals`` times in ``max_steps`` (or at every
        step of a shorter run): the best point is then chosen among several, whatever the data's size."""
        total, every = train.max_steps, train.eval_every
        planned = total // every + (1 if total % every else 0)  # the last step always validates
        wanted = min(train.min_evals, total)
        if planned >= wanted:
            return train
        shorter = max(1, total // wanted)
        was = (f"every epoch ({every} steps)" if train.eval_every_epoch else f"train.eval_every={every} steps")
        count = total // shorter + (1 if total % shorter else 0)
        instead = f"validating every {shorter} steps instead ({count} times; train.min_evals={train.min_evals})"
        if every > total:
            self._say(warn, f"the validation interval, {was}, is longer than this run ({total} steps, "
                      f"{total / self.steps_per_epoch:.3g} epochs): it would validate only at the end; {instead}")
        else:
            self._say(note, f"validating {was} would validate {planned} times in this run of {total} steps; "
                      f"{instead}")
        return dataclasses.replace(train, eval_every=shorter, eval_every_epoch=False)

    def _schedule_record(self, asked: TrainConfig, asked_optim: OptimConfig, *, shortened: bool,
                         validates: bool) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """What this run trains (:attr:`settings` resolved from ``asked``) and which setting decided each value:
        one entry per quantity (``value``, ``decided_by``, and ``overrode``: the asked values of the settings
        that another one replaced); and those settings' values as the run used them (dotted names), so that a
        saved config shows no overridden value as if it were live and reruns the same schedule."""
        train, optim = self.settings, self.optim_settings
        steps_by = "train.max_steps"
        if asked.epochs is not None:
            floored = asked.min_steps is not None and train.max_steps == asked.min_steps
            steps_by = "train.epochs, train.min_steps" if floored else "train.epochs"
        interval_by = ("train.min_evals" if shortened else "train.evals" if asked.evals is not None else
                       "train.eval_every_epoch" if asked.eval_every_epoch else "train.eval_every")
        warmup_by = ("optim.warmup_epochs" if asked_optim.warmup_epochs is not None else
                     "optim.warmup_ratio" if asked_optim.warmup_ratio is not None else "optim.warmup_steps")
        used = {"train.max_steps": train.max_steps}
        if validates:  # without a validation split the interval decides nothing
            used.update({"train.eval_every": train.eval_every,
                         "train.eval_every_epoch": asked.eval_every_epoch and not shortened,
                         "train.evals": None if shortened else asked.evals})
        used["optim.warmup_steps"] = optim.warmup_steps
        asked_values = {"train": dataclasses.asdict(asked), "optim": dataclasses.asdict(asked_optim)}
        overrode = {name: asked_values[name.split(".")[0]][name.split(".")[1]] for name in used}
        overrode = {name: value for name, value in overrode.items() if value != used[name]}

        def entry(value: Any, decided_by: str, *names: str) -> dict[str, Any]:
            replaced = {name: overrode[name] for name in names if name in overrode}
            return {"value": value, "decided_by": decided_by, **({"overrode": replaced} if replaced else {})}

        epoch_by = "the training set's size, train.batch_size, train.grad_accum" + (
            ", train.max_steps_per_epoch" if train.max_steps_per_epoch is not None else "")
        record = {
            "optimiser_steps": entry(train.max_steps, steps_by, "train.max_steps"),
            "steps_per_epoch": entry(self.steps_per_epoch, epoch_by),
            "validation_interval": (entry(train.eval_every, interval_by, "train.eval_every", "train.eval_every_epoch",
                                          "train.evals") if validates
                                    else entry(None, "no validation split")),
            "warmup_steps": entry(optim.warmup_steps, warmup_by, "optim.warmup_steps"),
            "batch_size": entry(train.batch_size, "train.batch_size"),
            "grad_accum": entry(train.grad_accum, "train.grad_accum"),
        }
        return record, {name: value for name, value in used.items() if name in overrode}

    def _autocast(self) -> Any:
        return precision_autocast(self.device, self.settings.precision)

    def _log(self, record: dict[str, Any]) -> None:
        if self.dist.is_main:
            with self._writing(METRICS):
                append_line(self.metrics_path, dumps_strict(record))

    def _writing(self, what: str) -> Any:
        """:func:`longattn.train.outputs.writing` for this run: what a full disk leaves intact."""
        kept = (f"the last checkpoint (step {self._saved_step}) is intact" if self._saved_step is not None
                else "no checkpoint was written yet")
        return writing(self.out_dir, what, kept)

    def _on_main(self, write: Callable[[], None], what: str) -> None:
        """``write`` on the main process; every rank then learns whether it failed (so that a full disk stops
        every rank with the same error instead of leaving the others waiting at the next collective)."""
        failure: BaseException | None = None
        if self.dist.is_main:
            try:
                with self._writing(what):
                    write()
            except OSError as error:
                failure = error
        failures = all_gather_objects(None if failure is None else (type(failure).__name__, str(failure)), self.dist)
        if failure is not None:
            raise failure
        if failures[0] is not None:
            kind, text = failures[0]
            raise (NoSpaceError if kind == NoSpaceError.__name__ else OSError)(f"rank 0: {text}")

    def _loader(self, dataset: Dataset, batches: Sequence[list[int]]) -> DataLoader:
        # A private generator: creating a loader must not draw from the global RNG, or a resumed
        # run (which creates its loader at a different moment) would diverge.
        return DataLoader(
            dataset, batch_sampler=batches, collate_fn=self.collate_fn,
            num_workers=self.settings.num_workers, generator=torch.Generator().manual_seed(self.seed),
        )

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``: a DistributedSampler order (seed + epoch), chunked."""
        sampler = DistributedSampler(
            self.train_data, num_replicas=self.dist.world_size, rank=self.dist.rank,
            shuffle=True, seed=self.seed, drop_last=False,
        )
        sampler.set_epoch(epoch)
        order = list(sampler)
        size = self.settings.batch_size
        if self.settings.group_by_length:
            order = self._grouped_by_length(order, epoch)
        batches = [order[i : i + size] for i in range(0, len(order), size)]
        if self.settings.group_by_length:  # the batches in a seeded random order, the short last one included
            shuffle = torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            batches = [batches[i] for i in shuffle.tolist()]
        if self.settings.drop_last and len(batches) > 1 and len(batches[-1]) < size:
            batches.pop()
        if self.settings.max_steps_per_epoch is not None:
            batches = batches[: self.settings.max_steps_per_epoch * self.settings.grad_accum]
        return batches

    def data_order(self) -> str:
        """A fingerprint of the first epoch's batches: equal for runs that see the same data in the same order
        (the order depends only on the seed, the training set and the batch settings, not on the model)."""
        order = json.dumps(self._epoch_batches(0), separators=(",", ":"))
        return hashlib.sha256(order.encode()).hexdigest()[:16]

    def _grouped_by_length(self, order: list[int], epoch: int) -> list[int]:
        """``order`` with each window of ``length_window`` batches sorted by example length, longest first
        (the shuffled order picks which examples share a window, so batches still differ every epoch)."""
        if self._lengths is None:
            raise ValueError("train.group_by_length needs a training set with lengths() (or a Subset of one)")
        window = self.settings.length_window * self.settings.batch_size
        grouped = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            grouped += sorted(chunk, key=lambda i: -int(self._lengths[i]))
        return grouped

    def _train_batches(self) -> Iterator[Any]:
        """Endless stream of training batches that resumes at the saved (epoch, batch) position."""
        while True:
            batches = self._epoch_batches(self.progress.epoch)[self.progress.batches_in_epoch :]
            for batch in self._loader(self.train_data, batches):
                self.progress.batches_in_epoch += 1  # counted when handed out, i.e. consumed
                yield batch
            self.progress.epoch += 1
            self.progress.batches_in_epoch = 0

    def _improved(self, value: float) -> bool:
        best = self.progress.best_value
        if best is None or math.isnan(best):
            return not math.isnan(value)
        return value > best if self.select_mode == "max" else value < best

    # ------------------------------------------------------------------ evaluation
    def evaluated_model(self) -> nn.Module:
        """The weights validation and test see: the moving average if ``train.ema_decay`` is set."""
        return self.ema.module if self.ema is not None else self.model

    def evaluate(self, dataset: Dataset, split: str = "val") -> dict[str, float]:
        """Loss and metrics over the whole ``dataset`` in eval mode (no example dropped or repeated)."""
        return evaluate(
            self.evaluated_model(), dataset, self.collate_fn, self.step_fn, self.metrics,
            batch_size=self.settings.eval_batch_size or self.settings.batch_size, device=self.device,
            precision=self.settings.precision, dist=self.dist, num_workers=self.settings.num_workers,
            progress=self._show_progress(), split=split,
        )

    def _show_progress(self) -> bool:
        return self.settings.progress and self.dist.is_main and sys.stderr.isatty()

    # ------------------------------------------------------------------ checkpoints
    def data_record(self) -> dict[str, Any]:
        """Every split's number of examples and digest (:func:`longattn.train.data_record.dataset_record`), read
        once per Trainer: the checkpoints carry it, and a resume against other data is refused."""
        if self._data_record is None:
            self._data_record = {split: dataset_record(dataset) for split, dataset in
                                 (("train", self.train_data), ("val", self.val_data), ("test", self.test_data))}
        return self._data_record

    def _state(self, rng_states: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": dataclasses.asdict(self.progress),
            "rng": rng_states,  # one entry per rank: each rank resumes its own random stream
            "settings": dataclasses.asdict(self.settings),
            "fingerprint": self.fingerprint,
            "data": self.data_record(),
            "model_layout": model_layout(self.model),
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }

    def save_checkpoint(self) -> None:
        # A finite loss can still come with an update that overflowed the weights (a huge learning
        # rate): never let such weights replace the last good checkpoint. DDP replicas are equal,
        # so every rank decides alike.
        broken = non_finite_tensors(self.model.state_dict())
        if broken:
            kept = (f"the last checkpoint (step {self._saved_step}) is intact" if self._saved_step is not None
                    else "no checkpoint was written")
            raise TrainingError(f"non-finite weights ({', '.join(broken[:3])}) after step {self.progress.step}; "
                                f"not saved, {kept}. Lower the learning rate or set gradient clipping")
        rng_states = all_gather_objects(rng_state(), self.dist)
        last = self.checkpoint_dir / "last.pt"
        self._on_main(lambda: save_atomic(self._state(rng_states), last, keep_previous=True), "checkpoints/last.pt")
        self._saved_step = self.progress.step

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the full state from ``path`` (or the previous checkpoint, if ``path`` is damaged)."""
        state, source = load_with_fallback(path, map_location="cpu")
        another = (f"{source} belongs to a run with another configuration ({{}}); use another output folder, "
                   "or replace the run there with --overwrite (overwrite=True)")
        if state.get("fingerprint") != self.fingerprint:
            raise TrainingError(another.format(f"fingerprint {state.get('fingerprint')!r}, this run's "
                                               f"{self.fingerprint!r}"))
        # Before the model's layout: other data can change it (a vocabulary built from the training set).
        # A checkpoint written before runs recorded their data has no record to compare.
        changed = data_differences(state["data"], self.data_record()) if "data" in state else []
        if changed:
            raise TrainingError(f"{source} was trained on other data than this run reads ({'; '.join(changed)}): "
                                "has a data file changed? Resume with the data it was trained on, train into a new "
                                "output folder, or replace the run there with --overwrite (overwrite=True)")
        saved_layout = state.get("model_layout")
        if saved_layout is not None and saved_layout != model_layout(self.model):
            raise TrainingError(another.format("its model has other parameters: "
                                               + layout_difference(saved_layout, model_layout(self.model))))
        ranks = len(state["rng"])
        if ranks != self.dist.world_size:
            raise TrainingError(f"{source} was written by {ranks} process(es), this run has {self.dist.world_size}; "
                                f"resume with the same number of processes (--nproc_per_node={ranks})")
        try:
            self.model.load_state_dict(state["model"])
            if self.ema is not None:
                self.ema.load_state_dict(state["ema"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as error:  # a checkpoint of another model or optimiser
            raise TrainingError(another.format(first_line(error))) from None
        # Fields added to _Progress after a checkpoint was written take their defaults.
        known = {f.name for f in fields(_Progress)}
        self.progress = _Progress(**{k: v for k, v in state["progress"].items() if k in known})
        self._saved_step = self.progress.step
        set_rng_state(state["rng"][self.dist.rank])

    def _truncate_metrics_log(self, step: int) -> None:
        """Drop log records written after the checkpoint we resume from (they will be redone), and a last
        line torn by a kill or a full disk during its append (with a warning)."""
        if not self.dist.is_main or not self.metrics_path.is_file():
            return
        records = read_jsonl(self.metrics_path, torn_last_line="drop")
        kept = [record for record in records if record.get("step", 0) <= step]
        with self._writing(METRICS):
            write_text_atomic(self.metrics_path, "".join(dumps_strict(record) + "\n" for record in kept))

    # ------------------------------------------------------------------ training
    def fit(self, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
        """Train to ``max_steps`` (or early stop), test the best checkpoint, write results.json.

        An output folder that holds a run (finished or not) is refused unless ``resume`` or ``overwrite``
        says what to do with it (:func:`longattn.train.outputs.check_output_folder`). ``resume=True``
        continues exactly from ``checkpoints/last.pt`` (or the previous checkpoint when the newest is
        damaged); for a run that already finished it does nothing but say so and returns the saved
        results. ``overwrite=True`` replaces the run in the folder.
        """
        try:
            results = self._fit(resume, overwrite)
            run_finished()
            return results
        except RuntimeError as error:
            if self.dist.enabled and is_timeout(error):
                raise TrainingError(f"rank {self.dist.rank}: another rank did not answer within {timeout_seconds():g} s "
                                    "(hung or killed?); the last checkpoint is kept; set LONGATTN_DIST_TIMEOUT_S "
                                    "to wait longer") from error
            if self.dist.enabled and is_lost_peer(error):
                raise TrainingError(f"rank {self.dist.rank}: lost the connection to another rank (it stopped: its "
                                    "own output says why); the last checkpoint is kept") from error
            raise
        finally:
            self.release()

    def _fit(self, resume: bool, overwrite: bool) -> dict[str, Any]:
        # Every rank reads the folder alike (nothing is written yet), so every rank refuses alike.
        check_output_folder(self.out_dir, resume=resume, overwrite=overwrite, locked=True)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        last = self.checkpoint_dir / "last.pt"
        if self.dist.is_main:
            # left by a run killed mid-write; we hold the lock
            remove_temporary_files(self.checkpoint_dir)
            remove_temporary_files(self.out_dir, names=(METRICS, RESULTS, "config.yaml"))
        finished = read_finished(self.out_dir) if resume else None
        if finished is not None:
            if finished.get("fingerprint") != self.fingerprint:
                raise TrainingError(f"{self.finished_path} belongs to a run with another configuration; use another "
                                    "output folder, or replace the run there with --overwrite (overwrite=True)")
            if self.dist.is_main:
                print(f"the run in {self.out_dir} already finished at step {finished['results']['steps']}; "
                      "nothing to do", file=sys.stderr)
            barrier(self.dist)
            return finished["results"]
        if resume and (last.is_file() or previous_path(last).is_file()):
            self.load_checkpoint(last)
            self._truncate_metrics_log(self.progress.step)
            if self.dist.is_main:
                print(f"resuming from {self.checkpoint_dir} at step {self.progress.step}", file=sys.stderr)
        else:
            if resume and self.dist.is_main:
                print(f"no checkpoint at {last}; starting from scratch", file=sys.stderr)
            seed_everything(self.seed + self.dist.rank)
            if self.dist.is_main:
                clear_run(self.out_dir)  # a fresh run replaces what an earlier run left (allowed by check_output_folder)
        barrier(self.dist)
        reset_peak_memory(self.device)
        self._train()
        return self._finish()

    def _train(self) -> None:
        s, p = self.settings, self.progress
        self.model.train()
        stream = self._train_batches()
        bar = optional_import("tqdm.auto").tqdm(total=s.max_steps, initial=p.step, desc="train", disable=not self._show_progress())
        lines = self._progress_lines()
        if lines is not None:
            lines.start_heartbeat()
        try:
            self._train_steps(stream, bar, lines)
        finally:
            if lines is not None:
                lines.stop_heartbeat()
        bar.close()

    def _train_steps(self, stream: Iterator[Any], bar: Any, lines: ProgressLines | None) -> None:
        s, p = self.settings, self.progress
        while p.step < s.max_steps and not p.stopped_early:
            started, cpu_started = time.perf_counter(), time.process_time()
            try:
                losses = self._optimizer_step(stream)
                self._unread.append((p.step + 1, p.epoch, losses))
            except Exception:
                self._read_losses(lines, after_error=True)  # a non-finite loss before it is the error to report
                raise
            p.step += 1
            bar.update(1)
            logging = p.step % s.log_every == 0 or p.step == s.max_steps
            validating = self.val_data is not None and (p.step % s.eval_every == 0 or p.step == s.max_steps)
            every = s.checkpoint_every
            saving = (validating and every is None) or (every is not None and p.step % every == 0) or \
                p.step == s.max_steps
            if logging or validating or saving:
                self._read_losses(lines)
            if logging:
                record = {"split": "train", "step": p.step, "epoch": p.epoch, "loss": p.window[0] / p.window[2],
                          "aux_loss": p.window[1] / p.window[2], "lr": self.scheduler.get_last_lr()[0]}
                self._log(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                p.window = [0.0, 0.0, 0]
            p.train_time_s += time.perf_counter() - started
            if validating:
                self._validate()
            p.cpu_time_s += time.process_time() - cpu_started
            if saving:
                self.save_checkpoint()
            last = p.step == s.max_steps or p.stopped_early
            if lines is not None:
                lines.stepped(p.step)
            if lines is not None and (logging or last or lines.due()):
                if not (logging or validating or saving or self.dist.enabled):
                    self._read_losses(lines)  # a line due between log steps (one rank alone: no all-reduce)
                lines.maybe_write(p.step, p.history[-1] if p.history else None, self.select_metric, last)
            if self.on_step_end is not None:
                self.on_step_end(self, p.step)

    def _progress_lines(self) -> ProgressLines | None:
        """Off a terminal (stdout is a file or a pipe): progress lines on stdout, with a first line that says what
        the run will do."""
        s, p = self.settings, self.progress
        if not (s.progress and self.dist.is_main) or sys.stdout.isatty() or p.step >= s.max_steps:
            return None
        examples = s.batch_size * s.grad_accum * self.dist.world_size
        validation = (f"validation every {s.eval_every} steps" + (f", early stopping after {s.patience} without "
                      "improvement" if s.patience else "") if self.val_data is not None else "no validation")
        epochs = s.max_steps / self.steps_per_epoch
        print(f"train: {s.max_steps} optimiser steps ({epochs:.3g} epoch{'' if epochs == 1 else 's'} of "
              f"{self.steps_per_epoch}), {examples} examples per step, {validation}"
              + (f"; resuming at step {p.step}" if p.step else "")
              + (f"; a progress line every {s.progress_every_s:g} s" if s.progress_every_s else ""), flush=True)
        return ProgressLines(s.max_steps, p.step, examples, s.progress_every_s)

    def _optimizer_step(self, stream: Iterator[Any]) -> Tensor:
        """One optimiser step over ``grad_accum`` micro-batches; returns [mean task loss, mean aux loss, gradient
        norm (0 without clipping)] as a float64 tensor on the device, read later (:meth:`_read_losses`)."""
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for micro in range(s.grad_accum):
            batch = to_device(next(stream), self.device)
            sync = micro == s.grad_accum - 1 or not self.dist.enabled
            context = self.ddp_model.no_sync() if not sync else contextlib.nullcontext()
            with context:
                with self._autocast():
                    out = self.step_fn(self.ddp_model, batch)
                    aux = collect_aux_losses(self.model)
                    aux_total = sum(aux.values()) if aux else None
                    loss = out.loss + aux_total if aux_total is not None else out.loss
                self.scaler.scale(loss / s.grad_accum).backward()
            aux_value = (out.loss.new_zeros((), dtype=torch.float64) if aux_total is None
                         else aux_total.detach().double())
            parts += [out.loss.detach().double(), aux_value]
        losses = torch.stack(parts).view(s.grad_accum, 2).sum(0) / s.grad_accum
        norm = losses.new_zeros(())
        if s.clip_norm is not None:
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.clip_norm).detach().double()
        self.progress.last_lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return torch.cat([losses, norm.view(1)])

    def _read_losses(self, lines: ProgressLines | None, after_error: bool = False) -> None:
        """The losses of the steps since the last read, brought to the host in one synchronisation (at each log,
        validation and checkpoint, not per step: on a GPU a read per step would stall the queue of kernels), added
        to the log window, the validation's running mean and the progress lines. A non-finite loss (or gradient
        norm, with clipping) stops the run there, before anything after the step before it is logged or saved.

        The global batch's loss is the mean over ranks (whose gradients DDP averages): the same on every rank, so
        every rank stops at the same read. ``after_error``: reading after an exception, on this rank only."""
        if not self._unread:
            return
        values = torch.stack([v for _, _, v in self._unread])
        if not after_error:
            values[:, :2] = all_reduce_mean(values[:, :2], self.dist)
        p, check_norm = self.progress, self.settings.clip_norm is not None and not self.scaler.is_enabled()
        unread, self._unread = self._unread, []
        for (step, epoch, _), (task, aux, norm) in zip(unread, values.tolist()):
            if not math.isfinite(task + aux):
                self._stop_non_finite("loss", task + aux, step, epoch)
            if check_norm and not math.isfinite(norm):  # fp16's scaler skips such steps itself
                self._stop_non_finite("gradient norm", norm, step, epoch)
            if after_error:
                continue
            p.window = [p.window[0] + task, p.window[1] + aux, p.window[2] + 1]
            p.since_eval = [p.since_eval[0] + task, p.since_eval[1] + 1]
            if lines is not None:
                lines.add(task)

    def _stop_non_finite(self, what: str, value: float, step: int, epoch: int) -> None:
        """Stop before anything after ``step - 1`` is logged or saved: no NaN reaches a checkpoint."""
        kept = (f"the last checkpoint ({self.checkpoint_dir / 'last.pt'}, step {self._saved_step}) is intact"
                if self._saved_step is not None else "no checkpoint was written yet")
        raise TrainingError(
            f"non-finite training {what} ({value}) at step {step} (epoch {epoch}); stopped at step "
            f"{max(step, self.progress.step)} with nothing logged or saved after step {step - 1}; {kept}. Lower the "
            "learning rate, set gradient clipping, or check the inputs for NaN/inf"
        )

    def _validate(self) -> None:
        s, p = self.settings, self.progress
        result = self.evaluate(self.val_data, "val")
        value = result[self.select_metric]
        improved = self._improved(value)
        if improved:
            p.best_value, p.best_step, p.evals_without_improvement = value, p.step, 0
            best = self.checkpoint_dir / "best.pt"
            weights = {"model": self.evaluated_model().state_dict(), "step": p.step, "val": result}
            self._on_main(lambda: save_atomic(weights, best), "checkpoints/best.pt")
        else:
            p.evals_without_improvement += 1
            # never before min_evals validations: a run stopped at its third validation has seen too little
            if (s.patience is not None and p.evals_without_improvement >= s.patience
                    and len(p.history) + 1 >= s.min_evals):
                p.stopped_early = True
        if s.stop_at is not None and (value >= s.stop_at if self.select_mode == "max" else value <= s.stop_at):
            p.stopped_early = True  # the target is reached (Zoology stops MQAR runs at 99% validation accuracy)
        # "epoch" counts finished passes: a validation right after an epoch's last batch belongs to that epoch.
        # train_time_s: training time so far (validation excluded), the x axis of learning curves against time
        record = {"split": "val", "step": p.step, "epoch": p.epoch, **result, "best": improved,
                  "train_loss": p.since_eval[0] / max(1, p.since_eval[1]), "lr": p.last_lr,
                  "train_time_s": round(p.train_time_s, 3)}
        p.since_eval = [0.0, 0]
        p.history.append(record)
        self._log(record)
        barrier(self.dist)

    def _finish(self) -> dict[str, Any]:
        p = self.progress
        best = self.checkpoint_dir / "best.pt"
        val_result: dict[str, Any] | None = None
        if best.is_file():
            state = load_checkpoint(best, map_location=self.device)
            load_weights(self.model, state["model"], best)  # with EMA: the averaged weights become the model's
            if self.ema is not None:
                self.ema.module.load_state_dict(state["model"])
            val_result = state["val"]
        test_result = self.evaluate(self.test_data, "test") if self.test_data is not None else None
        if test_result is not None:
            self._log({"split": "test", "step": p.best_step if p.best_step is not None else p.step, **test_result})
        memory, memory_kind = peak_memory_mb(self.device)
        results = {
            **self.run_info,
            "parameters": sum(t.numel() for t in self.model.parameters() if t.requires_grad),
            "seed": self.seed,
            "steps": p.step,
            "epochs": p.epoch + p.batches_in_epoch / max(1, len(self._epoch_batches(p.epoch))),
            "best_step": p.best_step,
            "stopped_early": p.stopped_early,
            "val": val_result,
            "test": test_result,
            "train_time_s": round(p.train_time_s, 3),
            "cpu_time_s": round(p.cpu_time_s, 3),
            "peak_memory_mb": round(memory, 1),
            "peak_memory_kind": memory_kind,
            "device": str(self.device),
            "world_size": self.dist.world_size,
            "precision": self.settings.precision,
            "history": p.history,
            # a run stopped at train.stop_at reached its target: converged, however its loss was moving
            "convergence": convergence(p.history, self.select_metric, mode=self.select_mode,
                                       target_reached=self.settings.stop_at is not None and p.stopped_early),
            "data_order": self.data_order(),
        }
        if self.dist.is_main and results["convergence"] is not None and not results["convergence"]["converged"]:
            warn(f"{self.out_dir}: {results['convergence']['text']}")

        def write() -> None:
            if self.write_results is not None:
                self.write_results(results)
            # written last: its presence means the run (training, test, results) is complete
            write_text_atomic(self.finished_path,
                              dumps_strict({"fingerprint": self.fingerprint, "results": results}, indent=2, default=str))

        self._on_main(write, "the results (results.json, checkpoints/finished.json)")
        return results

