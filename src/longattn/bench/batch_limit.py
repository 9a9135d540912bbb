"""Skeinformer Table 2: the largest batch that fits a memory budget, and training time per thousand steps.

Table 2 trains every model "with their maximum batch size conditioned on memory" and reaches the
task's batch (A.1: 128 for Text, 256 ListOps, 64 Retrieval, 512 Pathfinder, 256 Image) by gradient
accumulation, reporting the actual batch and the minutes per thousand optimiser steps. Here:

* the largest batch is found by search: the batch is doubled from 1 while the peak memory of one
  training step (forward, backward, AdamW; the LRA Text classifier of ``bench model``) stays within
  the budget, then bisected between the last batch that fits and the first that does not. Each
  probe is one fresh process of :mod:`longattn.bench.speed` (peak RSS on CPU, peak allocation on GPU);
  the search stops at the paper's batch (no accumulation needed beyond it);
* with k = ceil(paper batch / largest batch) accumulation steps of ceil(paper batch / k) sequences,
  one optimiser step is timed (median of repeats, process CPU time on one thread), times 1000 / 60.

Mechanisms take Skeinformer A.1's feature counts (256 samples, landmarks, projected length, random
features; Informer's factor 256 / ln n), the options of :data:`longattn.bench.flops.FLOP_MODELS`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

from longattn.bench.flops import FLOP_MODELS, PAPER_FEATURES
from longattn.bench.speed import MODEL_DEFAULTS, SpeedConfig, run_in_subprocess

__all__ = ["PAPER_BATCH", "PAPER_TABLE_2_TEXT", "batch_table", "largest_batch", "plot_batch", "run_batch_limit"]

# Skeinformer A.1: the batch of each task (selected for Skeinformer's memory on a 16 GB V100)
PAPER_BATCH = {"text": 128, "listops": 256, "retrieval": 64, "pathfinder": 512, "image": 256}
# Skeinformer Table 2, Text column: (minutes per thousand steps, actual batch)
PAPER_TABLE_2_TEXT = {"softmax": (50.63, 16), "vmean": (3.62, 128), "bigbird": (20.59, 64), "performer": (2.63, 64),
                      "nystrom": (12.18, 64), "reformer": (10.53, 64), "linformer": (7.91, 64),
                      "informer": (33.13, 16), "skein": (9.60, 64)}
TABLE_2_MECHANISMS = tuple(PAPER_TABLE_2_TEXT)


def mechanism_options(name: str, length: int, features: int = PAPER_FEATURES) -> dict[str, Any]:
    """Skeinformer A.1's feature counts for ``name`` at ``length`` (none for mechanisms without features)."""
    model = FLOP_MODELS.get(name)
    return model.options(length, features) if model is not None else {}


