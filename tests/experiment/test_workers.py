"""A grid's runs in worker processes (``--workers``): the same runs and results as one at a time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from longattn.cli import main
from longattn.experiment.progress import GridProgress
from longattn.experiment.workers import LOG_NAME, threads_per_worker

from tests.forecast.test_train import write_periodic_csv


@pytest.fixture
def torch_threads():
    """Set torch's thread count for a test and give the old one back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _table(data_dir, out, *extra: str) -> list[str]:
    return ["forecast-table", "--data-dir", str(data_dir), "--datasets", "ili", str(data_dir / "short.csv"),
            "--horizons", "24", "--models", "dlinear", "skt", "encoder:no-such-attention", "--out", str(out),
            "--set", "train.epochs=1", "--set", "models.skt.d_model=16", "--set", "models.skt.heads=2",
            "--set", "data.seq_len=24", "--seeds", "0", "1", "--no-plot", *extra]


def _test_mse(out) -> dict[tuple[str, str, int], float]:
    rows = json.loads((out / "table.json").read_text())["rows"]
    return {(r["dataset"], r["model"], r["seed"]): r["mse"] for r in rows if "mse" in r}


def test_workers_train_the_same_runs_as_one_at_a_time(tmp_path, torch_threads, capsys):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_periodic_csv(data_dir / "national_illness.csv", rows=300)
    write_periodic_csv(data_dir / "short.csv", rows=40)  # its runs fail when they build their data

    torch_threads(1)
    assert main(_table(data_dir, tmp_path / "sequential")) == 1  # the failing cells are reported, not fatal
    capsys.readouterr()
    torch_threads(2)  # two workers of one thread each: the sequential run's thread count
    assert main(_table(data_dir, tmp_path / "parallel", "--workers", "2")) == 1
    printed = capsys.readouterr().out

    sequential, parallel = _test_mse(tmp_path / "sequential"), _test_mse(tmp_path / "parallel")
    assert set(sequential) == {("ili", m, s) for m in ("dlinear", "skt") for s in (0, 1)}
    assert parallel == sequential  # bit for bit
    assert "worker process(es) of 1 thread(s) each" in printed
    # a line per finished run: its time and score
    assert re.search(rf"done: ili/24 / skt seed 1 \(\d+ s; test mse {sequential[('ili', 'skt', 1)]:.4g}"
                     r"(; not converged)?\); "
                     r"elapsed [^,]+(, about .* left|, all \d+ ended)$", printed, re.M)
    # the run that failed inside a worker: one line here, its traceback in its folder's log
    assert "failed: short/24 / dlinear seed 0: TimeSeriesDataError: need seq_len" in printed
    assert "Traceback" in (tmp_path / "parallel" / "short" / "dlinear" / "h24_s0" / LOG_NAME).read_text()
    # every outcome line starts with how many runs have ended of how many: 1 to n, in order
    counts = re.findall(r"^\[(\d+)/(\d+)\] (?:done|failed|skipped): ", printed, re.M)
    assert [int(k) for k, _ in counts] == list(range(1, len(counts) + 1)) and len(counts) >= 5
    assert {int(n) for _, n in counts} == {len(counts)}
    # the option that cannot be resolved fails before anything trains
    assert "failed: ili/24 / encoder:no-such-attention" in printed
    table = (tmp_path / "parallel" / "table.md").read_text()
    assert table == (tmp_path / "sequential" / "table.md").read_text()
    for seed in (0, 1):  # each run's own output (its validation lines) went to its folder, not here
        assert "val" in (tmp_path / "parallel" / "ili" / "skt" / f"h24_s{seed}" / LOG_NAME).read_text()

    # finished runs are reused, as without workers: nothing trains again
    finished = tmp_path / "parallel" / "ili" / "skt" / "h24_s1" / "results.json"
    mtime = finished.stat().st_mtime
    main(_table(data_dir, tmp_path / "parallel", "--workers", "2"))
    assert finished.stat().st_mtime == mtime
    assert "done: ili" not in capsys.readouterr().out


