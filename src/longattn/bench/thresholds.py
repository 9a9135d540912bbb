"""Sequence-length thresholds of Singularformer's Table 3: from which N a linear model beats the Post-LN
Transformer in inference speed and in memory.

One fresh process per length N (:func:`measure_point`) builds the Post-LN classifier and each linear
model's (kind ``classifier`` of :mod:`longattn.bench.speed`: the same Figure 5 classifier around each
attention), takes the peak memory of one inference forward of each in turn (:func:`~longattn.bench.speed.peak_memory`,
glibc's mmap threshold fixed as in the speed benchmark's memory process), then times their forwards
interleaved round by round (:func:`~longattn.bench.speed.time_interleaved`: median process CPU time on
one thread, wall time beside). Both criteria are therefore ratios measured side by side in one process.

The Post-LN baseline is by default ``softmax_math``, softmax attention through SDPA's math path, which
holds the n x n scores as the paper's standard Transformer does (Table 1: m n^2 of memory); ``softmax``
is SDPA's fused kernel, whose memory grows linearly with N on CPU.

Every model is measured at every length of the grid (a curve may cross more than once: BigBird, for
one, is full attention up to 8 blocks). For each model and criterion the search then bisects between
the last grid length where the model loses and the next one, down to ``resolution`` tokens; the
threshold is the smallest measured N from which the model wins at every longer measured N, reported
with the largest N below it where it loses. Near a crossing the ratio is close to 1, so the bracket
says where the curves meet, within the timing noise, rather than a sharp edge.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace
from typing import Any, Callable

import torch

from longattn.bench.speed import (MEMORY_PROCESS_MMAP_THRESHOLD, SpeedConfig, benchmark_calls, child_env, peak_memory,
                                  time_interleaved)
from longattn.bench.targets import SDPA, SDPA_MATH

CRITERIA = ("speed", "memory")
DEFAULT_GRID = (64, 128, 256, 512, 1024, 2048)
DEFAULT_RESOLUTION = 32
DEFAULT_BASELINE = SDPA_MATH
BASELINES = (SDPA_MATH, SDPA)
# the paper's Table 3 (GPU): memory threshold, inference-speed threshold
PAPER_TABLE3 = {"bigbird": (704, 848), "linformer": (448, 368), "flash": (432, 400), "singular": (192, 144)}

Rows = dict[str, dict[str, Any]]
MeasurePoint = Callable[[SpeedConfig, list[str], str, int], Rows]


def measure_point(base: SpeedConfig, targets: list[str], baseline: str, length: int) -> Rows:
    """In this process, at N = ``length``: per model (the baseline first) its parameters, the peak memory of
    one inference forward, and its forward times, the models' calls interleaved round by round."""
    torch.manual_seed(base.seed)
    torch.set_num_threads(base.threads)
    config = replace(base, length=length, inference_only=True)
    forwards, rows = {}, {}
    for name in [baseline, *targets]:
        module, forward, _ = benchmark_calls(replace(config, target=name), name)
        for _ in range(config.warmup):
            forward()
        forwards[name] = forward
        rows[name] = {"status": "ok", "parameters": sum(p.numel() for p in module.parameters()),
                      "peak_memory_bytes": peak_memory(forward, torch.device(config.device))}
    for name, times in time_interleaved(forwards, config).items():
        rows[name].update(forward_wall_s=times["wall_s"], forward_cpu_s=times["cpu_s"],
                          forward_s=times["cpu_s"] if config.cpu_time_is_cost else times["wall_s"])
    return rows


