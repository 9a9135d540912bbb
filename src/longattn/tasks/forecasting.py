"""Long-term time-series forecasting (SKTformer / S^3 Table 2) as a task of the one run path.

The data are the standard benchmark CSVs (ETT, Electricity, Exchange, Traffic, Weather, ILI) or any CSV
with a date column (:mod:`longattn.data.timeseries`); the models are the registered forecasters
(:mod:`longattn.models.registry`, family ``forecaster``). The loss is the MSE on the target columns of the
``pred_len`` future steps; metrics are MSE/MAE in scaled units (the papers') and in original units; the
best epoch is picked on validation MSE.

Training defaults (:attr:`ForecastTask.overlay`) are those of the FEDformer/Autoformer code that the
SKTformer forecasting runs build on: Adam, lr 1e-4 halved every epoch, batch 32, 10 epochs, early stopping
after 3 epochs without improvement, validation after every epoch, the incomplete last batch dropped.
Per-dataset presets (``configs/forecast/<dataset>.yaml``) write only their differences.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from longattn.config import ConfigError, option
from longattn.data.timeseries import ForecastData, load_forecast_data, resolve_series
from longattn.forecast.paper import paper_for_model
from longattn.models.registry import model_defaults
from longattn.tasks.base import Task, TaskData, register_task
from longattn.train.loop import MetricFn, StepFn, StepOutput, evaluate, mae, mse
from longattn.train.settings import OptimConfig
from longattn.utils import note

__all__ = ["ForecastDataConfig", "ForecastTask", "evaluate_forecaster", "find_preset", "forecast_metrics",
           "forecast_step"]

FORECAST_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "forecast"


@dataclass
class ForecastDataConfig:
    """The ``data`` section of a forecasting run (see :func:`longattn.data.timeseries.load_forecast_data`)."""

    dataset: str | None = option(None, help="a benchmark name (ETTm2, exchange, ...) or a CSV path")
    data_dir: str | None = option(None, help="folder holding the benchmark CSV files")
    seq_len: int = option(96, ge=1, help="input window")
    label_len: int = option(48, ge=0, help="decoder start tokens of encoder-decoder forecasters")
    pred_len: int = option(96, ge=1, help="horizon")
    features: Literal["M", "S", "MS"] = "M"
    target: str = "OT"
    calendar: bool = option(False, help="give the models calendar features")
    kind: str | None = option(None, help="split family: ETTh, ETTm or custom (default: the dataset's)")
    date_column: str = "date"
    strict_time_order: bool = option(True, help="false: keep rows whose date repeats with other values or goes back")
    fill_values: Literal["keep", "interpolate"] = option(
        "keep", help="fill values such as -9999: keep them as numbers (as the papers) or interpolate them")
    horizons: list[int] = option([96, 192, 336, 720], help="horizons of a table (forecast-table)")
    use_test: bool = option(True, help="false: the run has no test split (choosing settings on validation only)")


# The authors' time-series smoother (S^3 code): 8 segment averages, ortho FFT, kernel-3 conv, ELU, with the
# papers' r = s1 = s2 = 8 and FEDformer's dropout 0.05 (the LRA defaults are 0.1 / 0.5).
SKT_SKELETON_OPTIONS = {
    "smoother": True, "smoother_segments": 8, "smoother_kernel_size": 3, "smoother_activation": "elu",
    "smoother_segment_average": True, "smoother_fft_norm": "ortho", "s1": 8, "s2": 8, "dropout": 0.05,
    "smoother_dropout": 0.05,
}

_OPTIM_KEYS = {name for name in OptimConfig.__dataclass_fields__}
_SCHEDULES = {"halve": {"schedule": "step", "step_decay": 0.5}, "constant": {"schedule": "constant"}}
_TOP_KEYS = {"task", "model_name", "attention", "seed", "data", "model", "attention_options", "optim", "train",
             "models"}


def forecast_step(data: ForecastData) -> StepFn:
    """Step function: the MSE on the target columns of the forecast part; predictions/targets for the metrics."""
    pred_len, targets = data.train.pred_len, data.target_columns

    def step(model: nn.Module, batch: list[Tensor]) -> StepOutput:
        x, y, x_mark, _ = batch
        out = model(x, x_mark if x_mark.shape[-1] else None)
        # MS: the model forecasts every channel, the loss and metrics see the target only.
        pred, truth = out[..., targets], y[:, -pred_len:, targets]
        return StepOutput(nn.functional.mse_loss(pred, truth), pred, truth)

    return step


def _denormalised(metric: MetricFn, data: ForecastData) -> MetricFn:
    def in_original_units(predictions: Tensor, targets: Tensor) -> float:
        cols = data.target_columns
        return metric(data.scaler.inverse_transform(predictions.double(), cols),
                      data.scaler.inverse_transform(targets.double(), cols))

    return in_original_units


def forecast_metrics(data: ForecastData) -> dict[str, MetricFn]:
    """MSE/MAE over every window, step and target channel in scaled units (the papers') and original units."""
    return {"mse": mse, "mae": mae, "mse_denorm": _denormalised(mse, data), "mae_denorm": _denormalised(mae, data)}


def split_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """A Trainer evaluation in the layout of forecasting's results.json."""
    return {**{k: result[k] for k in ("mse", "mae", "mse_denorm", "mae_denorm")}, "windows": result["examples"]}


@torch.no_grad()
def evaluate_forecaster(model: nn.Module, data: ForecastData, split: str = "test", batch_size: int = 256,
                        device: torch.device | str = "cpu") -> dict[str, Any]:
    """Forecast metrics of ``model`` on one split (every window once), in the layout of results.json."""
    result = evaluate(model.to(device), getattr(data, split), default_collate, forecast_step(data),
                      forecast_metrics(data), batch_size=batch_size, device=device, split=split)
    return split_metrics(result)


def find_preset(dataset: str) -> Path | None:
    """``configs/forecast/<dataset>.yaml`` in the current folder, else the one shipped with longattn, if any."""
    try:
        stem = resolve_series(dataset)[0]
    except ValueError:
        stem = Path(dataset).stem
    for folder in (Path.cwd() / "configs" / "forecast", FORECAST_CONFIGS):
        candidate = folder / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    return None


def _upgrade_train(train: dict[str, Any], optim: dict[str, Any]) -> None:
    """Older forecast configs kept optimiser keys in ``train`` under other names; move them in place."""
    for key in list(train):
        if key in _OPTIM_KEYS:
            optim[key] = train.pop(key)
    if "grad_clip" in train:
        train["clip_norm"] = train.pop("grad_clip")
    if "lr_schedule" in train:
        schedule = train.pop("lr_schedule")
        if schedule not in _SCHEDULES:
            raise ConfigError(f"train.lr_schedule must be one of {', '.join(_SCHEDULES)}, got {schedule!r}")
        optim.update(_SCHEDULES[schedule])


@register_task("forecasting", description="long-term time-series forecasting (SKTformer Table 2)")
class ForecastTask(Task):
    family = "forecasting"
    data_config = ForecastDataConfig
    model_family = "forecaster"
    default_model = "skt"
    model_input_names = ("channels", "seq_len", "pred_len", "calendar_dim")
    select_metric = "mse"
    select_mode = "min"
    preset_dir = FORECAST_CONFIGS
    overlay = {
        # min_evals 1: the papers' protocol validates once per epoch (early stopping counts epochs), however few
        "train": {"epochs": 10, "batch_size": 32, "eval_batch_size": 256, "patience": 3, "drop_last": True,
                  "eval_every_epoch": True, "min_evals": 1, "device": "cpu"},
        "optim": {"lr": 1e-4, "optimizer": "adam", "schedule": "step", "step_decay": 0.5},
        "models": {"skt": {"attention_options": {"skeleton": SKT_SKELETON_OPTIONS}},
                   "dlinear": {"optim": {"lr": 1e-3}}},
    }

    def upgrade(self, layer: dict[str, Any], model_name: str | None, attention: str | None) -> dict[str, Any]:
        """Read the earlier forecast grammar too: optimiser keys and ``lr_schedule``/``grad_clip`` under
        ``train``, top-level ``horizons``, model options directly under ``models.<name>``, and
        ``model.attention_options.<option>`` for the chosen attention's options."""
        layer = copy.deepcopy(layer)
        if "horizons" in layer:
            layer.setdefault("data", {})["horizons"] = layer.pop("horizons")
        if isinstance(layer.get("train"), dict):
            _upgrade_train(layer["train"], layer.setdefault("optim", {}))
        model = layer.get("model")
        if isinstance(model, dict):
            if "attention" in model:
                raise ConfigError("choose the attention with --attention (or model:attention in a table), not --set")
            if "attention_options" in model:
                chosen = attention or (model_defaults(model_name).get("attention") if model_name else None)
                options = model.pop("attention_options")
                layer.setdefault("attention_options", {}).setdefault(chosen, {}).update(options or {})
        for name, part in (layer.get("models") or {}).items():
            if not isinstance(part, dict):
                continue
            for key in [k for k in part if k not in _TOP_KEYS]:
                part.setdefault("model", {})[key] = part.pop(key)
            if isinstance(part.get("train"), dict):
                _upgrade_train(part["train"], part.setdefault("optim", {}))
        return layer

    def build_data(self, config: Any) -> TaskData:
        d = config.data
        if d.dataset is None:
            raise ConfigError("forecasting needs a dataset: --dataset NAME (or data.dataset)")
        data = load_forecast_data(d.dataset, d.data_dir, seq_len=d.seq_len, label_len=d.label_len,
                                  pred_len=d.pred_len, features=d.features, target=d.target, calendar=d.calendar,
                                  kind=d.kind, date_column=d.date_column, strict_time_order=d.strict_time_order,
                                  fill_values=d.fill_values)
        note(f"data {data.description}")
        return TaskData(data.train, data.val, data.test if d.use_test else None, default_collate,
                        info={"forecast": data})

    def model_inputs(self, config: Any, data: TaskData) -> dict[str, Any]:
        series: ForecastData = data.info["forecast"]
        return {"channels": series.channels, "seq_len": series.train.seq_len, "pred_len": config.data.pred_len,
                "calendar_dim": series.calendar_dim}

    def step_fn(self, config: Any, data: TaskData) -> StepFn:
        return forecast_step(data.info["forecast"])

    def metrics(self, config: Any, data: TaskData) -> dict[str, MetricFn]:
        return forecast_metrics(data.info["forecast"])

    def validation_line(self, record: dict[str, Any]) -> str | None:
        return (f"epoch {record['epoch']}: train_mse {record['train_loss']:.4f} val_mse {record['mse']:.4f}"
                f"{' *' if record['best'] else ''}")

    def describe(self, config: Any, data: TaskData, results: dict[str, Any]) -> dict[str, Any]:
        series: ForecastData = data.info["forecast"]
        steps_per_epoch = max(1, results["steps"] // max(1, len(results["history"]))) if results["history"] else 1
        best_step = results["best_step"]
        return {
            "dataset": series.name,
            "pred_len": config.data.pred_len,
            "seq_len": series.train.seq_len,
            "params": results["parameters"],
            "val": split_metrics(results["val"]) if results.get("val") else None,
            "test": split_metrics(results["test"]) if results.get("test") else None,
            "paper": dict(zip(("mse", "mae"), paper_for_model(
                f"{config.model_name or self.default_model}:{config.attention or ''}", series.name,
                config.data.pred_len, series.train.seq_len) or (None, None))),
            # Validation runs only at epoch ends, so the best step is the last step of the best epoch.
            "best_epoch": -1 if best_step is None else best_step // steps_per_epoch - 1,
            "epochs_run": len(results["history"]),
            "time_seconds": results["train_time_s"],
        }

    def summary(self, results: dict[str, Any]) -> dict[str, Any]:
        return {k: results.get(k) for k in ("dataset", "model", "attention", "pred_len", "params", "val", "test")}

    def after_run(self, config: Any, data: TaskData, model: Any, out_dir: Path) -> None:
        from longattn.forecast.plots import plot_forecasts

        plot_forecasts(model, data.info["forecast"], out_dir / "forecast.png", device=str(next(model.parameters()).device))