def test_a_failed_seed_skips_the_later_seeds_of_its_cell(tmp_path, torch_threads, capsys):
    """As the sequential grid stops a cell at its first failed seed, the workers start none of the cell's later
    seeds: seeds 0 and 1 start together and fail, seeds 2 and 3 never start; the other cell trains all."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_periodic_csv(data_dir / "national_illness.csv", rows=300)
    write_periodic_csv(data_dir / "short.csv", rows=40)  # its runs fail when they build their data
    out = tmp_path / "out"
    torch_threads(2)
    assert main(["forecast-table", "--data-dir", str(data_dir), "--datasets", str(data_dir / "short.csv"), "ili",
                 "--horizons", "24", "--models", "dlinear", "--out", str(out), "--set", "train.epochs=1",
                 "--set", "data.seq_len=24", "--seeds", "0", "1", "2", "3", "--no-plot", "--workers", "2"]) == 1
    printed = capsys.readouterr().out
    for seed in (0, 1):
        assert f"failed: short/24 / dlinear seed {seed}: TimeSeriesDataError" in printed
    for seed in (2, 3):
        assert f"skipped: short/24 / dlinear seed {seed} (an earlier run of its group failed)" in printed
        assert not (out / "short" / "dlinear" / f"h24_s{seed}").exists()
    assert sorted(seed for (dataset, _, seed) in _test_mse(out) if dataset == "ili") == [0, 1, 2, 3]


def test_threads_are_shared_evenly():
    assert threads_per_worker(2, total=2) == 1
    assert threads_per_worker(4, total=16) == 4
    assert threads_per_worker(3, total=8) == 2
    assert threads_per_worker(4, total=2) == 1  # never fewer than one
    with pytest.raises(ValueError, match="at least 1"):
        threads_per_worker(0, total=2)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_workers_must_be_a_positive_whole_number(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as stop:
        main(["forecast-table", "--data-dir", str(tmp_path), "--datasets", "ili", "--out", str(tmp_path / "o"),
              "--workers", value])
    assert stop.value.code == 2
    assert "expected a whole number of at least 1" in capsys.readouterr().err


def test_compare_with_workers_gives_the_sequential_results(tmp_path, torch_threads, monkeypatch, capsys):
    pytest.importorskip("longattn.data.lra", reason="the LRA data module is not available")
    from tests.commands.test_lra_generated_data import TINY

    def accuracies(out) -> dict[tuple[str, int], dict]:  # test loss and accuracy of every run
        runs = json.loads((out / "results.json").read_text())["runs"]
        return {(run["attention"], result["seed"]): result["test"] for run in runs for result in run["results"]}

    argv = ["compare", "--task", "listops", "--attentions", "softmax,skein", "--seeds", "0,1", *TINY, "--no-cost"]
    torch_threads(1)
    assert main([*argv, "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    torch_threads(2)
    monkeypatch.setattr(GridProgress, "every_s", 0.0)  # a line of the runs under way at every poll of the pool
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("threads: 2 runs at once, 1 thread each")
    assert re.search(r"^\[\d/4\] running: \w+ / listops seed \d \((?:step \d+/\d+, \d+%|starting, \d+ s)\)", printed,
                     re.M)
    assert accuracies(tmp_path / "two") == accuracies(tmp_path / "one")
    assert len(accuracies(tmp_path / "two")) == 4
    assert (tmp_path / "two" / "skein" / "seed1" / LOG_NAME).is_file()
    assert "measured with up to 2 runs training at once" in (tmp_path / "two" / "table.md").read_text()
    assert "runs training at once" not in (tmp_path / "one" / "table.md").read_text()


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


def test_ctrl_c_stops_the_runs_in_progress_and_starts_no_queued_run(tmp_path):
    """Ctrl-C (SIGINT to the command's process group) ends the command at once: the workers' runs stop (they
    resume later from their checkpoints) and the queued runs never start."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_periodic_csv(data_dir / "national_illness.csv", rows=300)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "longattn.cli", "forecast-table", "--data-dir", str(data_dir), "--datasets",
               "ili", "--horizons", "24", "--models", "dlinear", "--seeds", "0", "1", "2", "--out", str(out),
               "--set", "data.seq_len=24", "--set", "train.epochs=100000", "--set", "train.patience=null",
               "--no-plot", "--workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True,  # its own process group, as a terminal's foreground job
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # The epoch's line is logged at validation, just before its checkpoint is written: wait for both.
        runs = [out / "ili" / "dlinear" / f"h24_s{seed}" for seed in (0, 1)]
        _wait_for(lambda: all((run / LOG_NAME).is_file() and "epoch 0" in (run / LOG_NAME).read_text()
                              and (run / "checkpoints" / "last.pt").is_file() for run in runs), 120,
                  "both workers to finish and checkpoint an epoch")
        os.killpg(process.pid, signal.SIGINT)
        printed, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130
    assert "interrupted: the runs in progress were stopped" in printed
    assert "leaked" not in printed  # no semaphore left behind by a stopped worker
    assert not (out / "ili" / "dlinear" / "h24_s2").exists()  # the queued run never started
    for seed in (0, 1):
        assert (out / "ili" / "dlinear" / f"h24_s{seed}" / "checkpoints" / "last.pt").is_file()
