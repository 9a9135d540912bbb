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
from longattn.forecast.experiment import format_table, parse_overrides, resolve_run_config
from longattn.forecast.train import evaluate_forecaster, forecast_settings, train_forecaster
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


def _settings(**train):
    seed = train.pop("seed", 0)
    return forecast_settings(train, seed=seed)


def test_dlinear_learns_seasonal_series(series, tmp_path):
    data = _data(series)
    seed_everything(0)
    model = build_forecaster("dlinear", data.channels, 24, 6)
    untrained = evaluate_forecaster(model, data, "test")
    summary = train_forecaster(model, data, _settings(epochs=4, batch_size=16, lr=1e-2, patience=4), tmp_path / "run",
                               log=lambda *_: None)
    assert summary["test"]["mse"] < 0.1 * untrained["mse"]
    assert summary["test"]["windows"] == len(data.test)  # no drop_last in evaluation
    assert summary["val"]["windows"] == len(data.val)
    # Denormalised MAE is the scaled MAE times each target's train std (averaged over channels).
    assert summary["test"]["mae_denorm"] != pytest.approx(summary["test"]["mae"])
    # The reported test metrics are those of the final (best) weights.
    assert evaluate_forecaster(model, data, "test") == pytest.approx(summary["test"])


def test_settings_translate_forecast_config():
    settings = _settings(lr_schedule="halve", grad_clip=1.0, max_steps_per_epoch=7)
    assert (settings.schedule, settings.step_decay, settings.clip_norm) == ("step", 0.5, 1.0)
    assert (settings.select_metric, settings.select_mode, settings.eval_every_epoch) == ("mse", "min", True)
    assert settings.optimizer == "adam" and settings.patience == 3 and settings.drop_last
    assert _settings(lr_schedule="constant").schedule == "constant"
    with pytest.raises(ValueError, match="lr_schedule"):
        _settings(lr_schedule="cosine")
    with pytest.raises(ValueError, match="unknown train option"):
        _settings(select_mode="max")
    with pytest.raises(ValueError, match="patience"):
        _settings(patience=0)


def test_early_stopping_and_best_checkpoint(series, tmp_path):
    data = _data(series)
    seed_everything(0)
    model = build_forecaster("dlinear", data.channels, 24, 6)
    # lr = 0: the first epoch sets the best, every later one ties (no improvement) -> stop after 1 + patience.
    summary = train_forecaster(model, data, _settings(epochs=10, batch_size=16, lr=0.0, patience=2), tmp_path / "r",
                               log=lambda *_: None)
    assert summary["epochs_run"] == 3 and summary["best_epoch"] == 0
    best = load_checkpoint(tmp_path / "r" / "checkpoints" / "best.pt")["model"]
    assert all(torch.equal(best[k], v) for k, v in model.state_dict().items())


def test_best_checkpoint_is_tested_not_the_last(series, tmp_path):
    data = _data(series)
    seed_everything(0)
    model = build_forecaster("dlinear", data.channels, 24, 6)
    spe = len(data.train) // 16

    def spoil_after_first_epoch(trainer, step):  # later epochs end with useless weights: epoch 0 stays best
        if step > spe:
            with torch.no_grad():
                for param in trainer.model.parameters():
                    param.fill_(3.0)

    settings = _settings(epochs=3, batch_size=16, lr=1e-2, patience=5)
    summary = train_forecaster(model, data, settings, tmp_path / "r", log=lambda *_: None,
                               on_step_end=spoil_after_first_epoch)
    val_mses = [h["val_mse"] for h in summary["history"]]
    assert summary["best_epoch"] == 0 and val_mses[0] < min(val_mses[1:])
    assert summary["val"]["mse"] == pytest.approx(min(val_mses))
    assert evaluate_forecaster(model, data, "test") == pytest.approx(summary["test"])


def _skt(data):
    return build_forecaster("skt", data.channels, 24, 6, d_model=16, heads=2, attention="softmax", dropout=0.3)


class Interrupt(Exception):
    pass


def _interrupt_at(step):
    def hook(trainer, current):
        if current == step:
            raise Interrupt

    return hook


def test_interrupted_and_resumed_run_gives_identical_metrics(series, tmp_path):
    data = _data(series)
    settings = _settings(epochs=3, batch_size=16, lr=1e-3, patience=5, seed=3)
    seed_everything(3)
    straight = _skt(data)
    full = train_forecaster(straight, data, settings, tmp_path / "straight", log=lambda *_: None)
    spe = len(data.train) // 16  # drop_last: whole batches only
    assert full["epochs_run"] == 3 and [h["lr"] for h in full["history"]] == [1e-3, 5e-4, 2.5e-4]  # halve per epoch

    # Interrupted right after an epoch-end checkpoint, between two of them (resume redoes the lost steps) and
    # after a mid-epoch checkpoint (train.checkpoint_every), then resumed.
    assert spe >= 6
    for name, cut, extra in (("edge", spe, {}), ("mid", spe + 2, {}), ("mid_ckpt", spe + 3, {"checkpoint_every": 2})):
        cut_settings = _settings(epochs=3, batch_size=16, lr=1e-3, patience=5, seed=3, **extra)
        seed_everything(3)
        with pytest.raises(Interrupt):
            train_forecaster(_skt(data), data, cut_settings, tmp_path / name, log=lambda *_: None,
                             on_step_end=_interrupt_at(cut))
        if extra:
            saved = load_checkpoint(tmp_path / name / "checkpoints" / "last.pt")["progress"]
            assert saved["batches_in_epoch"] > 0 and saved["epoch"] == 1  # really mid-epoch
        torch.manual_seed(12345)  # a crash and restart leaves the process RNG anywhere
        seed_everything(3)
        restarted = _skt(data)
        resumed = train_forecaster(restarted, data, cut_settings, tmp_path / name, log=lambda *_: None)
        assert resumed["history"] == full["history"], name
        assert resumed["val"] == full["val"] and resumed["test"] == full["test"], name
        assert resumed["best_epoch"] == full["best_epoch"] and resumed["epochs_run"] == full["epochs_run"]
        for (key, a), b in zip(straight.state_dict().items(), restarted.state_dict().values()):
            assert torch.equal(a, b), (name, key)

    with pytest.raises(ValueError, match="another configuration"):
        train_forecaster(_skt(data), data, settings, tmp_path / "mid", log=lambda *_: None, fingerprint="other")


