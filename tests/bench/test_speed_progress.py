"""`bench speed` by the clock: a line at least every minute while a row's process runs (the bar moves only when
a row ends); on a fake clock, and the wait on a real child process calls the beat while it waits."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fake_clock import FakeClock

from longattn.bench import speed


def test_a_line_at_least_every_minute_while_rows_run(monkeypatch):
    clock, written = FakeClock(), []
    monkeypatch.setattr(speed.RowProgress, "clock", staticmethod(clock))
    progress = speed.RowProgress(3, write=lambda line: written.append((clock.now, line)))
    for ended, seconds in enumerate((88, 200, 30)):  # the silent 88 s row, a longer one, a short one
        progress.begin(f"skein at N={1024 << ended}", ended)
        for _ in range(seconds):
            clock.now += 1
            progress.beat()
    times = [0.0] + [when for when, _ in written]
    assert max(b - a for a, b in zip(times, times[1:])) <= 60
    assert written[0][1] == "bench: row 1/3 (skein at N=1024) under way for 1 min 0 s; elapsed 1 min 0 s"
    assert any(line.startswith("bench: row 2/3 (skein at N=2048) under way for 2 min 32 s") for _, line in written)
    assert written[-1][1] == ("bench: row 3/3 (skein at N=4096) under way for 12 s; elapsed 5 min 0 s, about 2 min "
                              "30 s left")  # once a row ended, the rows left are estimated


def test_the_wait_on_a_row_process_beats_while_it_runs():
    beats = []
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.5); print('{}')"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, _ = speed._communicate(proc, 30.0, lambda: beats.append(1))
    assert stdout.strip() == "{}" and len(beats) >= 2


def test_a_row_process_past_its_time_is_stopped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired):
        speed._communicate(proc, 0.5, lambda: None)
    assert proc.returncode is not None