def _point_in_subprocess(timeout_s: float) -> MeasurePoint:
    def run(base: SpeedConfig, targets: list[str], baseline: str, length: int) -> Rows:
        env = dict(child_env(base), MALLOC_MMAP_THRESHOLD_=str(MEMORY_PROCESS_MMAP_THRESHOLD))
        request = json.dumps({"config": asdict(base), "targets": targets, "baseline": baseline, "length": length})
        try:
            proc = subprocess.run([sys.executable, "-m", "longattn.bench.thresholds", request], capture_output=True,
                                  text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {name: {"status": "timeout"} for name in [baseline, *targets]}
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            error = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            return {name: {"status": "error", "error": error} for name in [baseline, *targets]}
        return json.loads(lines[-1])

    return run


class ThresholdSearch:
    """Every (model, N) measured once, with the baseline measured beside it in the same process."""

    def __init__(self, base: SpeedConfig, baseline: str, measure: MeasurePoint,
                 progress: Callable[[str], None] | None = None) -> None:
        # the baseline is built in measure_point beside the models, not by the speed benchmark's reference
        self.base = replace(base, inference_only=True, reference=False, reference_target=baseline)
        self.baseline = baseline
        self.measure = measure
        self.progress = progress or (lambda text: None)
        self.points: dict[tuple[str, int], tuple[dict[str, Any], dict[str, Any]]] = {}  # (model, N) -> (row, baseline)

    def ensure(self, targets: list[str], length: int) -> None:
        todo = [t for t in targets if (t, length) not in self.points]
        if todo:
            self.progress(f"N={length}: {', '.join(todo)} beside {self.baseline}")
            rows = self.measure(self.base, todo, self.baseline, length)
            for target in todo:
                self.points[target, length] = (rows[target], rows[self.baseline])

    def wins(self, target: str, length: int) -> dict[str, bool | None]:
        """Per criterion: True (beats Post-LN at N), False, or None (a measurement failed)."""
        self.ensure([target], length)
        row, base = self.points[target, length]
        if row.get("status") != "ok" or base.get("status") != "ok":
            return {c: None for c in CRITERIA}
        return {"speed": row["forward_s"] < base["forward_s"],
                "memory": row["peak_memory_bytes"] < base["peak_memory_bytes"]}


def _midpoint(low: int, high: int, resolution: int) -> int:
    return low + max(resolution, (high - low) // 2 // resolution * resolution)


def find_threshold(search: ThresholdSearch, target: str, grid: list[int], resolution: int) -> dict[str, dict[str, Any]]:
    """Per criterion: ``{"threshold": N or None, "below": N or None, "note": ...}``: the target wins at
    ``threshold`` and every longer measured N, and loses at ``below`` (None: never lost, or never won)."""
    walked = [(n, search.wins(target, n)) for n in grid]
    out = {}
    for criterion in CRITERIA:
        outcomes = [(n, won[criterion]) for n, won in walked]
        failed = [n for n, won in outcomes if won is None]
        if failed:
            out[criterion] = {"threshold": None, "below": None, "note": f"measurement failed at N={failed[0]}"}
            continue
        losing = [i for i, (_, won) in enumerate(outcomes) if not won]
        if not losing:
            out[criterion] = {"threshold": grid[0], "below": None, "note": f"wins from the shortest N ({grid[0]})"}
            continue
        last = losing[-1]
        if last == len(outcomes) - 1:
            out[criterion] = {"threshold": None, "below": grid[-1], "note": f"loses at the longest N ({grid[-1]})"}
            continue
        low, high = grid[last], grid[last + 1]
        while high - low > resolution:
            mid = _midpoint(low, high, resolution)
            won = search.wins(target, mid)[criterion]
            if won is None:
                break
            low, high = (low, mid) if won else (mid, high)
        out[criterion] = {"threshold": high, "below": low, "note": ""}
    return out


def sweep_thresholds(targets: list[str], base: SpeedConfig, grid: list[int] | tuple[int, ...] = DEFAULT_GRID,
                     resolution: int = DEFAULT_RESOLUTION, baseline: str = DEFAULT_BASELINE,
                     measure: MeasurePoint | None = None, timeout_s: float = 1800.0,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Thresholds of every target against the Post-LN model, with every measurement behind them."""
    if baseline not in BASELINES:
        raise ValueError(f"the Post-LN baseline is one of {BASELINES}, got {baseline!r}")
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    grid = sorted(set(grid))
    if not grid or grid[0] < 1:
        raise ValueError(f"the grid of lengths must hold positive lengths, got {grid}")
    if not targets or set(BASELINES) & set(targets):
        raise ValueError(f"targets must be linear models other than the Post-LN baselines {BASELINES}, got {targets}")
    search = ThresholdSearch(base, baseline, measure or _point_in_subprocess(timeout_s), progress)
    for length in grid:  # every model at every grid length: one process per length
        search.ensure(list(targets), length)
    thresholds = {t: find_threshold(search, t, grid, resolution) for t in targets}
    points = []
    for (target, length), (row, base_row) in sorted(search.points.items()):
        ok = row.get("status") == "ok" and base_row.get("status") == "ok"
        points.append({"target": target, "length": length, "status": row.get("status") if ok else
                       f"{row.get('status')} / baseline {base_row.get('status')}",
                       "error": row.get("error") or base_row.get("error"),
                       "forward_s": row.get("forward_s"), "postln_forward_s": base_row.get("forward_s"),
                       "forward_wall_s": row.get("forward_wall_s"), "postln_forward_wall_s": base_row.get("forward_wall_s"),
                       "speedup_vs_postln": base_row["forward_s"] / row["forward_s"] if ok else None,
                       "peak_memory_bytes": row.get("peak_memory_bytes"),
                       "postln_peak_memory_bytes": base_row.get("peak_memory_bytes"),
                       "parameters": row.get("parameters")})
    return {"config": asdict(search.base), "baseline": baseline, "grid": grid, "resolution": resolution,
            "thresholds": thresholds, "points": points}


def _cell(entry: dict[str, Any]) -> str:
    if entry["threshold"] is None:
        return f"> {entry['below']}" if entry["below"] is not None else entry["note"]
    if entry["below"] is None:
        return f"<= {entry['threshold']}"
    return f"{entry['threshold']} (loses at {entry['below']})"


def thresholds_table(report: dict[str, Any]) -> str:
    """Table 3's layout: per model, the memory and inference-speed thresholds, the paper's (GPU) beside."""
    lines = ["| model | memory threshold (N) | inference-speed threshold (N) | paper: memory | paper: speed |",
             "|---|---|---|---|---|"]
    for target, entry in report["thresholds"].items():
        paper = PAPER_TABLE3.get(target, ("-", "-"))
        lines.append(f"| {target} | {_cell(entry['memory'])} | {_cell(entry['speed'])} | {paper[0]} | {paper[1]} |")
    return "\n".join(lines)


def points_table(report: dict[str, Any]) -> str:
    lines = ["| model | N | forward ms | Post-LN forward ms | speed-up | peak MiB | Post-LN peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for p in report["points"]:
        if p["speedup_vs_postln"] is None:
            lines.append(f"| {p['target']} | {p['length']} | {p['status']} | | | | |")
            continue
        lines.append(f"| {p['target']} | {p['length']} | {1000 * p['forward_s']:.1f} | {1000 * p['postln_forward_s']:.1f} | "
                     f"{p['speedup_vs_postln']:.2f} | {p['peak_memory_bytes'] / 2**20:.1f} | "
                     f"{p['postln_peak_memory_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def plot_thresholds(report: dict[str, Any], path) -> None:
    """Speed-up over Post-LN and Post-LN's memory over the model's against N, one line per model, 1 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for target in report["thresholds"]:
        pts = [p for p in report["points"] if p["target"] == target and p["speedup_vs_postln"] is not None]
        if not pts:
            continue
        axes[0].plot([p["length"] for p in pts], [p["speedup_vs_postln"] for p in pts], marker="o", label=target)
        memory = [(p["length"], p["postln_peak_memory_bytes"] / p["peak_memory_bytes"]) for p in pts
                  if p["peak_memory_bytes"] and p["postln_peak_memory_bytes"]]
        if memory:
            axes[1].plot(*zip(*memory), marker="o", label=target)
    for ax, label in ((axes[0], "inference speed-up over Post-LN"), (axes[1], "Post-LN peak memory / model's")):
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"above 1: the linear model beats the Post-LN Transformer ({report['baseline']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    _request = json.loads(sys.argv[1])
    _rows = measure_point(SpeedConfig(**_request["config"]), _request["targets"], _request["baseline"], _request["length"])
    print(json.dumps(_rows), flush=True)
