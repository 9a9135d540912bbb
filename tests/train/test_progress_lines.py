"""Progress by the clock: off a terminal a training run prints a line at least every ``progress_every_s`` seconds
whatever its step rate: between log steps, and inside a step (or a validation) longer than the interval."""

from __future__ import annotations

import contextlib
import re

import pytest
from fake_clock import FakeClock

from longattn.cli import main
from longattn.train.loop import ProgressLines


def _simulate(step_s: int, steps: int, log_every: int, every_s: float = 60.0) -> list[tuple[float, str]]:
    """A run of ``steps`` steps of ``step_s`` seconds each on a fake clock, as the loop drives ProgressLines, with
    the heartbeat looking every second; the lines with their times."""
    clock, written = FakeClock(), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProgressLines, "clock", staticmethod(clock))
        lines = ProgressLines(steps, 0, 8, every_s, write=lambda line: written.append((clock.now, line)))
        for step in range(1, steps + 1):
            for _ in range(step_s):  # the step runs; the heartbeat thread looks at the clock each second
                clock.now += 1
                lines.beat()
            lines.add(1.0)
            lines.stepped(step)
            if step % log_every == 0 or step == steps or lines.due():
                lines.maybe_write(step, None, "accuracy", last=step == steps)
    return written


@pytest.mark.parametrize("step_s", [2, 7, 75, 200])  # fast steps, the (20 per log step), longer than 60 s
def test_a_line_at_least_every_60_s_whatever_the_step_rate(step_s):
    written = _simulate(step_s, steps=40, log_every=20)
    times = [0.0] + [when for when, _ in written]
    assert max(b - a for a, b in zip(times, times[1:])) <= 60
    assert written[-1][1].startswith("train step 40/40 (100%)") and written[-1][1].endswith("done")
    if step_s > 60:  # inside a step: the heartbeat says which one is under way
        assert any(re.match(r"train step \d+/40 \(\d+%\): step \d+ \(or its validation\) under way for 1 min 0 s", line)
                   for _, line in written)


def test_fast_steps_print_no_more_than_the_interval_asks():
    written = _simulate(1, steps=600, log_every=10)
    assert len(written) <= 600 / 60 + 1  # about one per 60 s (the heartbeat may write one as a step ends)


def test_zero_interval_keeps_one_line_per_log_step():
    written = _simulate(100, steps=6, log_every=2, every_s=0)
    assert [re.match(r"train step (\d+)", line)[1] for _, line in written] == ["2", "4", "6"]


def test_a_run_writes_lines_between_its_log_steps(tmp_path):
    """The loop asks the clock after every step, not only at log steps (a near-zero interval: a line each step)."""
    log = tmp_path / "stdout.txt"
    args = ["train", "--task", "listops", "--attention", "softmax", "--out", str(tmp_path / "run"),
            *(a for s in ("train.max_steps=6", "train.eval_every=100", "train.batch_size=4", "train.log_every=100",
                          "train.progress_every_s=1e-9", "data.options.num_examples=24", "model.dim=16",
                          "model.hidden=32") for a in ("--set", s))]
    with open(log, "w") as handle, contextlib.redirect_stdout(handle):
        assert main(args) == 0
    steps = re.findall(r"^train step (\d+)/6 \(\d+%\): loss [\d.]+,", log.read_text(), re.M)
    assert steps == ["1", "2", "3", "4", "5", "6"]
