"""How many runs train at once, and with how many threads each: the thread policy of the grid commands.

A grid (``compare``, ``paper ...``, ``finetune``, sweeps) must never ask for more threads than the cores it is
given: two torch threads spinning on one shared core cost about ten times the CPU of one (measured on a 2-core
machine under load: 30 training steps took 7.6 s of CPU at one thread, 71.5 s at two). The cores a process is
given are the fewest of

* its CPU affinity (``os.sched_getaffinity``: ``taskset``, a batch scheduler's cpuset),
* its cgroup CPU quota, rounded down (``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us / cpu.cfs_period_us`` of v1:
  a container's ``--cpus``),

and ``OMP_NUM_THREADS``, when set, is the thread budget the user chose instead. A grid whose worker count is not
given trains one run per thread of the budget, one thread each (its models are small: a second thread helps a
run less than a second run does); ``--workers N`` shares the budget evenly among N runs. A single run uses the
whole budget. :meth:`ThreadPlan.describe` is the line a command prints first, so that the choice can be read.

This module imports neither torch nor anything heavy: the command line reads it before any run starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ThreadPlan", "affinity_cores", "cgroup_quota", "env_threads", "given_cores", "plan_threads"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cores() -> int:
    """The CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The process's cgroup CPU quota in cores (``1.5`` for ``--cpus 1.5``), or None when unlimited or unknown.

    cgroup v2: ``cpu.max`` holds ``QUOTA PERIOD`` or ``max PERIOD``; v1: ``cpu/cpu.cfs_quota_us`` (-1: none) over
    ``cpu/cpu.cfs_period_us``."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def given_cores(affinity: int, quota: float | None) -> int:
    """The whole cores a process may keep busy: its affinity, capped by its quota rounded down (at least 1)."""
    cores = affinity if quota is None else min(affinity, math.floor(quota))
    return max(1, cores)


def env_threads(environ: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as a whole number of at least 1, None when unset or empty; anything else is an error
    that names the variable."""
    text = environ.get("OMP_NUM_THREADS", "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"OMP_NUM_THREADS must be a whole number of at least 1, got {text!r}")
    return value


@dataclass(frozen=True)
class ThreadPlan:
    """``workers`` runs at once, ``threads`` torch threads each; ``budget``: the threads they share, and
    ``source``: where that budget came from (the cores given, or OMP_NUM_THREADS)."""

    workers: int
    threads: int
    budget: int
    source: str

    def describe(self) -> str:
        """The first line a command prints: the choice and why."""
        runs = "1 run at a time" if self.workers == 1 else f"{self.workers} runs at once"
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        line = f"threads: {runs}, {threads} each (budget {self.budget}: {self.source})"
        if self.workers * self.threads > self.budget:
            line += f"; {self.workers * self.threads} threads on {self.budget}: oversubscribed, as --workers asked"
        return line


def plan_threads(runs: int, *, workers: int | None = None, grid: bool = True,
                 environ: Mapping[str, str] | None = None, affinity: int | None = None,
                 quota: float | None | str = "read") -> ThreadPlan:
    """The workers x threads of ``runs`` runs: ``workers`` (``--workers``; None: chosen here) and ``grid`` (several
    small runs: one thread each by default) as the command says, the cores as the process is given them
    (``affinity``, ``quota``: read from the system unless given, for tests) and ``OMP_NUM_THREADS`` from
    ``environ`` (default: this process's environment)."""
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    environ = os.environ if environ is None else environ
    affinity = affinity_cores() if affinity is None else affinity
    quota = cgroup_quota() if quota == "read" else quota
    chosen = env_threads(environ)
    if chosen is not None:
        budget, source = chosen, f"OMP_NUM_THREADS={chosen}"
    else:
        budget = given_cores(affinity, quota)
        limit = "no cgroup quota" if quota is None else f"cgroup quota {quota:g} cores"
        source = f"{budget} core{'s' if budget != 1 else ''} given: affinity {affinity}, {limit}"
    runs = max(1, runs)
    if workers is not None:
        count = min(workers, runs)
        return ThreadPlan(count, max(1, budget // count), budget, source)
    if grid:
        count = min(budget, runs)
        return ThreadPlan(count, 1 if count > 1 or runs > 1 else budget, budget, source)
    return ThreadPlan(1, budget, budget, source)
