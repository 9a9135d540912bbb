"""Sequence-parallel attention: bytes communicated per layer, time and peak memory per rank,
against the sequence length N and the number of processes P.

For each P the processes are started by torchrun's own launcher (torch.distributed.launcher,
what ``torchrun --standalone`` runs), gloo on CPU. Every rank builds the same layer (same seed)
and its own shard of N / P tokens, and runs forward + backward through
longattn.parallel.sequence_parallel. Per configuration and rank:

* bytes: the payload of every collective of one forward + backward (longattn.parallel's
  count_communication; the all-gather of shard lengths included);
* time: median over repeats of the wall time and of the process CPU time of forward + backward;
* peak memory: the growth of the process's peak RSS (VmHWM) over one forward + backward.

Quadratic mechanisms are skipped above ``quadratic_max_length`` (their time grows as N^2 / P).
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Defaults of ``longattn bench seqpar`` live here only; the command reads them.
DEFAULT_ATTENTIONS = ("skeleton", "singular", "nystrom", "linear", "performer", "softmax")
DEFAULT_LENGTHS = "16k,64k,256k,1m"
DEFAULT_PROCESSES = "2,4"
DEFAULT_QUADRATIC_MAX_LENGTH = 65536
#: build options per mechanism (the rest are each mechanism's paper defaults)
MECHANISM_OPTIONS: dict[str, dict[str, Any]] = {
    "nystrom": {"num_landmarks": 64},
    "singular": {"residual_scores": False},
}


@dataclass
class SeqparConfig:
    attentions: list[str]
    lengths: list[int]
    processes: int = 2
    batch: int = 1
    dim: int = 32
    heads: int = 2
    #: max_len of the layers that need one (skeleton): one layer for every N, so that the
    #: Smoother's spectrum, sized by max_len, is the same at every N. None = the largest N.
    max_len: int | None = None
    threads: int = 1
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    quadratic_max_length: int = DEFAULT_QUADRATIC_MAX_LENGTH
    options: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(MECHANISM_OPTIONS))


def _measure(config: SeqparConfig, name: str, length: int) -> dict[str, Any]:
    import torch.distributed as dist

    from longattn import attention
    from longattn.bench.speed import _reset_peak_rss, _status_bytes
    from longattn.parallel import count_communication, sequence_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    row: dict[str, Any] = {"attention": name, "length": length, "processes": world, "rank": rank}
    if not attention.capabilities(name).subquadratic and length > config.quadratic_max_length:
        return {**row, "skipped": f"quadratic, N > {config.quadratic_max_length}"}
    torch.manual_seed(config.seed)  # the same layer on every rank
    max_len = config.max_len or max(config.lengths)
    layer = attention.build(name, dim=config.dim, heads=config.heads, max_len=max_len, **config.options.get(name, {}))
    sharded = sequence_parallel(layer.train())
    part = -(-length // world)
    local = min(part, length - rank * part)  # the last rank may hold fewer tokens
    generator = torch.Generator().manual_seed(config.seed * 1000 + rank)
    x = torch.randn(config.batch, local, config.dim, generator=generator).requires_grad_()

    def step() -> None:
        sharded(x).sum().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(config.warmup):
        step()
    dist.barrier()
    before = _status_bytes("VmRSS")
    _reset_peak_rss()
    with count_communication() as log:
        step()
    peak = _status_bytes("VmHWM") - before
    walls, cpus = [], []
    for _ in range(config.repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {**row, "local_length": local, "max_len": max_len if attention.capabilities(name).needs_max_len else None,
            "forward_bytes": log.forward_bytes, "backward_bytes": log.backward_bytes,
            "bytes_per_layer": log.total_bytes, "wall_s": statistics.median(walls),
            "cpu_s": statistics.median(cpus), "peak_memory_bytes": max(0, peak)}


def worker(config: SeqparConfig) -> list[dict[str, Any]]:
    """One rank of a launch: every (mechanism, N) of ``config``, one row each."""
    import torch.distributed as dist

    torch.set_num_threads(config.threads)
    dist.init_process_group("gloo")
    try:
        return [_measure(config, name, length) for name in config.attentions for length in config.lengths]
    finally:
        dist.destroy_process_group()


def run_seqpar(config: SeqparConfig) -> list[dict[str, Any]]:
    """Launch ``config.processes`` ranks with torchrun's launcher; rows of every rank."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=config.processes, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    results = elastic_launch(launch, worker)(config)
    return [row for rank in sorted(results) for row in results[rank]]


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mechanism, N, P): bytes of rank 0, the slowest rank's times, the largest
    rank's peak memory."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["attention"], row["length"], row["processes"]), []).append(row)
    out = []
    for (name, length, procs), ranks in groups.items():
        if "skipped" in ranks[0]:
            out.append({"attention": name, "length": length, "processes": procs, "skipped": ranks[0]["skipped"]})
            continue
        out.append({"attention": name, "length": length, "processes": procs, "max_len": ranks[0]["max_len"],
                    "bytes_per_layer": max(r["bytes_per_layer"] for r in ranks),
                    "forward_bytes": max(r["forward_bytes"] for r in ranks),
                    "wall_s": max(r["wall_s"] for r in ranks), "cpu_s": max(r["cpu_s"] for r in ranks),
                    "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks]})
    return sorted(out, key=lambda r: (r["attention"], r["processes"], r["length"]))


def bytes_growth(summary: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (mechanism, P): bytes at the largest N over bytes at the smallest N."""
    out: dict[str, dict[str, Any]] = {}
    for row in summary:
        if "skipped" in row:
            continue
        key = f"{row['attention']} P={row['processes']}"
        entry = out.setdefault(key, {"from": row["length"], "to": row["length"], "bytes_from": row["bytes_per_layer"],
                                     "bytes_to": row["bytes_per_layer"]})
        if row["length"] < entry["from"]:
            entry.update({"from": row["length"], "bytes_from": row["bytes_per_layer"]})
        if row["length"] > entry["to"]:
            entry.update({"to": row["length"], "bytes_to": row["bytes_per_layer"]})
    for entry in out.values():
        entry["ratio"] = entry["bytes_to"] / entry["bytes_from"] if entry["bytes_from"] else math.nan
        entry["length_ratio"] = entry["to"] / entry["from"]
    return out


def seqpar_table(summary: list[dict[str, Any]]) -> str:
    lines = ["| attention | P | N | N per rank | bytes per layer (fwd+bwd) | fwd+bwd s (wall) | fwd+bwd s (CPU) | peak MiB per rank |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary:
        if "skipped" in r:
            lines.append(f"| {r['attention']} | {r['processes']} | {r['length']} | | skipped: {r['skipped']} | | | |")
            continue
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes_per_rank"])
        lines.append(f"| {r['attention']} | {r['processes']} | {r['length']} | {-(-r['length'] // r['processes'])} | "
                     f"{r['bytes_per_layer']:,} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {peaks} |")
    return "\n".join(lines)


def growth_table(growth: dict[str, dict[str, Any]]) -> str:
    lines = ["| attention | N from | N to | N ratio | bytes from | bytes to | bytes ratio |", "|---|---|---|---|---|---|---|"]
    for key, g in growth.items():
        lines.append(f"| {key} | {g['from']} | {g['to']} | {g['length_ratio']:.0f} | {g['bytes_from']:,} | "
                     f"{g['bytes_to']:,} | {g['ratio']:.3f} |")
    return "\n".join(lines)


def plot_seqpar(summary: list[dict[str, Any]], path: str | Path) -> None:
    """Log-log: bytes per layer, wall time and largest per-rank peak memory against N, one line
    per (mechanism, P)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in summary:
        if "skipped" not in r:
            series.setdefault(f"{r['attention']} P={r['processes']}", []).append(r)
    for label, rows in series.items():
        rows = sorted(rows, key=lambda r: r["length"])
        n = [r["length"] for r in rows]
        axes[0].plot(n, [r["bytes_per_layer"] for r in rows], marker="o", label=label)
        axes[1].plot(n, [r["wall_s"] for r in rows], marker="o", label=label)
        axes[2].plot(n, [max(r["peak_memory_bytes_per_rank"]) / 2**20 for r in rows], marker="o", label=label)
    for ax, title in zip(axes, ("bytes communicated per layer (fwd+bwd, per rank)", "fwd+bwd wall seconds",
                                "peak MiB (largest rank)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def config_dict(config: SeqparConfig) -> dict[str, Any]:
    return asdict(config)
