"""One line per finished run of a grid: which run, its result, and how long the grid has left.

``[3/21] done: softmax / listops seed 2 (7 s; test accuracy 0.3347); elapsed 21 s, about 2 min 6 s left``

Printed with a flush on stdout whether or not it is a terminal (a grid under ``nohup`` or in a CI log shows the
same lines), by the sequential grid runner and by the worker pool alike. The estimate is the wall time per run
so far times the runs left, so with ``--workers N`` it already counts N runs training at once.

With ``--workers``, whose runs print into their own ``log.txt``, the pool also calls :meth:`GridProgress.beat`
while it waits: at least every :attr:`GridProgress.every_s` seconds a line with each running run's latest step
(the last progress line of its log) and the time left, the queued runs counted (:meth:`GridProgress.left_s`):

``[3/21] running: skein / listops seed 0 (step 120/400, 30%), fsat / listops seed 0 (step 40/400, 10%); elapsed
4 min 2 s, about 31 min left``
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable

from longattn.tasks.base import get_task
from longattn.train.loop import run_convergence
from longattn.utils import duration

__all__ = ["GridProgress", "duration", "score"]


def score(task: str, results: dict[str, Any] | None) -> str:
    """``test <metric> <value>`` of a finished run (the task's selection metric; validation if no test), with
    ``; not converged`` when it ended still improving, or ``""``."""
    metric = get_task(task).select_metric
    convergence = run_convergence(results or {}, metric)
    mark = "; not converged" if convergence is not None and not convergence["converged"] else ""
    for split in ("test", "val"):
        value = (results or {}).get(split) or {}
        if isinstance(value.get(metric), (int, float)):
            return f"{split} {metric} {value[metric]:.4g}{mark}"
    return mark.removeprefix("; ")


# The training loop's progress line (longattn.train.loop.ProgressLines): the step reached, of how many
_STEP_LINE = re.compile(r"^train step (\d+)/(\d+)", re.M)


def latest_step(log: Path | None) -> tuple[int, int] | None:
    """(step, total) of the last progress line in the run's ``log``, or None before its first one."""
    try:
        with open(log, "rb") as handle:  # the end of the file: a long run's log grows
            handle.seek(max(0, handle.seek(0, 2) - 8192))
            found = _STEP_LINE.findall(handle.read().decode("utf-8", "replace"))
    except (OSError, TypeError):
        return None
    return (int(found[-1][0]), int(found[-1][1])) if found else None


class GridProgress:
    """Counts a grid's runs as they end (``total`` of them to train) and prints a line for each; with
    ``workers`` at once, :meth:`began` and :meth:`beat` add the lines of the runs under way."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    every_s = 60.0  # the longest silence while runs are under way

    def __init__(self, total: int, write: Callable[[str], Any] | None = None, workers: int = 1) -> None:
        self.total, self.workers = total, workers
        self.ended = 0
        self.ran = 0  # runs that trained (done or failed); the skipped ones took no time
        self.run_seconds = 0.0  # their own wall time, summed
        self.started = self.last_line = self.clock()
        self.running: dict[str, tuple[float, Path | None]] = {}  # label -> (when it began, its log)
        self.write = write or (lambda line: print(line, flush=True))

    def began(self, label: str, log: Path | None = None) -> None:
        """A run started in a worker; ``log``: where its progress lines go."""
        self.running[label] = (self.clock(), log)

    def left_s(self, now: float) -> float | None:
        """Wall time left: the runs under way finish their fraction, the queued ones take a run's time each, all
        spread over the workers. A run's time: the mean of the finished ones, else what the runs under way
        reached so far predicts (None before either)."""
        fractions = {}
        for label, (began, log) in self.running.items():
            step = latest_step(log)
            fractions[label] = (now - began, step[0] / step[1] if step and step[1] else 0.0)
        if self.ran:
            per_run = self.run_seconds / self.ran
        else:
            predicted = [spent / done for spent, done in fractions.values() if done > 0]
            if not predicted:
                return None
            per_run = sum(predicted) / len(predicted)
        queued = self.total - self.ended - len(self.running)
        work = sum(max(0.0, per_run - spent) if done == 0 else per_run * (1 - done)
                   for spent, done in fractions.values()) + max(0, queued) * per_run
        return work / max(1, min(self.workers, self.total - self.ended))

    def beat(self) -> None:
        """While runs are under way: a line with each one's latest step, once ``every_s`` passed since the last."""
        now = self.clock()
        if now - self.last_line < self.every_s or not self.running:
            return
        runs = []
        for label, (began, log) in self.running.items():
            step = latest_step(log)
            runs.append(f"{label} (" + (f"step {step[0]}/{step[1]}, {100 * step[0] / step[1]:.0f}%" if step
                                        else f"starting, {duration(now - began)}") + ")")
        self.write(f"[{self.ended}/{self.total}] running: {', '.join(runs)}; {self._when(now)}")
        self.last_line = now

    def _when(self, now: float) -> str:
        elapsed = now - self.started
        if self.ended == self.total:
            return f"elapsed {duration(elapsed)}, all {self.total} ended"
        left = self.left_s(now)
        return f"elapsed {duration(elapsed)}" + (f", about {duration(left)} left" if left is not None else "")

    def _line(self, status: str, text: str, label: str | None = None, seconds: float = 0.0) -> None:
        self.ended += 1
        self.ran += status != "skipped"
        self.run_seconds += seconds
        self.running.pop(label, None)
        now = self.clock()
        self.write(f"[{self.ended}/{self.total}] {status}: {text}; {self._when(now)}")
        self.last_line = now

    def done(self, label: str, seconds: float, result: str = "") -> None:
        """A run that finished: its run time and result."""
        self._line("done", f"{label} ({duration(seconds)}{'; ' + result if result else ''})", label, seconds)

    def failed(self, label: str, error: str, seconds: float = 0.0) -> None:
        self._line("failed", f"{label}: {error}", label, seconds)

    def skipped(self, label: str, reason: str) -> None:
        self._line("skipped", f"{label} ({reason})")
