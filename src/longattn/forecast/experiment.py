"""One forecasting run (a table cell) from a config, and the whole Table-2 grid.

A config is a mapping ``{"data": {...}, "train": {...}, "horizons": [...], "models": {name: {...}}}`` (see
``configs/forecast/*.yaml``). A run resolves it to ``{"data", "train", "model"}`` for one model; ``--set``
overrides address that resolved form (``train.epochs=3``, ``model.d_model=64``, ``data.seq_len=36``);
``models.<name>.<key>`` changes one model only (for tables of several models).
Attention-specific options live under ``attention_options.<attention name>`` in the config so that swapping
the attention never passes one mechanism's options to another; a run keeps only the chosen attention's, and
``--set model.attention_options.<option>=...`` addresses those.
"""

from __future__ import annotations

import copy
import inspect
import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from longattn import attention as attention_registry
from longattn.data.timeseries import ForecastData, load_forecast_data, resolve_series
from longattn.forecast.paper import paper_result
from longattn.forecast.train import forecast_settings, train_forecaster
from longattn.models.forecasters import build_forecaster
from longattn.train.config import packaged_configs
from longattn.utils import seed_everything

# Used when no config file exists for a dataset (e.g. a user's own CSV): the FEDformer code's defaults.
DEFAULT_CONFIG: dict[str, Any] = {
    "data": {"seq_len": 96, "label_len": 48, "features": "M", "target": "OT", "calendar": False},
    "train": {"epochs": 10, "batch_size": 32, "lr": 1e-4, "patience": 3, "lr_schedule": "halve"},
    "horizons": [96, 192, 336, 720],
    "models": {
        "skt": {"d_model": 512, "heads": 8, "layers": 1, "attention": "skeleton", "dropout": 0.05},
        "encoder": {"d_model": 512, "heads": 8, "layers": 2, "d_ff": 2048, "attention": "softmax", "dropout": 0.05},
        "dlinear": {"kernel_size": 25, "individual": False, "train": {"lr": 1e-3}},
    },
}


def find_config(dataset: str) -> Path | None:
    """``configs/forecast/<dataset>.yaml`` in the current folder, else the one shipped with longattn, if any."""
    try:
        stem = resolve_series(dataset)[0]
    except ValueError:
        stem = Path(dataset).stem
    for configs in (Path.cwd() / "configs", packaged_configs()):
        candidate = configs / "forecast" / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    return None


