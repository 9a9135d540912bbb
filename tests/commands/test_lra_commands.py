"""The train / eval / compare / sweep / noise commands, on the in-memory stand-in for longattn.data.lra."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

import lra_stub
from longattn import attention
from longattn.cli import main
from longattn.config import read_yaml
from longattn.experiment.config import resolve_config
from longattn.experiment.grid import load_sweep, sweep_rows
from longattn.tasks.lra import LRA_CONFIGS, LRATask

TINY = ["--set", "train.max_steps=2", "--set", "train.eval_every=2", "--set", "model.dim=8",
        "--set", "model.hidden=16", "--set", "data.options.num_examples=12", "--set", "train.batch_size=4",
        "--set", "optim.warmup_steps=0", "--set", "optim.schedule=linear"]


@pytest.fixture(autouse=True)
def stub_data(lra_stub_data, monkeypatch):
    monkeypatch.setattr(LRATask, "data_api", types.SimpleNamespace(**vars(lra_stub_data)))  # a copy we may edit


def test_train_eval_and_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "listops", "--attention", "softmax", "--out", str(out), *TINY]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "listops" and results["attention"] == "softmax"
    assert (out / "config.yaml").is_file() and (out / "metrics.jsonl").is_file()
    assert main(["eval", "--out", str(out), "--split", "val"]) == 0
    evaluated = json.loads((out / "eval_val_best.json").read_text())
    assert evaluated["accuracy"] == pytest.approx(results["val"]["accuracy"])  # same best weights, eval mode
    # resuming a finished run with the same options is a no-op; with other options it is refused
    assert main(["train", "--task", "listops", "--attention", "softmax", "--out", str(out), "--resume", *TINY]) == 0
    code = main(["train", "--task", "listops", "--out", str(out), "--resume", *TINY, "--set", "optim.lr=0.5"])
    assert code == 2 and "differs from the one saved" in capsys.readouterr().err


def test_unknown_config_key_is_a_clear_cli_error(tmp_path, capsys):
    code = main(["train", "--task", "listops", "--out", str(tmp_path), "--set", "train.learning_rate=1"])
    err = capsys.readouterr().err
    assert code == 2 and "train.learning_rate" in err and "max_steps" in err


def test_compare_rejects_an_unknown_mechanism_before_training(tmp_path, capsys):
    for names in (["softmax,skeletn"], ["softmax", "skeletn"]):  # either list spelling
        with pytest.raises(SystemExit) as stop:
            main(["compare", "--task", "listops", "--attentions", *names, "--out", str(tmp_path / "c")])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "unknown mechanism 'skeletn' (did you mean 'skeleton'?)" in err
    assert not (tmp_path / "c").exists()


def test_compare_writes_table_results_and_plot(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--task", "listops", "--attentions", "softmax", "--preset", "demo",
                 "--out", str(out), *TINY, "--set", "data.max_len=null", "--set", "data.train.num_examples=12",
                 "--set", "data.val.num_examples=6", "--set", "data.test.num_examples=5", "--no-cost"])
    assert code == 0
    table = (out / "table.md").read_text()
    assert "| softmax" in table and "test accuracy" in table
    summary = json.loads((out / "results.json").read_text())
    assert [r["attention"] for r in summary["runs"]] == ["softmax"]
    assert summary["runs"][0]["results"][0]["test"]["examples"] == 5
    assert (out / "compare.png").stat().st_size > 1000
    # one line per finished run (stdout is no terminal here): which run, its result, the time left
    printed = capsys.readouterr().out
    assert re.search(r"^\[1/3\] done: softmax / listops seed 0 \(\d+ s; test accuracy [\d.]+\); elapsed \d+ s, "
                     r"about \d+ s left$", printed, re.M)
    assert re.search(r"^\[3/3\] done: softmax / listops seed 2 .*; elapsed \d+ s, all 3 ended$", printed, re.M)


class RecordingDataset(torch.utils.data.Dataset):
    """Logs the index of every training example handed to a loader, in order."""

    def __init__(self, inner, log: list[int]) -> None:
        self.inner, self.log = inner, log

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        self.log.append(index)
        return self.inner[index]


def test_compare_pairs_seeds_that_see_the_same_data_order_and_writes_learning_curves(tmp_path, monkeypatch, capsys):
    log: list[int] = []
    original = lra_stub.build_dataset

    def recording(name, split="train", data_dir=None, **options):
        dataset = original(name, split, data_dir, **options)
        return RecordingDataset(dataset, log) if split == "train" else dataset

    monkeypatch.setattr(LRATask.data_api, "build_dataset", recording)
    # the checkpoints' data record reads every example once: through the inner dataset, so the log holds the loaders' draws only
    from longattn.train import loop

    record = loop.dataset_record
    monkeypatch.setattr(loop, "dataset_record",
                        lambda dataset: record(dataset.inner if isinstance(dataset, RecordingDataset) else dataset))
    out = tmp_path / "cmp"
    # no --seeds: the demo preset's default of 3 seeds
    assert main(["compare", "--task", "listops", "--attentions", "skein,softmax", "--preset", "demo",
                 "--out", str(out), *TINY, "--set", "data.train.num_examples=12", "--no-cost",
                 "--workers", "1"]) == 0  # in this process: the recording dataset is patched here
    # runs in order skein s0, s1, s2, softmax s0, s1, s2; each draws 2 batches of 4 training examples
    runs = [log[i:i + 8] for i in range(0, len(log), 8)]
    assert len(runs) == 6
    assert runs[0:3] == runs[3:6], "a seed must give the same data order to every mechanism"
    assert len({tuple(run) for run in runs[0:3]}) == 3, "different seeds must give different orders"
    summary = json.loads((out / "results.json").read_text())
    assert summary["seeds"] == [0, 1, 2] and summary["reference"] == "softmax"
    orders = [[r["data_order"] for r in run["results"]] for run in summary["runs"]]
    assert orders[0] == orders[1] and len(set(orders[0])) == 3
    skein = summary["runs"][0]
    assert skein["difference"]["seeds"] == [0, 1, 2] and skein["test_summary"]["n"] == 3
    history = skein["results"][0]["history"]
    assert all("loss" in record and record["train_time_s"] > 0 for record in history)
    table = (out / "table.md").read_text()
    assert "Δ test vs softmax" in table and "reference" in table and "s.e." in table
    curves = json.loads((out / "curves.json").read_text())["curves"]
    assert [c["label"] for c in curves] == ["skein", "softmax"] and all(len(c["seeds"]) == 3 for c in curves)
    assert (out / "curves_listops.png").stat().st_size > 1000 and "| skein" in (out / "curves.md").read_text()
    # the same curves from the folder alone (runs found on disk, seeds grouped by their folder)
    for name in ("curves.json", "curves.md", "curves_listops.png"):
        (out / name).unlink()
    assert main(["curves", str(out)]) == 0
    again = json.loads((out / "curves.json").read_text())["curves"]
    assert sorted(c["label"] for c in again) == ["skein", "softmax"]
    assert sorted(again, key=lambda c: c["label"])[0]["points"] == curves[0]["points"]
    assert (out / "curves_listops.png").is_file() and "| softmax" in capsys.readouterr().out


def test_compare_reference_must_be_compared(tmp_path, capsys):
    code = main(["compare", "--attentions", "skein", "--reference", "softmax", "--out", str(tmp_path / "c")])
    assert code == 2 and "--reference 'softmax'" in capsys.readouterr().err


def test_curves_command_on_a_folder_without_runs_is_a_clear_error(tmp_path, capsys):
    assert main(["curves", str(tmp_path)]) == 2
    assert "no run results" in capsys.readouterr().err


def test_sweep_grid_and_variants(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("""title: toy
preset: standard
attention: softmax
tasks: [listops, retrieval]
grid:
  model.layers: [1, 2]
