"""What a mechanism costs at long lengths, beside a table of its accuracy: ``longattn compare``'s cost columns.

The accuracy of the README's main job is measured on a short task, where every mechanism costs about the same;
what the efficient mechanisms exist for shows at long lengths. For each compared mechanism (whatever the registry
holds) and each length, one attention layer's forward+backward is measured as ``longattn bench speed`` measures
it (:func:`longattn.bench.speed.run_in_subprocess`: a fresh process per configuration, peak memory in one, times
in another): the median process CPU time at one thread, which a loaded machine does not inflate, and the peak
memory above the resident inputs. A mechanism that runs out of time or memory at a length is marked so (and not
measured at longer ones).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # imported where measured: the command line reads the defaults here before torch loads
    from longattn.bench.speed import SpeedConfig

__all__ = ["CostSettings", "cost_cells", "cost_columns", "length_label", "measure_costs", "settings_record"]

# The lengths of the README's cost columns, and what a cost measurement may take per configuration
DEFAULT_COST_LENGTHS = (4096, 16384)
DEFAULT_COST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class CostSettings:
    """The layer measured (:class:`longattn.bench.speed.SpeedConfig`'s fields: one thread, so the times are
    process CPU time) and the lengths."""

    lengths: tuple[int, ...] = DEFAULT_COST_LENGTHS
    batch: int = 1
    heads: int = 2
    head_dim: int = 32
    warmup: int = 1
    repeats: int = 3
    timeout_s: float = DEFAULT_COST_TIMEOUT_S

    def config(self, mechanism: str, length: int) -> SpeedConfig:
        from longattn.bench.speed import SpeedConfig

        return SpeedConfig(target=mechanism, length=length, batch=self.batch, heads=self.heads,
                           head_dim=self.head_dim, threads=1, warmup=self.warmup, repeats=self.repeats,
                           reference=False)

    def describe(self) -> str:
        """The sentence under the table that says what the cost columns are."""
        return (f"Cost columns: one attention layer (batch {self.batch}, {self.heads} heads x {self.head_dim}), "
                f"forward+backward, median of {self.repeats} after {self.warmup} warm-up, process CPU time at one "
                "thread, and its peak memory above the resident inputs; measured in this run, each in its own "
                "process, as `longattn bench speed --threads 1` measures.")


def length_label(length: int) -> str:
    """``4k`` for 4096, ``16k`` for 16384, the number itself otherwise."""
    return f"{length // 1024}k" if length >= 1024 and length % 1024 == 0 else str(length)


def measure_costs(mechanisms: list[str], settings: CostSettings, write: Callable[[str], Any] = print,
                  workers: int = 1) -> dict[str, dict[int, dict[str, Any]]]:
    """{mechanism: {length: {"status", "forward_backward_s", "peak_memory_mb"}}} for every mechanism and length
    of ``settings``; one line per measurement. ``workers`` mechanisms are measured at once (each in its own
    one-thread process, and process CPU time is what is reported, so measurements side by side on separate cores
    stay each its own; the lengths of one mechanism run in turn, shortest first)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        measured = list(pool.map(lambda mechanism: _measure_mechanism(mechanism, settings, write), mechanisms))
    return dict(zip(mechanisms, measured))


def _measure_mechanism(mechanism: str, settings: CostSettings,
                       write: Callable[[str], Any]) -> dict[int, dict[str, Any]]:
    """One mechanism's cost at every length; after a length runs out of time or memory the longer ones are not
    tried."""
    from longattn.bench.speed import run_in_subprocess

    costs: dict[int, dict[str, Any]] = {}
    failed = None
    for length in sorted(settings.lengths):
        if failed is not None:  # out of time or memory at a shorter length: longer ones will be too
            costs[length] = {"status": f"{failed} at a shorter length"}
            continue
        row = run_in_subprocess(settings.config(mechanism, length), settings.timeout_s, None)
        if row["status"] != "ok":
            failed = row["status"]
            costs[length] = {"status": row["status"], "error": row.get("error")}
        else:
            costs[length] = {"status": "ok", "forward_backward_s": row["forward_backward_s"],
                             "peak_memory_mb": row["peak_memory_bytes"] / 2**20}
        cost = costs[length]
        write(f"cost: {mechanism} at N={length_label(length)}: " + (
            f"forward+backward {cost['forward_backward_s']:.3g} s CPU, peak {cost['peak_memory_mb']:.0f} MB"
            if cost["status"] == "ok" else cost["status"]))
    return costs


def cost_columns(settings: CostSettings) -> list[str]:
    """The table's headers of the cost columns, two per length."""
    return [header for length in sorted(settings.lengths)
            for header in (f"fwd+bwd {length_label(length)} (s)", f"mem {length_label(length)} (MB)")]


def cost_cells(costs: dict[int, dict[str, Any]] | None, settings: CostSettings) -> list[str]:
    """One mechanism's cost columns: time and memory per length, or why not."""
    cells = []
    for length in sorted(settings.lengths):
        cost = (costs or {}).get(length) or {"status": "-"}
        if cost["status"] == "ok":
            cells += [f"{cost['forward_backward_s']:.3g}", f"{cost['peak_memory_mb']:.0f}"]
        else:
            cells += [cost["status"], "-"]
    return cells


def settings_record(settings: CostSettings) -> dict[str, Any]:
    """``settings`` as results.json holds them."""
    return asdict(settings)
