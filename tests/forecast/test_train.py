"""Forecast training: learning, early stopping, best checkpoint, exact resume, CLI and table output."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from longattn.cli import main
from longattn.data.timeseries import load_forecast_data
from longattn.experiment.config import resolve_config
from longattn.experiment.run import run
from longattn.tasks.base import get_task
from longattn.tasks.forecasting import evaluate_forecaster
from longattn.models.forecasters import build_forecaster
from longattn.train.checkpoint import load_checkpoint
from longattn.utils import seed_everything


def write_periodic_csv(path: Path, rows: int = 400, period: int = 12, channels: int = 2, seed: int = 0) -> None:
    """Seasonal series with a little noise: easy to forecast, so a trained model must beat a naive one."""
    rng = np.random.default_rng(seed)
    t = np.arange(rows)
    start = datetime(2002, 1, 1)
    lines = ["date," + ",".join([f"c{i}" for i in range(channels - 1)] + ["OT"])]
    for i in range(rows):
        values = [np.sin(2 * np.pi * t[i] / period + c) * (c + 1) + 0.05 * rng.normal() for c in range(channels)]
        lines.append((start + timedelta(weeks=i)).strftime("%Y-%m-%d %H:%M:%S") + "," + ",".join(f"{v:.6f}" for v in values))
    path.write_text("\r\n".join(lines) + "\r\n")


@pytest.fixture
def series(tmp_path) -> Path:
    path = tmp_path / "toy.csv"
    write_periodic_csv(path)
    return path


def _data(path: Path):
    return load_forecast_data(str(path), seq_len=24, label_len=12, pred_len=6)


def _config(series: Path, model: str = "dlinear", *overrides: str, attention: str | None = None, seed: int = 0,
            config_file: Path | None = None):
    return resolve_config("forecasting", None, config_file, list(overrides), model_name=model, attention=attention,
                          seed=seed, data={"dataset": str(series), "seq_len": 24, "label_len": 12, "pred_len": 6})


def _run(config, out: Path, **kwargs):
    """A run through the one run path; returns its results and the trained model."""
    seen = {}

    def keep(trainer, step):
        seen["model"] = trainer.model
        if kwargs.get("on_step_end"):
            kwargs["on_step_end"](trainer, step)

    results = run(config, out, resume=kwargs.get("resume", False), on_step_end=keep, plots=False)
    return results, seen["model"]


def test_dlinear_learns_seasonal_series(series, tmp_path):
    data = _data(series)
    seed_everything(0)
    untrained = evaluate_forecaster(build_forecaster("dlinear", data.channels, 24, 6), data, "test")
    summary, model = _run(_config(series, "dlinear", "train.epochs=4", "train.batch_size=16", "optim.lr=1e-2",
                                  "train.patience=4"), tmp_path / "run")
    assert summary["test"]["mse"] < 0.1 * untrained["mse"]
    assert summary["test"]["windows"] == len(data.test)  # no drop_last in evaluation
    assert summary["val"]["windows"] == len(data.val)
    # Denormalised MAE is the scaled MAE times each target's train std (averaged over channels).
    assert summary["test"]["mae_denorm"] != pytest.approx(summary["test"]["mae"])
    # The reported test metrics are those of the final (best) weights.
    assert evaluate_forecaster(model, data, "test") == pytest.approx(summary["test"])


def test_task_settings_and_earlier_config_names(series, tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("train: {lr_schedule: halve, grad_clip: 1.0, max_steps_per_epoch: 7}\n")
    config = _config(series, "dlinear", config_file=path)
    assert (config.optim.schedule, config.optim.step_decay, config.train.clip_norm) == ("step", 0.5, 1.0)
    task = get_task("forecasting")
    assert (task.select_metric, task.select_mode, config.train.eval_every_epoch) == ("mse", "min", True)
    assert config.optim.optimizer == "adam" and config.train.patience == 3 and config.train.drop_last
    path.write_text("train: {lr_schedule: cosine}\n")
    with pytest.raises(ValueError, match="lr_schedule"):
        _config(series, config_file=path)
    with pytest.raises(ValueError, match="train.patience must be >= 1"):
        _config(series, "dlinear", "train.patience=0")


def test_early_stopping_and_best_checkpoint(series, tmp_path):
    # lr = 0 is refused; a tiny lr with a constant schedule moves nothing measurable: the first epoch sets the
    # best, every later one ties (no improvement) -> stop after 1 + patience.
    summary, model = _run(_config(series, "dlinear", "train.epochs=10", "train.batch_size=16", "optim.lr=1e-30",
                                  "train.patience=2"), tmp_path / "r")
    assert summary["epochs_run"] == 3 and summary["best_epoch"] == 0
    best = load_checkpoint(tmp_path / "r" / "checkpoints" / "best.pt")["model"]
    assert all(torch.equal(best[k], v) for k, v in model.state_dict().items())


def test_best_checkpoint_is_tested_not_the_last(series, tmp_path):
    data = _data(series)
    spe = len(data.train) // 16

    def spoil_after_first_epoch(trainer, step):  # later epochs end with useless weights: epoch 0 stays best
        if step > spe:
            with torch.no_grad():
                for param in trainer.model.parameters():
                    param.fill_(3.0)

    summary, model = _run(_config(series, "dlinear", "train.epochs=3", "train.batch_size=16", "optim.lr=1e-2",
                                  "train.patience=5"), tmp_path / "r", on_step_end=spoil_after_first_epoch)
    val_mses = [h["mse"] for h in summary["history"]]
    assert summary["best_epoch"] == 0 and val_mses[0] < min(val_mses[1:])
    assert summary["val"]["mse"] == pytest.approx(min(val_mses))
    assert evaluate_forecaster(model, data, "test") == pytest.approx(summary["test"])


SKT = ("model.d_model=16", "model.heads=2", "model.dropout=0.3", "train.epochs=3", "train.batch_size=16",
       "optim.lr=1e-3", "train.patience=5")


class Interrupt(Exception):
    pass


def _interrupt_at(step):
    def hook(trainer, current):
        if current == step:
            raise Interrupt

    return hook


def _without_clock(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if k != "train_time_s"} for record in history]


def test_interrupted_and_resumed_run_gives_identical_metrics(series, tmp_path):
    data = _data(series)
    full, straight = _run(_config(series, "skt", *SKT, attention="softmax", seed=3), tmp_path / "straight")
    spe = len(data.train) // 16  # drop_last: whole batches only
    assert full["epochs_run"] == 3 and [h["lr"] for h in full["history"]] == [1e-3, 5e-4, 2.5e-4]  # halve per epoch

    # Interrupted right after an epoch-end checkpoint, between two of them (resume redoes the lost steps) and
    # after a mid-epoch checkpoint (train.checkpoint_every), then resumed.
    assert spe >= 6
    for name, cut, extra in (("edge", spe, ()), ("mid", spe + 2, ()), ("mid_ckpt", spe + 3, ("train.checkpoint_every=2",))):
        config = _config(series, "skt", *SKT, *extra, attention="softmax", seed=3)
        with pytest.raises(Interrupt):
            _run(config, tmp_path / name, on_step_end=_interrupt_at(cut))
        if extra:
            saved = load_checkpoint(tmp_path / name / "checkpoints" / "last.pt")["progress"]
            assert saved["batches_in_epoch"] > 0 and saved["epoch"] == 1  # really mid-epoch
        torch.manual_seed(12345)  # a crash and restart leaves the process RNG anywhere
        resumed, restarted = _run(config, tmp_path / name, resume=True)
        # every validation record alike but its elapsed training time (a clock reading)
        assert _without_clock(resumed["history"]) == _without_clock(full["history"]), name
        assert resumed["val"] == full["val"] and resumed["test"] == full["test"], name
        assert resumed["best_epoch"] == full["best_epoch"] and resumed["epochs_run"] == full["epochs_run"]
        for (key, a), b in zip(straight.state_dict().items(), restarted.state_dict().values()):
            assert torch.equal(a, b), (name, key)

    with pytest.raises(ValueError, match="differs from the one saved"):
        _run(_config(series, "skt", *SKT, "optim.lr=0.5", attention="softmax", seed=3), tmp_path / "mid", resume=True)


def test_model_options_attention_and_scoped_overrides(series):
    config = _config(series, "skt", "optim.lr=1e-3", "model.d_model=64", "data.seq_len=36")
    assert config.optim.lr == 1e-3 and config.model["d_model"] == 64 and config.data.seq_len == 24  # flag wins
    assert config.attention == "skeleton" and config.chosen_attention_options()["smoother"] is True
    ablated = _config(series, "skt", "model.attention_options.smoother=false")
    assert ablated.chosen_attention_options()["smoother"] is False
    with pytest.raises(ValueError, match="--attention"):
        _config(series, "skt", "model.attention=skein")
    swapped = _config(series, "skt", attention="softmax")
    assert swapped.attention == "softmax" and swapped.chosen_attention_options() == {}
    assert _config(series, "dlinear").optim.lr == 1e-3
    with pytest.raises(ValueError, match="takes no attention"):
        _config(series, "dlinear", attention="softmax")
    scoped = _config(series, "dlinear", "models.skt.d_model=8", "models.dlinear.kernel_size=5")
    assert scoped.model == {"kernel_size": 5, "individual": False}
    with pytest.raises(ValueError, match="did you mean 'optim'"):
        _config(series, "skt", "optimm.lr=1")


TINY = ["--set", "model.d_model=16", "--set", "model.heads=2", "--set", "model.d_ff=32", "--set", "train.epochs=2",
        "--set", "data.seq_len=24", "--set", "data.label_len=12"]


def test_cli_forecast_writes_results_and_plot(series, tmp_path, capsys):
    out = tmp_path / "cell"
    code = main(["forecast", "--dataset", str(series), "--model", "encoder", "--attention", "softmax",
                 "--pred-len", "6", "--out", str(out), *TINY])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    for key in ("dataset", "model", "attention", "options", "seed", "params", "val", "test", "time_seconds",
                "peak_memory_mb", "config", "provenance"):
        assert key in results, key
    assert results["attention"] == "softmax" and results["config"]["data"]["seq_len"] == 24
    assert math.isfinite(results["test"]["mse"]) and results["params"] > 0
    assert (out / "forecast.png").stat().st_size > 1000
    assert main(["forecast", "--dataset", str(series), "--model", "dlinear", "--pred-len", "6", "--out",
                 str(tmp_path / "bad"), "--set", "model.depth=3"]) == 2
    assert "unknown config key 'model.depth'" in capsys.readouterr().err


def test_cli_table_layout_with_paper_numbers(tmp_path, capsys):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_periodic_csv(data_dir / "national_illness.csv", rows=300)
    out = tmp_path / "table"
    argv = ["forecast-table", "--data-dir", str(data_dir), "--datasets", "ili", "--horizons", "24", "--models",
            "dlinear", "skt:softmax", "encoder:no-such-attention", "--out", str(out), "--set", "train.epochs=1",
            "--set", "models.skt.d_model=16", "--set", "models.skt.heads=2", "--set", "data.seq_len=24",
            "--seeds", "0", "--no-plot"]
    assert main(argv) == 1  # one cell cannot run: reported, not fatal
    table = (out / "table.md").read_text()
    assert table.startswith("| Dataset | H | dlinear MSE | dlinear MAE | skt:softmax MSE |")
    assert "| ili | 24 | " in table and "failed" in table
    assert "(2.185)" not in table  # SKT with softmax attention is not the published SKTformer
    assert "Test MSE minus dlinear's" in table and "1 seed: no interval" in table  # paired by seed
    rows = json.loads((out / "table.json").read_text())["rows"]
    assert {r["model"] for r in rows if "mse" in r} == {"dlinear", "skt:softmax"}
    # Finished cells are reused: a second invocation trains nothing new.
    mtime = (out / "ili" / "dlinear" / "h24_s0" / "results.json").stat().st_mtime
    main(argv)
    assert (out / "ili" / "dlinear" / "h24_s0" / "results.json").stat().st_mtime == mtime
    capsys.readouterr()
    assert main(["forecast-table", "--data-dir", str(data_dir), "--datasets", "ili", "--horizons", "24", "--models",
                 "dlinear", "encoder:softmax", "--collect-only", "--out", str(out), "--seeds", "0"]) == 0
    assert not (out / "ili" / "encoder-softmax").exists()
    printed = capsys.readouterr().out
    assert "| ili | 24 | " in printed and "Not run yet (dataset H model: missing seeds): ili 24 encoder:softmax: 0." in printed
    assert (out / "ili_mse.png").stat().st_size > 1000  # the per-dataset MSE-against-horizon plot


def test_a_forecasting_run_prints_its_data_line_and_passes_the_file_options(tmp_path, capsys):
    path = tmp_path / "toy.csv"
    path.write_text("date,c0,OT\n" + "".join(f"2002-01-{1 + i // 24:02d} {i % 24:02d}:00:00,{i % 7},-9999\n"
                                             for i in range(60)) + "2002-01-03 10:00:00,5,-9999\n")
    task = get_task("forecasting")
    with pytest.raises(ValueError, match="goes back in time"):
        task.build_data(resolve_config("forecasting", None, None, [], model_name="dlinear", data={
            "dataset": str(path), "seq_len": 8, "label_len": 4, "pred_len": 2}))
    task.build_data(resolve_config("forecasting", None, None, ["data.strict_time_order=false"], model_name="dlinear",
                                   data={"dataset": str(path), "seq_len": 8, "label_len": 4, "pred_len": 2}))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: data ")]
    assert lines == ["note: data toy.csv: 61 rows x 2 columns; 2002-01-01 00:00:00 to 2002-01-03 11:00:00; "
                     "frequency h (median step 60 min); 0 repeated row(s); 1 row(s) out of time order kept "
                     "(line 62); fill values -9999: OT 61"]
