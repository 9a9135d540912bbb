"""Plots of forecasting runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longattn.data.timeseries import ForecastData


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


def plot_mse_by_horizon(summary: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One figure per dataset: test MSE against horizon for every model (mean over seeds, error bars = std),
    with the published numbers of the same model as hollow markers on a dashed line of the same colour (a
    misprinted one, :func:`longattn.forecast.paper.is_misprint`, left out).
    ``summary`` is :func:`longattn.forecast.table.summarise`'s output; returns the written ``<dataset>_mse.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for dataset in dict.fromkeys(e["dataset"] for e in summary):
        entries = [e for e in summary if e["dataset"] == dataset and e["mse_mean"] is not None]
        if not entries:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        models = list(dict.fromkeys(e["model"] for e in entries))
        # Table 16 has 12 models: past 10, matplotlib's default cycle repeats its colours, so take tab20's.
        palette = [f"C{i}" for i in range(10)] if len(models) <= 10 else list(plt.get_cmap("tab20").colors)
        for index, model in enumerate(models):
            points = sorted((e for e in entries if e["model"] == model), key=lambda e: e["horizon"])
            colour = palette[index % len(palette)]
            marker = "os^vD<>ph*"[index % 10]
            ax.errorbar([e["horizon"] for e in points], [e["mse_mean"] for e in points],
                        yerr=[e["mse_std"] or 0.0 for e in points], color=colour, marker=marker, capsize=3,
                        label=model)
            published = [e for e in points if e["paper_mse"] is not None and not e["paper_misprint"]]
            if published:
                ax.plot([e["horizon"] for e in published], [e["paper_mse"] for e in published], color=colour,
                        linestyle="--", marker=marker, markerfacecolor="none", alpha=0.7)
        ax.set_xlabel("horizon (steps)")
        ax.set_ylabel("test MSE (scaled)")
        ax.set_yscale("log")
        ax.set_xticks(sorted({e["horizon"] for e in entries}))
        ax.set_title(f"{dataset}: ours (solid, mean ± std over seeds) and published (dashed, hollow)", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = Path(out_dir) / f"{dataset}_mse.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
