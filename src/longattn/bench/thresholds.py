"""Sequence-length thresholds of Singularformer's Table 3: from which N a linear model beats the Post-LN
Transformer in inference speed and in memory.

Every point is one :func:`longattn.bench.speed.run_in_subprocess` measurement of the whole classifier
(kind ``classifier``, inference only): the target's forward time with the Post-LN model's (the same
classifier around softmax attention) timed in the same process, interleaved, so the speed criterion is
a ratio of two medians taken side by side; the peak memory of one forward in its own process, against
the Post-LN model's peak at the same N (measured once per N in a memory-only process).

The Post-LN baseline is by default ``softmax_math``, softmax attention through SDPA's math path, which
holds the n x n scores as the paper's standard Transformer does (Table 1: m n^2 of memory); ``softmax``
is SDPA's fused kernel, whose memory grows linearly with N on CPU.

The search walks up a grid of lengths until the target wins on both criteria at ``confirm``
consecutive grid points (or the grid ends), then bisects each criterion between the last grid point
where the target loses and the next one, down to ``resolution`` tokens. The threshold reported is the
smallest measured N at which the target wins with the largest measured N below it where it loses
(the bracket). On a noisy ratio near 1 the bracket is where the two curves cross, not a sharp edge.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Callable

from longattn.bench.speed import SpeedConfig, run_in_subprocess
from longattn.bench.targets import SDPA, SDPA_MATH

CRITERIA = ("speed", "memory")
DEFAULT_GRID = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_RESOLUTION = 16
DEFAULT_CONFIRM = 2
DEFAULT_BASELINE = SDPA_MATH
BASELINES = (SDPA_MATH, SDPA)

Measure = Callable[[SpeedConfig, tuple[str, ...]], dict[str, Any]]


def _subprocess_measure(timeout_s: float) -> Measure:
    return lambda config, parts: run_in_subprocess(config, timeout_s, None, parts=parts)


class ThresholdSearch:
    """Measurements of one search, each (target, N) and each Post-LN memory point taken once."""

    def __init__(self, base: SpeedConfig, measure: Measure, progress: Callable[[str], None] | None = None,
                 baseline: str = DEFAULT_BASELINE) -> None:
        self.baseline_name = baseline
        self.base = replace(base, inference_only=True, reference=True, reference_target=baseline)
        self.measure = measure
        self.progress = progress or (lambda text: None)
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.baseline_memory: dict[int, dict[str, Any]] = {}

    def row(self, target: str, length: int) -> dict[str, Any]:
        if (target, length) not in self.rows:
            self.progress(f"{target} at N={length}")
            self.rows[target, length] = self.measure(replace(self.base, target=target, length=length), ("memory", "time"))
        return self.rows[target, length]

    def baseline(self, length: int) -> dict[str, Any]:
        if length not in self.baseline_memory:
            self.progress(f"Post-LN ({self.baseline_name}) memory at N={length}")
            self.baseline_memory[length] = self.measure(replace(self.base, target=self.baseline_name, length=length),
                                                        ("memory",))
        return self.baseline_memory[length]

    def wins(self, target: str, length: int) -> dict[str, bool | None]:
        """Per criterion: True (beats Post-LN at N), False, or None (a measurement failed)."""
        row, base = self.row(target, length), self.baseline(length)
        if row.get("status") != "ok" or base.get("status") != "ok":
            return {c: None for c in CRITERIA}
        return {"speed": row["forward_speedup_vs_sdpa"] > 1.0,
                "memory": row["peak_memory_bytes"] < base["peak_memory_bytes"]}


def _midpoint(low: int, high: int, resolution: int) -> int:
    return low + max(resolution, (high - low) // 2 // resolution * resolution)


def find_threshold(search: ThresholdSearch, target: str, grid: list[int], resolution: int = DEFAULT_RESOLUTION,
                   confirm: int = DEFAULT_CONFIRM) -> dict[str, dict[str, Any]]:
    """Per criterion: ``{"threshold": N or None, "below": N or None, "note": ...}``: the target wins at
    ``threshold`` and loses at ``below`` (None: it won from the first grid point, or never did)."""
    walked: list[tuple[int, dict[str, bool | None]]] = []
    streak = 0
    for length in grid:
        walked.append((length, search.wins(target, length)))
        streak = streak + 1 if all(walked[-1][1].values()) else 0
        if streak >= confirm:
            break
    out = {}
    for criterion in CRITERIA:
        outcomes = [(n, w[criterion]) for n, w in walked]
        failed = [n for n, won in outcomes if won is None]
        if failed:
            out[criterion] = {"threshold": None, "below": None, "note": f"measurement failed at N={failed[0]}"}
            continue
        losing = [i for i, (_, won) in enumerate(outcomes) if not won]
        if not losing:
            out[criterion] = {"threshold": outcomes[0][0], "below": None, "note": f"wins from the first N ({grid[0]})"}
            continue
        last = losing[-1]
        if last == len(outcomes) - 1:
            out[criterion] = {"threshold": None, "below": outcomes[last][0],
                              "note": f"loses up to the longest N measured ({outcomes[last][0]})"}
            continue
        low, high = outcomes[last][0], outcomes[last + 1][0]
        while high - low > resolution:
            mid = _midpoint(low, high, resolution)
            won = search.wins(target, mid)[criterion]
            if won is None:
                break
            low, high = (low, mid) if won else (mid, high)
        out[criterion] = {"threshold": high, "below": low, "note": ""}
    return out


def sweep_thresholds(targets: list[str], base: SpeedConfig, grid: list[int] | tuple[int, ...] = DEFAULT_GRID,
                     resolution: int = DEFAULT_RESOLUTION, confirm: int = DEFAULT_CONFIRM,
                     measure: Measure | None = None, timeout_s: float = 900.0,
                     progress: Callable[[str], None] | None = None, baseline: str = DEFAULT_BASELINE) -> dict[str, Any]:
    """Thresholds of every target against the Post-LN model, with every measurement behind them."""
    if baseline not in BASELINES:
        raise ValueError(f"the Post-LN baseline is one of {BASELINES}, got {baseline!r}")
    if resolution < 1 or confirm < 1:
        raise ValueError(f"resolution and confirm must be >= 1, got {resolution}, {confirm}")
    grid = sorted(set(grid))
    if not grid or grid[0] < 1:
        raise ValueError(f"the grid of lengths must hold positive lengths, got {grid}")
    if set(BASELINES) & set(targets):
        raise ValueError(f"{sorted(set(BASELINES) & set(targets))} is the Post-LN baseline every target is compared "
                         "with, not a target")
    search = ThresholdSearch(base, measure or _subprocess_measure(timeout_s), progress, baseline)
    thresholds = {t: find_threshold(search, t, grid, resolution, confirm) for t in targets}
    points = []
    for (target, length), row in sorted(search.rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        base_row = search.baseline(length)
        points.append({"target": target, "length": length, "status": row.get("status"),
                       "forward_s": row.get("forward_s"), "postln_forward_s": row.get("sdpa_forward_s"),
                       "speedup_vs_postln": row.get("forward_speedup_vs_sdpa"),
                       "peak_memory_bytes": row.get("peak_memory_bytes"),
                       "postln_peak_memory_bytes": base_row.get("peak_memory_bytes"),
                       "forward_wall_s": row.get("forward_wall_s"), "postln_forward_wall_s": row.get("sdpa_forward_wall_s"),
                       "flops": row.get("flops")})
    return {"config": asdict(search.base), "baseline": baseline, "grid": grid, "resolution": resolution, "confirm": confirm,
            "thresholds": thresholds, "points": points}


def _cell(entry: dict[str, Any]) -> str:
    if entry["threshold"] is None:
        return f"> {entry['below']}" if entry["below"] is not None else entry["note"]
    if entry["below"] is None:
        return f"<= {entry['threshold']}"
    return f"{entry['threshold']} (loses at {entry['below']})"


PAPER_TABLE3 = {"bigbird": (704, 848), "linformer": (448, 368), "flash": (432, 400), "singular": (192, 144)}


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
        if p["status"] != "ok":
            lines.append(f"| {p['target']} | {p['length']} | {p['status']} | | | | |")
            continue
        base = p["postln_peak_memory_bytes"]
        lines.append(f"| {p['target']} | {p['length']} | {1000 * p['forward_s']:.1f} | {1000 * p['postln_forward_s']:.1f} | "
                     f"{p['speedup_vs_postln']:.2f} | {p['peak_memory_bytes'] / 2**20:.1f} | "
                     f"{'-' if base is None else format(base / 2**20, '.1f')} |")
    return "\n".join(lines)


def plot_thresholds(report: dict[str, Any], path) -> None:
    """Speed-up over Post-LN and memory ratio to Post-LN against N, one line per model, 1 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for target in report["thresholds"]:
        pts = [p for p in report["points"] if p["target"] == target and p["status"] == "ok"]
        if not pts:
            continue
        axes[0].plot([p["length"] for p in pts], [p["speedup_vs_postln"] for p in pts], marker="o", label=target)
        mem = [(p["length"], p["postln_peak_memory_bytes"] / p["peak_memory_bytes"]) for p in pts
               if p["peak_memory_bytes"] and p["postln_peak_memory_bytes"]]
        if mem:
            axes[1].plot(*zip(*mem), marker="o", label=target)
    for ax, label in ((axes[0], "inference speed-up over Post-LN"), (axes[1], "Post-LN peak memory / model's")):
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("above 1: the linear model beats the Post-LN Transformer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
