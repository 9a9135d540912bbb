"""A grid's runs in parallel worker processes (``--workers N`` of the grid commands).

Each (cell, seed) run is still an ordinary :func:`longattn.experiment.run.run` into its own folder, so a run
trained in a worker is the run the sequential grid would have trained with the same thread count, and resume
works the same way (a finished ``results.json`` is reused, an interrupted run continues from its last
checkpoint). The workers are a ``spawn`` process pool from the standard library (no fork of a process that
holds torch's thread pools); each worker runs the threads the grid's thread plan gives it
(:mod:`longattn.experiment.threads`), else an even share of ``torch.get_num_threads()`` of the calling process. A run's own output (its validation lines, warnings,
traceback) goes to ``log.txt`` in its folder; the calling process prints one line per finished run (its result,
the time elapsed and an estimate of the time left: :class:`longattn.experiment.progress.GridProgress`), and
at least once a minute a line with each running run's latest step.
As with any spawn pool, a script that calls the grid with workers must do so under
``if __name__ == "__main__":`` (the workers import the script); the ``longattn`` commands need nothing.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longattn.experiment.config import RunConfig
from longattn.experiment.run import run
from longattn.experiment.progress import GridProgress, score
from longattn.utils import optional_import

__all__ = ["Job", "Outcome", "run_jobs", "threads_per_worker", "LOG_NAME"]

LOG_NAME = "log.txt"

# How often the waiting pool looks at the clock for the progress line of the runs under way (GridProgress.beat)
POLL_S = 1.0

# The errors a run may raise for its own settings or data (a bad option, a missing file, a NaN loss): one run
# fails and the grid goes on. Anything else is a bug or a broken pool and stops the grid. The sequential runner
# (longattn.experiment.grid.run_cells) catches the same ones.
RUN_ERRORS: tuple[type[Exception], ...] = (ValueError, RuntimeError, FileNotFoundError, KeyError)


@dataclass(frozen=True)
class Job:
    """One run to train: ``key`` identifies it to the caller, ``label`` names it in the printed lines. Runs of
    one ``group`` (a grid cell's seeds) stop at the first that fails: the group's runs not started yet are
    skipped, as the sequential grid stops a cell at its first failed seed (None: no group)."""

    key: Any
    label: str
    config: RunConfig
    folder: Path
    group: Any = None
    resume: bool = False  # continue the interrupted run in ``folder``
    overwrite: bool = False  # replace the run in ``folder``


@dataclass(frozen=True)
class Outcome:
    """What came back from a job: its results, or the one-line error that stopped it."""

    results: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0


def threads_per_worker(workers: int, total: int | None = None) -> int:
    """An even share of ``total`` threads (default: this process's torch thread count) per worker, at least 1."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    total = torch.get_num_threads() if total is None else total
    return max(1, total // workers)


# Data built by one run of a worker is reused by its next run when the task's cache key matches (as in the
# sequential grid, which keeps one task's data at a time).
_WORKER_DATA_CACHE: dict[Any, Any] = {}
_interrupted = False  # set in a worker once Ctrl-C has reached it


def _start_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    # tqdm's default lock holds a multiprocessing semaphore, which a worker stopped by Ctrl-C would leave behind
    # (the resource tracker warns of it); a worker's bars never share a terminal, so a thread lock does
    optional_import("tqdm").tqdm.set_lock(threading.RLock())


def _train(config: RunConfig, folder: Path, resume: bool, overwrite: bool, log: bool, plots: bool) -> Outcome:
    """In a worker: one run, its output appended to ``folder/log.txt``; a run error comes back as text."""
    global _interrupted
    if _interrupted:  # a queued run that reached this worker after Ctrl-C: start nothing, write nothing
        return Outcome(error="KeyboardInterrupt: not started")
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    # line-buffered: what a run printed is in its log even if its worker is stopped (Ctrl-C) or killed
    with (open(folder / LOG_NAME, "a", encoding="utf-8", buffering=1) as handle, redirect_stdout(handle),
          redirect_stderr(handle)):
        try:
            results = run(config, folder, resume=resume, overwrite=overwrite, data_cache=_WORKER_DATA_CACHE,
                          log=print if log else None, plots=plots)
        except RUN_ERRORS as err:
            traceback.print_exc()
            return Outcome(error=f"{type(err).__name__}: {err}", seconds=time.perf_counter() - started)
        except KeyboardInterrupt:
            _interrupted = True
            raise
    return Outcome(results=results, seconds=time.perf_counter() - started)


def run_jobs(jobs: list[Job], workers: int, *, log: bool, plots: bool,
             threads: int | None = None) -> dict[Any, Outcome]:
    """Train ``jobs`` in ``workers`` processes of ``threads`` threads each (default: an even share), in the
    order given (each worker takes the next job when it is free); {job.key: outcome}.

    A run error ends that run and skips the runs of its group not started yet (their outcome: an error
    "not run: ..."); a crashed worker (e.g. killed for memory) or an unexpected exception
    stops the grid: the queued runs are cancelled and the error is raised once the runs in progress have
    ended (they are saved, and resume). Ctrl-C stops the runs in progress at once (they resume from their last
    checkpoint).
    """
    if not jobs:
        return {}
    workers = min(workers, len(jobs))  # fewer runs than workers: each gets a larger share of the threads
    threads = threads or threads_per_worker(workers)
    print(f"{len(jobs)} run(s) in {workers} worker process(es) of {threads} thread(s) each; "
          f"each run's output goes to {LOG_NAME} in its folder", flush=True)
    outcomes: dict[Any, Outcome] = {}
    others = set(multiprocessing.active_children())  # the caller's own child processes, not ours to stop
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(threads,))
    progress = GridProgress(len(jobs), workers=workers)
    pending: dict[Future, Job] = {}
    queued, failed_groups = deque(jobs), set()

    def start_next() -> None:
        # Submitted one at a time as workers free up (not all at once), so that a failure can still skip the
        # later runs of its group, and Ctrl-C finds nothing queued inside the pool.
        while queued:
            job = queued.popleft()
            if job.group is not None and job.group in failed_groups:
                reason = "an earlier run of its group failed"
                outcomes[job.key] = Outcome(error=f"not run: {reason}")
                progress.skipped(job.label, reason)
                continue
            pending[pool.submit(_train, job.config, job.folder, job.resume, job.overwrite, log, plots)] = job
            progress.began(job.label, job.folder / LOG_NAME)
            return

    try:
        for _ in range(workers):
            start_next()
        while pending:
            done, _ = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            progress.beat()  # the runs under way, once a minute
            for future in done:
                job = pending.pop(future)
                outcome = future.result()  # a crashed worker or a bug raises here and stops the grid
                outcomes[job.key] = outcome
                if outcome.error is None:
                    progress.done(job.label, outcome.seconds, score(job.config.task, outcome.results))
                else:
                    failed_groups.add(job.group)
                    progress.failed(job.label, f"{outcome.error} (traceback in {job.folder / LOG_NAME})",
                                    outcome.seconds)
            for _ in done:  # after every finished run is recorded: a failure among them skips its group
                start_next()
    except KeyboardInterrupt:
        # Ctrl-C reaches the workers too, but a worker whose run it stopped would take the next queued run:
        # stop them all now. Each interrupted run resumes from its last checkpoint when the grid is run again.
        pool.shutdown(wait=False, cancel_futures=True)
        for process in set(multiprocessing.active_children()) - others:
            process.terminate()
        pool.shutdown(wait=True)  # the pool sees its workers gone and closes its queues
        print("interrupted: the runs in progress were stopped; run the command again to resume them from their "
              "last checkpoint", flush=True)
        raise
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # the queued runs never start
        print("stopping the grid: waiting for the run(s) in progress to end (Ctrl-C stops them; they resume from "
              "their last checkpoint)", flush=True)
        raise
    pool.shutdown()
    return outcomes
