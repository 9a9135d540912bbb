"""``longattn bench forecast-step``: per-step CPU time of forecasters, alternating between source trees."""

import json
import shutil
from pathlib import Path

import pytest

from longattn.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"


def test_steps_are_timed_in_the_source_tree_given_and_alternate(tmp_path, capsys):
    from forecast_csv import write_series

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_series(data_dir / "national_illness.csv", rows=400)
    other = tmp_path / "other" / "src"
    shutil.copytree(SRC / "longattn", other / "longattn", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    assert main(["bench", "forecast-step", "--data-dir", str(data_dir), "--dataset", "ili", "--models", "dlinear",
                 "--horizon", "24", "--set", "data.seq_len=24", "--src", str(SRC), "--src", str(other),
                 "--steps", "2", "--warmup", "1", "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "forecast_step.json").read_text())["rows"]
    assert [(r["model"], r["source"]) for r in rows] == [("dlinear", str(SRC)), ("dlinear", str(other))]
    for row in rows:
        assert row["longattn"] == str(Path(row["source"]).resolve())  # the worker imported that tree
        assert len(row["cpu_ms"]) == 2 and row["median_cpu_ms"] > 0 and row["median_wall_ms"] > 0
        assert row["horizon"] == 24 and row["batch"] == 32 and row["step"] == "train"
        assert row["peak_rss_bytes"] > 2**20  # the worker's own peak, at least torch's
    table = (out / "forecast_step.md").read_text()
    assert table.splitlines()[0].startswith("| model | horizon | step | batch | source | CPU ms / step |")
    assert table.splitlines()[2].endswith("| 1.00 |")  # the first source is the reference


def test_eval_times_a_no_grad_validation_batch_of_the_eval_batch_size(tmp_path):
    from forecast_csv import write_series

    write_series(tmp_path / "national_illness.csv", rows=400)
    out = tmp_path / "out"
    assert main(["bench", "forecast-step", "--data-dir", str(tmp_path), "--dataset", "ili", "--models", "dlinear",
                 "--horizon", "24", "--set", "data.seq_len=24", "--set", "train.eval_batch_size=16", "--eval",
                 "--steps", "2", "--warmup", "0", "--rounds", "1", "--out", str(out)]) == 0
    (row,) = json.loads((out / "forecast_step.json").read_text())["rows"]
    assert row["step"] == "eval" and row["batch"] == 16 and len(row["cpu_ms"]) == 2
    assert "| dlinear | 24 | eval | 16 |" in (out / "forecast_step.md").read_text()


def test_a_failing_worker_says_which_model_and_tree(tmp_path):
    from longattn.bench.forecast_step import run_forecast_steps

    with pytest.raises(RuntimeError, match="no-such-model with"):
        run_forecast_steps(str(tmp_path), "ili", ["no-such-model"], 24, [], [str(SRC)], steps=1, warmup=0, rounds=1)
