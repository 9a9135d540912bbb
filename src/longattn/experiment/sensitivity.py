"""Skeinformer Figure 3: test accuracy and training time against learning rate and batch size.

Appendix A.5 trains Skeinformer on Text with batch 64 and 128 and learning rates 1e-3, 1e-4, 1e-5,
"averaged across random trials". Each (learning rate, batch) pair is a cell of the grid runner
(:func:`longattn.experiment.grid.run_cells`), one ordinary run per seed, so every run can be
inspected or resumed; a cell's figures are the mean and standard deviation over seeds of the test
accuracy and of the training time (the Trainer's ``train_time_s``: the optimisation steps, no
validation).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from longattn.experiment.grid import Cell, markdown_table, run_cells
from longattn.experiment.stats import mean_std

__all__ = ["PAPER_BATCHES", "PAPER_LEARNING_RATES", "plot_sensitivity", "run_sensitivity", "sensitivity_table"]

PAPER_LEARNING_RATES = (1e-3, 1e-4, 1e-5)
PAPER_BATCHES = (64, 128)


def run_sensitivity(task: str, attention: str, learning_rates: list[float], batches: list[int], seeds: list[int],
                    out_dir: str | Path, *, preset: str | None = None, overrides: list[str] | None = None,
                    resume: bool = False, overwrite: bool = False) -> list[dict[str, Any]]:
    """Train every (learning rate, batch) for every seed; one row per cell with its per-seed figures."""
    cells = [Cell(row=f"lr={lr:g}", column=f"batch={batch}", task=task, preset=preset,
                  overrides=[*(overrides or []), f"optim.lr={lr}", f"train.batch_size={batch}"],
                  explicit={"attention": attention})
             for lr in learning_rates for batch in batches]
    run_cells(cells, seeds, out_dir, resume=resume, overwrite=overwrite, plots=False)
    rows = []
    for cell, (lr, batch) in zip(cells, [(lr, b) for lr in learning_rates for b in batches]):
        rows.append({"learning_rate": lr, "batch": batch, "error": cell.error, "test_accuracy": cell.values(),
                     "train_time_s": [r["train_time_s"] for r in cell.results],
                     "steps": [r["steps"] for r in cell.results]})
    return rows


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def sensitivity_table(rows: list[dict[str, Any]]) -> str:
    """Learning rates as rows, batches as columns: test accuracy and training time (mean ± std over seeds)."""
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    by = {(r["learning_rate"], r["batch"]): r for r in rows}
    body = []
    for lr in dict.fromkeys(r["learning_rate"] for r in rows):
        line = [f"{lr:g}"]
        for batch in batches:
            r = by[lr, batch]
            line += ["failed" if r["error"] else mean_std(r["test_accuracy"]), "-" if r["error"] else mean_std(r["train_time_s"])]
        body.append(line)
    headers = ["learning rate"] + [h for b in batches for h in (f"test accuracy, batch {b}", f"train s, batch {b}")]
    return "mean ± std over seeds\n\n" + markdown_table(headers, body)


def plot_sensitivity(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Figure 3's two panels: test accuracy and training time against the learning rate, one line per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for batch in dict.fromkeys(r["batch"] for r in rows):
        mine = sorted((r for r in rows if r["batch"] == batch and not r["error"]), key=lambda r: r["learning_rate"])
        for ax, key in ((axes[0], "test_accuracy"), (axes[1], "train_time_s")):
            pts = [(r["learning_rate"], _mean(r[key]), statistics.stdev(r[key]) if len(r[key]) > 1 else 0.0)
                   for r in mine if r[key]]
            if pts:
                xs, ys, errs = zip(*pts)
                ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=f"batch {batch}")
    for ax, label in ((axes[0], "test accuracy"), (axes[1], "training time (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing to label when every cell failed
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
