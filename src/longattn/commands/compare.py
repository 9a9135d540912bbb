"""``longattn compare``: several mechanisms on one task with the same config and budget."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from longattn.commands._args import add_config_arguments, attention_list, no_progress, seed_list
from longattn.experiment.grid import Cell, markdown_table, mean_std, run_cells
from longattn.experiment.results import now, write_results
from longattn.tasks.base import get_task, task_names

# The README's main job: the papers' mechanisms and two baselines.
DEFAULT_ATTENTIONS = ("softmax", "skeleton", "singular", "fsat", "skein", "nystrom", "linformer")


def run_compare(task: str, attentions: list[str], out_dir: str | Path, preset: str | None = "demo",
                config_file: str | None = None, overrides: list[str] = (), seeds: list[int] = (0,),
                resume: bool = False) -> dict[str, Any]:
    """Train every mechanism of ``attentions`` on ``task`` into ``out_dir/<mechanism>/seed<k>``; table + plot."""
    started = now()
    out_dir = Path(out_dir)
    cells = [Cell(name, task, task, preset, config_file, list(overrides), {"attention": name}) for name in attentions]
    run_cells(cells, list(seeds), out_dir, run_dir=lambda cell, seed: out_dir / cell.row / f"seed{seed}",
              resume=resume)
    task_obj = get_task(task)
    metric = task_obj.select_metric + (" (%)" if task_obj.table_scale == 100 else "")
    headers = ["attention", "params", f"val {metric}", f"test {metric}", "train time (s)", "steps/s", "peak mem (MB)"]
    table = (f"### {task}: test {task_obj.select_metric} of the best validation checkpoint\n\n"
             + markdown_table(headers, [_row(cell) for cell in cells]) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(table)
    summary = {"task": task, "preset": preset, "seeds": list(seeds), "overrides": list(overrides),
               "metric": task_obj.select_metric,
               "runs": [{"attention": c.attention, "error": c.error, "results": c.results} for c in cells]}
    write_results(out_dir / "results.json", summary, seeds=list(seeds), started=started)
    plot_compare(cells, out_dir / "compare.png", task)
    print(table)
    print(f"wrote {out_dir / 'table.md'}, {out_dir / 'results.json'}, {out_dir / 'compare.png'}")
    return summary


def _row(cell: Cell) -> list[Any]:
    if cell.error or not cell.results:
        return [cell.attention, "-", "failed", cell.error or "no result", "-", "-", "-"]
    first = cell.results[0]
    times = [r["train_time_s"] for r in cell.results]
    rate = statistics.mean(r["steps"] / r["train_time_s"] for r in cell.results if r["train_time_s"] > 0)
    return [cell.attention, first["parameters"], mean_std(cell.values(split="val")), mean_std(cell.values()),
            f"{statistics.mean(times):.1f}", f"{rate:.1f}", f"{max(r['peak_memory_mb'] for r in cell.results):.0f}"]


def plot_compare(cells: list[Cell], path: Path, task: str) -> None:
    """The validation metric over training steps (left) and the test metric (right), one colour per mechanism."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    task_obj = get_task(task)
    metric, scale = task_obj.select_metric, task_obj.table_scale
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4))
    names, tests = [], []
    for cell in cells:
        if not cell.results:
            continue
        history = cell.results[0].get("history") or []
        if history:
            curves.plot([h["step"] for h in history], [scale * h[metric] for h in history], marker=".",
                        label=cell.attention)
        names.append(cell.attention)
        tests.append(statistics.mean(cell.values()) if cell.values() else 0.0)
    curves.set(xlabel="optimiser step", ylabel=f"validation {metric}", title=f"{task}: validation")
    if names:
        curves.legend(fontsize="small")
    bars.bar(names, tests, color=[f"C{i}" for i in range(len(names))])
    bars.set(ylabel=f"test {metric}", title=f"{task}: test (best validation checkpoint)")
    bars.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cmd(args: argparse.Namespace) -> int:
    summary = run_compare(args.task, attention_list(args.attentions), args.out, preset=args.preset,
                          config_file=args.config, overrides=no_progress(args), seeds=seed_list(args.seeds),
                          resume=args.resume)
    return 1 if any(run["error"] for run in summary["runs"]) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compare", help="train several mechanisms on one task: table + plot",
                              description="Train each mechanism with the same config and budget; write table.md, "
                              "results.json and compare.png to --out.")
    p.add_argument("--task", default="listops", choices=task_names(), metavar="TASK",
                   help=f"registered task: {', '.join(task_names())}")
    p.add_argument("--attentions", default=",".join(DEFAULT_ATTENTIONS), help="comma-separated mechanisms")
    add_config_arguments(p)
    p.set_defaults(preset="demo")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (mean ± std over them)")
    p.add_argument("--out", default="runs/compare", help="output folder")
    p.add_argument("--resume", action="store_true", help="reuse finished runs and resume interrupted ones")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd)