def largest_batch(fits: Callable[[int], bool], cap: int) -> tuple[int, list[int]]:
    """The largest batch b <= ``cap`` with ``fits(b)`` (0 if not even 1 fits), assuming memory grows
    with the batch: doubling from 1, then bisection. Returns it and the batches probed, in order."""
    probed: list[int] = []

    def probe(batch: int) -> bool:
        probed.append(batch)
        return fits(batch)

    if not probe(1):
        return 0, probed
    good, bad = 1, None
    while bad is None and good < cap:
        trial = min(2 * good, cap)
        if probe(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if probe(middle):
            good = middle
        else:
            bad = middle
    return good, probed


def run_batch_limit(mechanisms: list[str], length: int, budget_bytes: int, paper_batch: int,
                    base: SpeedConfig = MODEL_DEFAULTS, features: int = PAPER_FEATURES, timeout_s: float = 900.0,
                    progress: bool = True) -> list[dict[str, Any]]:
    """One row per mechanism: the largest batch within ``budget_bytes``, the accumulation that reaches
    ``paper_batch``, and the time of one optimiser step at it (minutes per thousand steps)."""
    from tqdm import tqdm

    rows = []
    for name in tqdm(mechanisms, desc="batch limit", disable=not progress):
        config = replace(base, target=name, length=length, options=mechanism_options(name, length, features),
                         reference=False, grad_accum=1)
        peaks: dict[int, Any] = {}

        def fits(batch: int) -> bool:
            row = run_in_subprocess(replace(config, batch=batch), timeout_s, None, parts=("memory",))
            peaks[batch] = row.get("peak_memory_bytes") if row["status"] == "ok" else row["status"]
            return row["status"] == "ok" and row["peak_memory_bytes"] <= budget_bytes

        batch, probed = largest_batch(fits, paper_batch)
        row: dict[str, Any] = {"mechanism": name, "length": length, "budget_bytes": budget_bytes,
                               "paper_batch": paper_batch, "largest_batch": batch, "probed": probed,
                               "peak_memory_bytes": {str(b): p for b, p in peaks.items()}, "options": config.options}
        if batch == 0:
            rows.append({**row, "status": "does not fit at batch 1"})
            continue
        accumulation = math.ceil(paper_batch / batch)
        micro = math.ceil(paper_batch / accumulation)
        timed = run_in_subprocess(replace(config, batch=micro, grad_accum=accumulation), timeout_s, None,
                                  parts=("time",))
        row.update(accumulation=accumulation, micro_batch=micro, status=timed["status"])
        if timed["status"] == "ok":
            row.update(step_s=timed["forward_backward_s"], step_wall_s=timed["forward_backward_wall_s"],
                       minutes_per_thousand_steps=timed["forward_backward_s"] * 1000 / 60)
        rows.append(row)
    return rows


def batch_table(rows: list[dict[str, Any]], config: SpeedConfig) -> str:
    """Table 2's layout (time per thousand steps, actual batch) with the accumulation and the peak memory."""
    clock = "process CPU time, 1 thread" if config.cpu_time_is_cost else f"wall time, {config.threads} threads"
    budget = rows[0]["budget_bytes"] / 2**20 if rows else 0
    lines = [f"LRA Text model, N = {rows[0]['length'] if rows else '-'}, memory budget {budget:.0f} MiB per training "
             f"step, paper batch {rows[0]['paper_batch'] if rows else '-'}; times: median, {clock}.", "",
             "| mechanism | largest batch | accumulation x micro-batch | peak MiB at largest | min / 1000 steps | "
             "Table 2 Text: min / 1000 steps, batch (V100 16 GB, N = 4k) |", "|---|---|---|---|---|---|"]
    for r in rows:
        paper = PAPER_TABLE_2_TEXT.get(r["mechanism"])
        paper_cell = f"{paper[0]:.2f}, {paper[1]}" if paper else "-"
        if r.get("status") != "ok":
            lines.append(f"| {r['mechanism']} | {r['largest_batch']} | {r.get('status')} | | | {paper_cell} |")
            continue
        peak = r["peak_memory_bytes"].get(str(r["largest_batch"]))
        peak_cell = f"{peak / 2**20:.0f}" if isinstance(peak, (int, float)) else "-"
        lines.append(f"| {r['mechanism']} | {r['largest_batch']} | {r['accumulation']} x {r['micro_batch']} | "
                     f"{peak_cell} | {r['minutes_per_thousand_steps']:.2f} | {paper_cell} |")
    return "\n".join(lines)


def plot_batch(rows: list[dict[str, Any]], path: str) -> None:
    """Two bar panels: minutes per thousand steps and the largest batch, per mechanism."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names = [r["mechanism"] for r in ok]
    axes[0].bar(names, [r["minutes_per_thousand_steps"] for r in ok])
    axes[0].set_ylabel("minutes per thousand optimiser steps")
    axes[1].bar(names, [r["largest_batch"] for r in ok])
    axes[1].set_ylabel("largest batch within the budget")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle("Skeinformer Table 2 layout (LRA Text model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