paper:
  "layers=1": {listops: 10.0}
""")
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(sweep), "--out", str(out), "--seeds", "0", *TINY]) == 0
    table = (out / "table.md").read_text()
    assert "layers=1" in table and "layers=2" in table and "retrieval" in table and "Paper" in table
    assert "Paired difference from layers=1" in table and (out / "curves_retrieval.png").is_file()
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert len(cells) == 4 and all(len(c["test"]) == 1 for c in cells)
    # resume reuses the finished runs instead of training again
    before = (out / "layers=1" / "listops" / "seed0" / "results.json").stat().st_mtime_ns
    assert main(["sweep", "--config", str(sweep), "--out", str(out), "--seeds", "0", "--resume", *TINY]) == 0
    assert (out / "layers=1" / "listops" / "seed0" / "results.json").stat().st_mtime_ns == before


def test_sweep_reference_must_be_a_row_and_is_checked_before_training(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("attention: softmax\ntasks: [listops]\ngrid: {model.layers: [1, 2]}\n")
    code = main(["sweep", "--config", str(sweep), "--reference", "layers=3", "--out", str(tmp_path / "o"), *TINY])
    assert code == 2 and "layers=1, layers=2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_sweep_file_with_unknown_key_is_rejected(tmp_path, capsys):
    sweep = tmp_path / "bad.yaml"
    sweep.write_text("attention: softmax\ngrids: {model.layers: [1]}\n")
    assert main(["sweep", "--config", str(sweep), "--out", str(tmp_path / "o")]) == 2
    assert "grids" in capsys.readouterr().err


def test_noise_command_adds_the_dataset_option(tmp_path, monkeypatch):
    seen = []
    original = lra_stub.build_dataset

    def recording(name, split="train", data_dir=None, **options):
        seen.append(options.get("noise_amplitude"))
        return original(name, split, data_dir, **options)

    monkeypatch.setattr(LRATask.data_api, "build_dataset", recording)
    out = tmp_path / "noise"
    assert main(["noise", "--attentions", "softmax", "--levels", "0,4", "--preset", "demo", "--out", str(out),
                 "--seeds", "0", *TINY]) == 0
    assert set(seen) == {0, 4}
    assert "noise_amplitude=4" in (out / "table.md").read_text()


# --------------------------------------------------------------------------- shipped files


def _option_paths(overrides: dict) -> list[tuple[str, str]]:
    return [(k.split(".")[1], k.split(".")[2]) for k in overrides if k.startswith("attention_options.")]


def _check_options(mechanism: str, option: str, where: str) -> None:
    # Options of mechanisms that are registered here must exist; others are checked once they land.
    if mechanism in attention.available():
        assert option in attention.get_spec(mechanism).option_names, f"{where}: {mechanism}.{option}"


@pytest.mark.parametrize("path", sorted((LRA_CONFIGS / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_sweeps_load_and_name_real_options(path):
    spec = load_sweep(path)
    rows = sweep_rows(spec)
    assert rows
    for _, mechanism, overrides in rows:
        for text in overrides:
            key = text.split("=", 1)[0]
            if key.startswith("attention_options."):
                _check_options(key.split(".")[1], key.split(".")[2], path.name)
        for task in spec.get("tasks", []):
            resolve_config(task, spec.get("preset", "standard"), None, overrides, attention=mechanism)
    for key in spec.get("grid") or {}:
        if key.startswith("attention_options."):
            _check_options(key.split(".")[1], key.split(".")[2], path.name)


@pytest.mark.parametrize("path", sorted(LRA_CONFIGS.glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_presets_name_real_options(path: Path):
    if path.parent.name == "sweeps":
        return
    for mechanism, options in (read_yaml(path).get("attention_options") or {}).items():
        for option in options:
            _check_options(mechanism, option, str(path))
