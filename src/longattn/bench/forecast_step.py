"""CPU time of one training step of the forecasters, built exactly as ``longattn forecast-table`` builds them.

A step is what the Trainer does per batch: forward, the forecasting loss, backward and an Adam update, on one
fixed training batch; with ``evaluation`` it is what evaluation does per batch instead: the model in eval mode,
forward and loss under ``no_grad``, on the first validation batch of ``train.eval_batch_size``. Times are
process CPU time (``time.process_time``; with one thread it is the time the step took whatever else the machine
runs) beside wall time, medians over ``steps`` after ``warmup``, and the worker process's peak resident memory
(data, model and the largest step together).

Each (model, source tree) runs in a fresh subprocess, and with several source trees (``--src``, e.g. a
checkout of an earlier commit) their processes alternate round by round, so that a before/after ratio is
taken side by side under the same load. The worker is this file run as a script against the ``longattn``
of the source tree it measures; it uses only the config, task and model-building APIs that every revision
since the forecasting grid has.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_STEPS = 20
DEFAULT_WARMUP = 3
DEFAULT_ROUNDS = 2


def measure(data_dir: str, dataset: str, model: str, horizon: int, overrides: list[str], steps: int, warmup: int,
            seed: int, evaluation: bool = False) -> dict[str, Any]:
    """Per-step (training, or with ``evaluation`` per evaluation batch) CPU and wall milliseconds of ``model`` (a
    forecast-table model spec) in this process."""
    import torch

    import longattn
    from longattn.experiment.config import resolve_config
    from longattn.experiment.run import build_run_model
    from longattn.forecast.table import forecast_cells
    from longattn.tasks.base import get_task

    cell = forecast_cells(data_dir, [dataset], [model], [horizon], overrides)[0]
    config = resolve_config(cell.task, cell.preset, overrides=cell.overrides, **cell.explicit)
    task = get_task(cell.task)
    data = task.build_data(config)
    torch.manual_seed(seed)
    network = build_run_model(config, task, data)
    network.train(not evaluation)
    step = task.step_fn(config, data)
    optimizer = torch.optim.Adam(network.parameters(), lr=config.optim.lr)
    if evaluation:
        loader = torch.utils.data.DataLoader(data.val, batch_size=config.train.eval_batch_size or
                                             config.train.batch_size, collate_fn=data.collate)
    else:
        loader = torch.utils.data.DataLoader(data.train, batch_size=config.train.batch_size, shuffle=True,
                                             collate_fn=data.collate, generator=torch.Generator().manual_seed(seed))
    batch = next(iter(loader))
    cpu_ms, wall_ms = [], []
    for index in range(warmup + steps):
        cpu, wall = time.process_time(), time.perf_counter()
        if evaluation:
            with torch.no_grad():
                step(network, batch)
        else:
            optimizer.zero_grad(set_to_none=True)
            step(network, batch).loss.backward()
            optimizer.step()
        if index >= warmup:
            cpu_ms.append(1000 * (time.process_time() - cpu))
            wall_ms.append(1000 * (time.perf_counter() - wall))
    return {"model": model, "dataset": dataset, "horizon": horizon, "step": "eval" if evaluation else "train",
            "batch": len(batch[0]),
            "cpu_ms": cpu_ms, "wall_ms": wall_ms, "threads": torch.get_num_threads(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "longattn": str(Path(longattn.__file__).resolve().parents[1])}


def run_forecast_steps(data_dir: str, dataset: str, models: list[str], horizon: int, overrides: list[str],
                       sources: list[str], steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP,
                       rounds: int = DEFAULT_ROUNDS, seed: int = 0, evaluation: bool = False) -> list[dict[str, Any]]:
    """One row per (model, source tree): the per-step times of every round pooled, and their medians."""
    rows = []
    for model in models:
        pooled: dict[str, dict[str, Any]] = {}
        for _ in range(rounds):
            for source in sources:
                request = {"data_dir": data_dir, "dataset": dataset, "model": model, "horizon": horizon,
                           "overrides": overrides, "steps": steps, "warmup": warmup, "seed": seed,
                           "evaluation": evaluation}
                env = {**os.environ, "PYTHONPATH": str(Path(source).resolve())}
                # -P: the worker's own folder is not put on sys.path, so only the measured tree's longattn is found
                done = subprocess.run([sys.executable, "-P", str(Path(__file__).resolve()), json.dumps(request)],
                                      env=env, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{model} with {source} failed:\n{done.stderr[-2000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                row = pooled.setdefault(source, {**result, "source": source, "cpu_ms": [], "wall_ms": []})
                row["cpu_ms"] += result["cpu_ms"]
                row["wall_ms"] += result["wall_ms"]
                row["peak_rss_bytes"] = max(row["peak_rss_bytes"], result["peak_rss_bytes"])
        for row in pooled.values():
            row["median_cpu_ms"] = statistics.median(row["cpu_ms"])
            row["median_wall_ms"] = statistics.median(row["wall_ms"])
            rows.append(row)
    return rows


def forecast_step_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: median CPU / wall ms per step and peak RSS for each model and source, and each source's CPU time
    relative to the first source's for the same model."""
    lines = ["| model | horizon | step | batch | source | CPU ms / step | wall ms / step | steps | peak RSS MiB | "
             "CPU vs first source |", "|---|---|---|---|---|---|---|---|---|---|"]
    first: dict[str, float] = {}
    for row in rows:
        base = first.setdefault(row["model"], row["median_cpu_ms"])
        lines.append(f"| {row['model']} | {row['horizon']} | {row['step']} | {row['batch']} | {row['source']} | "
                     f"{row['median_cpu_ms']:.0f} | {row['median_wall_ms']:.0f} | {len(row['cpu_ms'])} | "
                     f"{row['peak_rss_bytes'] / 2**20:.0f} | "
                     f"{row['median_cpu_ms'] / base:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the worker: one measurement, its JSON on the last line of stdout
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
