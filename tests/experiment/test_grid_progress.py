"""A grid's progress by the clock: with --workers, a line at least every minute with each running run's latest
step (read from its log.txt), and a time left that counts the runs still queued; on a fake clock."""

from __future__ import annotations

import re

import pytest
from fake_clock import FakeClock

from longattn.experiment.progress import GridProgress, latest_step


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(GridProgress, "clock", staticmethod(fake))
    return fake


def _log(path, *steps: int, total: int = 400):
    path.write_text("train: 400 optimiser steps\n" + "".join(
        f"train step {step}/{total} ({100 * step // total}%): loss 2.3, 1 steps/s, elapsed 1 s, about 1 s left\n"
        for step in steps))
    return path


def test_a_line_at_least_every_minute_while_runs_train_in_workers(tmp_path, clock):
    written: list[tuple[float, str]] = []
    progress = GridProgress(6, write=lambda line: written.append((clock.now, line)), workers=2)
    logs = {name: tmp_path / f"{name}.txt" for name in ("a", "b", "c")}
    progress.began("a", logs["a"])
    progress.began("b", logs["b"])
    for second in range(1, 601):  # slow runs: none ends in ten minutes; the pool waits, polling each second
        clock.now = second
        _log(logs["a"], *range(4, second // 4 + 1, 4))  # 1 step a second, a line every 4 steps
        progress.beat()
    times = [0.0] + [when for when, _ in written]
    assert max(b - a for a, b in zip(times, times[1:])) <= 60
    assert len(written) == 10
    last = written[-1][1]
    assert re.fullmatch(r"\[0/6\] running: a \(step 148/400, 37%\), b \(starting, 10 min 0 s\); elapsed 10 min "
                        r"0 s, about .+ left", last), last


def test_time_left_counts_the_queued_runs(tmp_path, clock):
    progress = GridProgress(6, write=lambda line: None, workers=2)
    progress.began("a", _log(tmp_path / "a.txt", 100))
    progress.began("b", _log(tmp_path / "b.txt", 100))
    clock.now = 100.0  # both a quarter through after 100 s: a run takes 400 s
    # two under way (300 s left each) and four queued (400 s each), on two workers
    assert progress.left_s(clock.now) == pytest.approx((2 * 300 + 4 * 400) / 2)
    progress.done("a", 400.0)  # a finished run's own time is the estimate from then on
    assert progress.left_s(clock.now) == pytest.approx((300 + 4 * 400) / 2)


def test_no_estimate_before_any_step_and_no_line_without_runs_under_way(tmp_path, clock):
    written: list[str] = []
    progress = GridProgress(2, write=written.append, workers=2)
    assert progress.left_s(0.0) is None
    clock.now = 120.0
    progress.beat()
    assert written == []  # nothing under way: nothing to say
    progress.began("a", tmp_path / "missing.txt")
    clock.now = 200.0
    progress.beat()
    assert written == ["[0/2] running: a (starting, 1 min 20 s); elapsed 3 min 20 s"]


def test_latest_step_reads_the_last_progress_line(tmp_path):
    assert latest_step(_log(tmp_path / "log.txt", 20, 40, 60)) == (60, 400)
    assert latest_step(tmp_path / "none.txt") is None
    assert latest_step(_log(tmp_path / "empty.txt")) is None