def test_resolve_run_config_and_overrides():
    config = {
        "data": {"seq_len": 96},
        "train": {"lr": 1e-4, "epochs": 10},
        "models": {"skt": {"d_model": 512, "attention": "skeleton",
                           "attention_options": {"skeleton": {"smoother": True}, "skein": {}}},
                   "dlinear": {"kernel_size": 25, "train": {"lr": 1e-3}}},
    }
    overrides = parse_overrides(["train.lr=1e-3", "model.d_model=64", "data.seq_len=36"])
    run = resolve_run_config(config, "skt", None, overrides)
    assert run["train"]["lr"] == 1e-3 and run["model"]["d_model"] == 64 and run["data"]["seq_len"] == 36
    assert run["model"]["attention_options"] == {"smoother": True}
    ablated = resolve_run_config(config, "skt", None, parse_overrides(["model.attention_options.smoother=false"]))
    assert ablated["model"]["attention_options"] == {"smoother": False}
    with pytest.raises(ValueError, match="--attention"):
        resolve_run_config(config, "skt", None, {"model.attention": "skein"})
    swapped = resolve_run_config(config, "skt", "softmax", {})
    assert swapped["model"]["attention"] == "softmax" and swapped["model"]["attention_options"] == {}
    assert resolve_run_config(config, "dlinear", None, {})["train"]["lr"] == 1e-3
    with pytest.raises(ValueError, match="takes no attention"):
        resolve_run_config(config, "dlinear", "softmax", {})
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["lr"])
    scoped = resolve_run_config(config, "dlinear", None, parse_overrides(["models.skt.d_model=8", "models.dlinear.kernel_size=5"]))
    assert scoped["model"] == {"kernel_size": 5}
    with pytest.raises(ValueError, match="must start with"):
        resolve_run_config(config, "skt", None, {"optim.lr": 1})


TINY = ["--set", "model.d_model=16", "--set", "model.heads=2", "--set", "model.d_ff=32", "--set", "train.epochs=2",
        "--set", "data.seq_len=24", "--set", "data.label_len=12"]


def test_cli_forecast_writes_results_and_plot(series, tmp_path, capsys):
    out = tmp_path / "cell"
    code = main(["forecast", "--dataset", str(series), "--model", "encoder", "--attention", "softmax",
                 "--pred-len", "6", "--out", str(out), *TINY])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    for key in ("dataset", "model", "attention", "options", "seed", "params", "val", "test", "time_seconds",
                "peak_memory_mb", "config"):
        assert key in results, key
    assert results["attention"] == "softmax" and results["config"]["data"]["seq_len"] == 24
    assert math.isfinite(results["test"]["mse"]) and results["params"] > 0
    assert (out / "forecast.png").stat().st_size > 1000
    assert main(["forecast", "--dataset", str(series), "--model", "dlinear", "--pred-len", "6", "--out",
                 str(tmp_path / "bad"), "--set", "model.depth=3"]) == 2
    assert "unknown option" in capsys.readouterr().err


def test_cli_table_layout_with_paper_numbers(tmp_path, capsys):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_periodic_csv(data_dir / "national_illness.csv", rows=300)
    out = tmp_path / "table"
    argv = ["forecast-table", "--data-dir", str(data_dir), "--datasets", "ili", "--horizons", "24", "--models",
            "dlinear", "skt:softmax", "encoder:no-such-attention", "--out", str(out), "--set", "train.epochs=1",
            "--set", "models.skt.d_model=16", "--set", "models.skt.heads=2", "--set", "data.seq_len=24"]
    assert main(argv) == 1  # one cell cannot run: reported, not fatal
    table = (out / "table.md").read_text()
    assert "| ili | 24 | 2.185 | 0.926 | 2.431 | 0.997 |" in table  # conference and journal SKT numbers
    assert "failed" in table
    rows = json.loads((out / "table.json").read_text())
    assert {r["model"] for r in rows if "mse" in r} == {"dlinear", "skt:softmax"}
    # Finished cells are reused: a second invocation trains nothing new.
    mtime = (out / "ili" / "dlinear" / "h24_s0" / "results.json").stat().st_mtime
    main(argv)
    assert (out / "ili" / "dlinear" / "h24_s0" / "results.json").stat().st_mtime == mtime
    capsys.readouterr()
    assert main(["forecast-table", "--data-dir", str(data_dir), "--datasets", "ili", "--horizons", "24", "--models",
                 "dlinear", "encoder:softmax", "--collect-only", "--out", str(out)]) == 0
    assert not (out / "ili" / "encoder-softmax").exists()
    assert "| ili | 24 | 2.185 |" in capsys.readouterr().out


def test_format_table_reports_deviation():
    rows = [{"dataset": "exchange", "horizon": 96, "model": "skt", "seed": s, "mse": m, "mae": 0.2}
            for s, m in ((0, 0.09), (1, 0.10))]
    table = format_table(rows, ["skt"])
    assert "| exchange | 96 | 0.086 | 0.204 |" in table and "0.095 | 0.200 | +10.5% |" in table
