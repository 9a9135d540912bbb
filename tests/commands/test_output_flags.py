"""The commands that train into --out refuse an --out that already holds runs unless told what to do with
them: --resume continues them, --overwrite trains them again (train, compare, compare sweep, the cross-validation
of paper singularformer-table4,
paper sktformer-table2, which resumes by default; finetune in tests/transfer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from longattn.cli import main
from reliability import CLEAR_ERROR, CORRECT_RESULT, OUTPUT_FOLDERS, bad_input
from tests.experiment.test_crossval import TINY as TINY_FOLDS, write_r8
from tests.forecast.test_train import write_periodic_csv

TINY = ["--set", "train.max_steps=2", "--set", "train.eval_every=2", "--set", "model.dim=8",
        "--set", "model.hidden=16", "--set", "data.options.num_examples=12", "--set", "train.batch_size=4",
        "--set", "optim.warmup_steps=0"]


@pytest.fixture(autouse=True)
def _stub(lra_stub_data):
    """LRA runs below use the in-memory stand-in for the LRA data."""


def stamps(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("results.json"))}


def refused_then_overwritten(argv: list[str], out: Path, capsys) -> None:
    """``argv`` trains into ``out``; again, it is refused with one line and changes nothing; with --overwrite it
    trains every run again."""
    assert main(argv) in (0, 1)
    before = stamps(out)
    assert before
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already hold" in err and "--resume" in err and "--overwrite" in err, err
    assert stamps(out) == before
    assert main([*argv, "--overwrite"]) in (0, 1)
    after = stamps(out)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in before)


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR)
def test_train(tmp_path, capsys):
    out = tmp_path / "run"
    refused_then_overwritten(["train", "--task", "listops", "--attention", "softmax", "--out", str(out), *TINY],
                             out, capsys)


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR)
def test_compare(tmp_path, capsys):
    out = tmp_path / "compare"
    refused_then_overwritten(["compare", "--task", "listops", "--attentions", "softmax", "linear", "--seeds", "0",
                              "--out", str(out), *TINY, "--no-cost"], out, capsys)


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR)
def test_compare_sweep(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("tasks: [listops]\nattention: softmax\ngrid:\n  model.layers: [1]\n")
    out = tmp_path / "sweep"
    refused_then_overwritten(["compare", "sweep", "--config", str(sweep), "--seeds", "0", "--preset", "demo",
                              "--out", str(out), *TINY], out, capsys)


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR)
def test_crossval_table4(tmp_path, capsys):
    out = tmp_path / "table4"
    refused_then_overwritten(["paper", "singularformer-table4", "--tasks", "r8", "--models", "post_ln", "--folds", "2", "--only-folds", "0",
                              "--data-dir", str(write_r8(tmp_path / "R8")), "--out", str(out),
                              *(a for s in TINY_FOLDS for a in ("--set", s))], out, capsys)


@bad_input(OUTPUT_FOLDERS, CORRECT_RESULT, cases=2)
def test_forecast_table_resumes_counts_only_finished_cells_and_overwrites_on_request(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_periodic_csv(data_dir / "national_illness.csv", rows=300)
    out = tmp_path / "table"
    argv = ["paper", "sktformer-table2", "--data-dir", str(data_dir), "--datasets", "ili", "--horizons", "24",
            "--models", "dlinear", "--seeds", "0", "1", "--set", "train.epochs=1", "--set", "data.seq_len=24",
            "--no-plot", "--out", str(out)]
    assert main(argv) == 0
    before = stamps(out)
    assert len(before) == 2
    # a cell whose run did not finish (its marker gone, its old results.json still there) is trained again
    (out / "ili" / "dlinear" / "h24_s1" / "checkpoints" / "finished.json").unlink()
    assert main(argv) == 0
    after = stamps(out)
    assert after["ili/dlinear/h24_s0/results.json"] == before["ili/dlinear/h24_s0/results.json"]  # reused
    assert after["ili/dlinear/h24_s1/results.json"] != before["ili/dlinear/h24_s1/results.json"]  # continued
    assert main([*argv, "--overwrite"]) == 0
    assert all(stamp != after[name] for name, stamp in stamps(out).items())  # every cell trained again
