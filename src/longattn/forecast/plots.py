"""Plots of forecasting runs."""

from __future__ import annotations

from pathlib import Path

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
