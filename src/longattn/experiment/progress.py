"""One line per finished run of a grid: which run, its result, and how long the grid has left.

``[3/21] done: softmax / listops seed 2 (7 s; test accuracy 0.3347); elapsed 21 s, about 2 min 6 s left``

Printed with a flush on stdout whether or not it is a terminal (a grid under ``nohup`` or in a CI log shows the
same lines), by the sequential grid runner and by the worker pool alike. The estimate is the wall time per run
so far times the runs left, so with ``--workers N`` it already counts N runs training at once.
"""

from __future__ import annotations

import time
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


class GridProgress:
    """Counts a grid's runs as they end (``total`` of them to train) and prints a line for each."""

    def __init__(self, total: int, write: Callable[[str], Any] | None = None) -> None:
        self.total = total
        self.ended = 0
        self.ran = 0  # runs that trained (done or failed); the skipped ones took no time
        self.started = time.perf_counter()
        self.write = write or (lambda line: print(line, flush=True))

    def _line(self, status: str, text: str) -> None:
        self.ended += 1
        self.ran += status != "skipped"
        elapsed = time.perf_counter() - self.started
        left = self.total - self.ended
        if not left:
            when = f"elapsed {duration(elapsed)}, all {self.total} ended"
        elif self.ran:
            when = f"elapsed {duration(elapsed)}, about {duration(elapsed / self.ran * left)} left"
        else:
            when = f"elapsed {duration(elapsed)}"
        self.write(f"[{self.ended}/{self.total}] {status}: {text}; {when}")

    def done(self, label: str, seconds: float, result: str = "") -> None:
        """A run that finished: its run time and result."""
        self._line("done", f"{label} ({duration(seconds)}{'; ' + result if result else ''})")

    def failed(self, label: str, error: str) -> None:
        self._line("failed", f"{label}: {error}")

    def skipped(self, label: str, reason: str) -> None:
        self._line("skipped", f"{label} ({reason})")