def load_config(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return copy.deepcopy(DEFAULT_CONFIG)
    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict) or "models" not in config:
        raise ValueError(f"{path}: a forecast config needs 'data', 'train' and 'models' sections")
    return config


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """``["train.epochs=3", "model.d_model=64"]`` -> {"train.epochs": 3, ...}, values parsed as YAML."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = _parse_value(value)
    return out


def _parse_value(text: str) -> Any:
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string; users mean the number
            return float(value)
        except ValueError:
            return value
    return value


def resolve_run_config(config: dict[str, Any], model: str, attention: str | None,
                       overrides: dict[str, Any]) -> dict[str, Any]:
    """The {data, train, model} settings of one run: model section merged, attention picked, overrides applied."""
    if model not in config["models"]:
        raise ValueError(f"model {model!r} has no section in the config; sections: {', '.join(config['models'])}")
    model_cfg = copy.deepcopy(config["models"][model])
    train_cfg = {**config.get("train", {}), **model_cfg.pop("train", {})}  # per-model training overrides
    resolved = {"data": dict(config.get("data", {})), "train": train_cfg, "model": model_cfg}
    if attention is not None:
        if "attention" not in model_cfg:
            raise ValueError(f"model {model!r} takes no attention")
        model_cfg["attention"] = attention
    if "attention" in model_cfg:
        # Keep only the chosen attention's options; overrides below then address them directly
        # (model.attention_options.smoother=false).
        per_attention = model_cfg.get("attention_options") or {}
        model_cfg["attention_options"] = dict(per_attention.get(model_cfg["attention"], {}))
    for key, value in overrides.items():
        section, _, rest = key.partition(".")
        if section == "models":  # models.<name>.<key>: only when running that model (useful for tables)
            name, _, rest = rest.partition(".")
            if name != model:
                continue
            section = "model"
        if section not in resolved or not rest:
            raise ValueError(f"--set key {key!r} must start with data., train., model. or models.<name>.")
        if section == "model" and rest == "attention":
            raise ValueError("choose the attention with --attention (or model:attention in a table), not --set")
        node = resolved[section]
        *parents, leaf = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return resolved


def run_forecast(
    dataset: str,
    data_dir: str | Path | None,
    model: str,
    pred_len: int,
    out_dir: str | Path,
    attention: str | None = None,
    overrides: dict[str, Any] | None = None,
    config_path: str | Path | None = None,
    seed: int = 0,
    device: str = "cpu",
    plot: bool = True,
    log: Any = print,
) -> dict[str, Any]:
    """Train and test one model on one dataset and horizon; writes results.json (and forecast.png) in out_dir."""
    config_path = config_path or find_config(dataset)
    run = resolve_run_config(load_config(config_path), model, attention, overrides or {})
    data_opts = dict(run["data"])
    valid = set(inspect.signature(load_forecast_data).parameters) - {"dataset", "data_dir", "pred_len"}
    unknown = sorted(set(data_opts) - valid)
    if unknown:
        raise ValueError(f"unknown data option(s) {unknown}; valid: {', '.join(sorted(valid))}")
    data = load_forecast_data(dataset, data_dir, pred_len=pred_len, **data_opts)
    settings = forecast_settings(run["train"], seed=seed, device=device)
    seed_everything(seed)
    net = build_forecaster(model, data.channels, data.train.seq_len, pred_len,
                           calendar_dim=data.calendar_dim, **run["model"])
    out_dir = Path(out_dir)
    log(f"{dataset} {model}{'/' + run['model']['attention'] if 'attention' in run['model'] else ''} "
        f"pred_len {pred_len}: {sum(p.numel() for p in net.parameters())} parameters, "
        f"{len(data.train)}/{len(data.val)}/{len(data.test)} windows")
    start = time.perf_counter()
    fingerprint = json.dumps({"dataset": str(dataset), "pred_len": pred_len, "seed": seed, **run}, sort_keys=True)
    summary = train_forecaster(net, data, settings, out_dir, log=log, fingerprint=fingerprint)
    results = {
        "dataset": data.name,
        "model": model,
        "attention": run["model"].get("attention"),
        "options": run["model"],
        "seed": seed,
        "params": summary["params"],
        "pred_len": pred_len,
        "seq_len": data.train.seq_len,
        "val": summary["val"],
        "test": summary["test"],
        "paper": dict(zip(("mse", "mae"), paper_result(data.name, pred_len) or (None, None))),
        "best_epoch": summary["best_epoch"],
        "epochs_run": summary["epochs_run"],
        "history": summary["history"],
        "time_seconds": time.perf_counter() - start,
        "train_seconds": summary["train_seconds"],
        "peak_memory_mb": summary["peak_memory_mb"],
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "config": {**run, "config_file": str(config_path) if config_path else None, "pred_len": pred_len},
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    if plot:
        plot_forecasts(net, data, out_dir / "forecast.png", device=device)
    log(f"test mse {results['test']['mse']:.4f} mae {results['test']['mae']:.4f}")
    return results


@torch.no_grad()
def plot_forecasts(model: torch.nn.Module, data: ForecastData, path: str | Path, windows: int = 4,
                   device: str = "cpu") -> Path:
    """Input, ground truth and forecast of the target channel for a few evenly spaced test windows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model.eval()
    count = min(windows, len(data.test))
    picks = torch.linspace(0, len(data.test) - 1, count).long().tolist()
    fig, axes = plt.subplots(count, 1, figsize=(9, 2.2 * count), squeeze=False)
    channel = data.target_columns[-1]
    for ax, index in zip(axes[:, 0], picks):
        x, y, x_mark, _ = data.test[index]
        marks = x_mark[None].to(device) if x_mark.shape[-1] else None
        pred = model(x[None].to(device), marks)[0, :, channel].cpu()
        seq_len = x.shape[0]
        truth = y[-data.test.pred_len :, channel]
        ax.plot(range(seq_len), x[:, channel], color="0.5", label="input")
        ax.plot(range(seq_len, seq_len + len(truth)), truth, color="k", label="ground truth")
        ax.plot(range(seq_len, seq_len + len(pred)), pred, color="tab:red", label="forecast")
        ax.set_title(f"{data.name} test window {index}, channel {data.columns[channel]} (scaled)", fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- the table


def cell_dir(out: str | Path, dataset: str, model_spec: str, horizon: int, seed: int) -> Path:
    return Path(out) / dataset / model_spec.replace(":", "-") / f"h{horizon}_s{seed}"


def split_model_spec(spec: str) -> tuple[str, str | None]:
    """'encoder:skein' -> ('encoder', 'skein'); 'dlinear' -> ('dlinear', None)."""
    model, _, attention = spec.partition(":")
    return model, attention or None


def run_table(
    data_dir: str | Path,
    datasets: list[str],
    models: list[str],
    out: str | Path,
    horizons: list[int] | None = None,
    overrides: dict[str, Any] | None = None,
    seeds: list[int] | None = None,
    device: str = "cpu",
    log: Any = print,
    collect_only: bool = False,
) -> list[dict[str, Any]]:
    """Run every (dataset, horizon, model, seed) cell not already done (results.json present) and collect rows.

    ``collect_only`` trains nothing: cells without results are left out of the rows.

    A cell that fails (e.g. an attention not registered in this install) is recorded with its error and the
    grid goes on.
    """
    rows = []
    for dataset in datasets:
        is_path = dataset.lower().endswith(".csv")
        name = Path(dataset).stem if is_path else resolve_series(dataset)[0]
        config_path = find_config(dataset)
        dataset_horizons = horizons or load_config(config_path).get("horizons", DEFAULT_CONFIG["horizons"])
        for horizon in dataset_horizons:
            for spec in models:
                model, attention = split_model_spec(spec)
                for seed in seeds or [0]:
                    target = cell_dir(out, name, spec, horizon, seed)
                    done = target / "results.json"
                    row = {"dataset": name, "horizon": horizon, "model": spec, "seed": seed}
                    if done.is_file():
                        result = json.loads(done.read_text())
                    elif collect_only:
                        continue
                    else:
                        if attention is not None and attention not in attention_registry.available():
                            rows.append({**row, "error": f"attention {attention!r} is not registered"})
                            continue
                        try:
                            result = run_forecast(dataset if is_path else name, data_dir, model, horizon, target,
                                                  attention, overrides,
                                                  config_path, seed, device, log=log)
                        except (ValueError, RuntimeError) as err:
                            log(f"{name} {spec} {horizon}: failed: {err}")
                            rows.append({**row, "error": str(err)})
                            continue
                    rows.append({**row, "mse": result["test"]["mse"], "mae": result["test"]["mae"],
                                 "mae_denorm": result["test"]["mae_denorm"], "seconds": result["time_seconds"]})
    return rows


def format_table(rows: list[dict[str, Any]], models: list[str]) -> str:
    """Markdown table in the layout of the papers' Table 2 (dataset, horizon, MSE/MAE per model), paper columns
    first, then the reproduced models averaged over seeds, with the SKT deviation from the paper in percent."""
    from longattn.forecast.paper import PAPER_MODELS

    cells: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    errors: dict[tuple[str, int, str], str] = {}
    order: list[tuple[str, int]] = []
    for row in rows:
        key = (row["dataset"], row["horizon"])
        if key not in order:
            order.append(key)
        if "error" in row:
            errors[(*key, row["model"])] = row["error"]
        else:
            cells.setdefault((*key, row["model"]), []).append((row["mse"], row["mae"]))
    paper_cols = [m for m in PAPER_MODELS if any(paper_result(d, h, m) for d, h in order)]
    header = ["Dataset", "H"]
    for name in [f"{m} (paper)" for m in paper_cols] + list(models):
        header += [f"{name} MSE", "MAE"]
    header.append("skt vs paper MSE")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for dataset, horizon in order:
        line = [dataset, str(horizon)]
        for m in paper_cols:
            ref = paper_result(dataset, horizon, m)
            line.append(f"{ref[0]:.3f} | {ref[1]:.3f}" if ref else "- | -")
        for m in models:
            got = cells.get((dataset, horizon, m))
            if got:
                mse, mae = (sum(v) / len(v) for v in zip(*got))
                line.append(f"{mse:.3f} | {mae:.3f}")
            else:
                line.append("failed | -" if (dataset, horizon, m) in errors else "- | -")
        skt = next((cells[(dataset, horizon, m)] for m in models if m.split(":")[0] == "skt"
                    and (dataset, horizon, m) in cells), None)
        ref = paper_result(dataset, horizon)
        if skt and ref:
            mse = sum(v[0] for v in skt) / len(skt)
            line.append(f"{100 * (mse - ref[0]) / ref[0]:+.1f}%")
        else:
            line.append("-")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)
