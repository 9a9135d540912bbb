"""``longattn compare``: grids of training runs. ``compare mechanisms`` (the default): several mechanisms on one
task with the same config and budget; ``compare sweep``: the rows of a sweep file; ``compare settings``: a
forecaster's settings chosen on validation only."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longattn.commands import VERB_HELP
from longattn.commands._args import (add_attentions_argument, add_config_arguments, add_data_dir_argument,
                                    add_list_argument, add_no_progress_argument, add_overwrite_argument,
                                    add_resume_argument, add_set_argument, add_workers_argument, attention_names,
                                    name_type, no_progress, preset_help, task_names)
from longattn.bench.cost import (DEFAULT_COST_LENGTHS, CostSettings, cost_cells, cost_columns, length_label,
                                 measure_costs, settings_record)
from longattn.commands._args import _positive_int
from longattn.config import ConfigError

if TYPE_CHECKING:
    from longattn.experiment.grid import Cell

# The experiment modules (and torch with them) are imported by the functions that run a grid, not here:
# `longattn compare --help` answers without them (tests/commands/test_cli_startup.py). Help texts that name the
# registries' entries are callables, read only when that help is printed (longattn.commands._args.HelpFormatter).

# The README's main job: the papers' mechanisms and two baselines.
DEFAULT_ATTENTIONS = ("softmax", "skeleton", "singular", "fsat", "skein", "nystrom", "linformer")


# The row every other row is compared with (paired by seed) when it is compared and --reference names no other;
# without it, the first mechanism.
DEFAULT_REFERENCE = "softmax"

# The frontier picture under the table (accuracy against cost at the longest cost length)
FRONTIER_NAME = "frontier.png"


def run_compare(task: str, attentions: list[str], out_dir: str | Path, preset: str | None = "demo",
                config_file: str | None = None, overrides: list[str] = (), seeds: list[int] | None = None,
                resume: bool = False, reference: str | None = None, workers: int | None = 1,
                overwrite: bool = False, cost: CostSettings | None = None) -> dict[str, Any]:
    """Train every mechanism of ``attentions`` on ``task`` into ``out_dir/<mechanism>/seed<k>`` (seeds default to
    :func:`default_seeds` of the preset; ``workers`` runs at once, None: the thread policy's choice; runs
    already there: refused, or ``resume``d, or trained again with ``overwrite``); table (mean, std, standard error, paired
    difference from ``reference``), plot with error bars, learning curves. With ``cost``, each mechanism's
    forward+backward time and peak memory at long lengths are measured after the training (one thread, in
    this run: :mod:`longattn.bench.cost`) as columns of the table, and the frontier picture (accuracy against
    the time at the longest length) is drawn under it."""
    from longattn.experiment.curves import curve_groups, write_learning_curves
    from longattn.experiment.grid import Cell, default_seeds, difference_record, run_cells
    from longattn.experiment.results import now, write_results
    from longattn.experiment.threads import plan_threads
    from longattn.tasks.base import get_task

    started = now()
    out_dir = Path(out_dir)
    seeds = list(seeds) if seeds else default_seeds(preset)
    if reference is None:
        reference = DEFAULT_REFERENCE if DEFAULT_REFERENCE in attentions else attentions[0]
    if reference not in attentions:
        raise ConfigError(f"--reference {reference!r} is not among the compared mechanisms ({', '.join(attentions)})")
    cells = [Cell(name, task, task, preset, config_file, list(overrides), {"attention": name}) for name in attentions]
    plan = plan_threads(len(cells) * len(seeds), workers=workers)
    run_cells(cells, seeds, out_dir, run_dir=lambda cell, seed: out_dir / cell.row / f"seed{seed}", resume=resume,
              overwrite=overwrite, plan=plan)
    costs = measure_costs(attentions, cost, workers=plan.workers) if cost else None
    base = next(cell for cell in cells if cell.attention == reference)
    table = compare_table(task, cells, base, seeds, costs=costs, cost=cost)
    if plan.workers > 1:  # the time and memory columns are then not each mechanism's alone
        table += (f"\nTrain time, steps/s and peak memory were measured with up to {plan.workers} runs training at "
                  "once, each beside the others: compare speed with `longattn bench`, not with these columns.\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [out_dir / "compare.png"]
    if costs:
        figures.append(out_dir / FRONTIER_NAME)
        plot_frontier(cells, costs, cost, figures[-1], task)
        table += f"\n![accuracy against cost at N={length_label(max(cost.lengths))}]({FRONTIER_NAME})\n"
    (out_dir / "table.md").write_text(table)
    summary = {"task": task, "preset": preset, "seeds": seeds, "overrides": list(overrides),
               "workers": plan.workers, "threads_per_run": plan.threads,
               "metric": get_task(task).select_metric, "reference": reference,
               "cost": None if cost is None else {"settings": settings_record(cost), "measured": costs},
               "runs": [{"attention": c.attention, "error": c.error, "test_summary": c.summary(),
                         "val_summary": c.summary(split="val"), "difference": difference_record(c, base),
                         "not_converged": c.not_converged(),
                         "results": c.results} for c in cells]}
    write_results(out_dir / "results.json", summary, seeds=seeds, started=started)
    plot_compare(cells, out_dir / "compare.png", task)
    written = write_learning_curves(curve_groups(cells), out_dir)
    print(table)
    files = [out_dir / "table.md", out_dir / "results.json", *figures, *written]
    print(f"wrote {', '.join(str(path) for path in files)}")
    return summary


def compare_table(task: str, cells: list[Cell], base: Cell, seeds: list[int],
                  costs: dict[str, dict[int, dict[str, Any]]] | None = None, cost: CostSettings | None = None) -> str:
    """One row per mechanism: the metric's mean ± std on validation and test, the test standard error, the
    paired difference from ``base`` with its interval (marked when not significant), time and memory; with
    ``costs`` (measured with ``cost``), the cost columns at long lengths and the sentence that says what they
    are."""
    from longattn.experiment.grid import convergence_legend
    from longattn.experiment.results import markdown_table
    from longattn.experiment.stats import legend
    from longattn.tasks.base import get_task

    task_obj = get_task(task)
    metric = task_obj.select_metric + (" (%)" if task_obj.table_scale == 100 else "")
    headers = ["attention", "params", f"val {metric}", f"test {metric}", "s.e.",
               f"Δ test vs {base.attention}", "train time (s)", "steps/s", "peak mem (MB)"]
    rows = [_row(cell, base) for cell in cells]
    if costs is not None and cost is not None:
        headers += cost_columns(cost)
        rows = [row + cost_cells(costs.get(cell.attention), cost) for row, cell in zip(rows, cells)]
    table = (f"### {task}: test {task_obj.select_metric} of the best validation checkpoint, mean ± std over "
             f"seeds {seeds}\n\n" + markdown_table(headers, rows) + "\n"
             + convergence_legend(any(cell.not_converged() for cell in cells)))
    if costs is not None and cost is not None:
        table += f"\n{cost.describe()}\n"
    if len(cells) > 1:
        table += f"\n{legend(base.attention)}\n"
    return table


def _row(cell: Cell, base: Cell) -> list[Any]:
    from longattn.experiment.grid import paired_against
    from longattn.experiment.stats import format_difference, format_sem, mean_std

    if cell.error or not cell.results:
        return [cell.attention, "-", "failed", cell.error or "no result", "-", "-", "-", "-", "-"]
    first = cell.results[0]
    times = [r["train_time_s"] for r in cell.results]
    rate = statistics.mean(r["steps"] / r["train_time_s"] for r in cell.results if r["train_time_s"] > 0)
    difference = ("reference" if cell is base else
                  format_difference(paired_against(cell, base)) if base.results else "-")
    return [cell.attention, first["parameters"], mean_std(cell.values(split="val")),
            mean_std(cell.values()) + cell.convergence_mark(),
            format_sem(cell.values()), difference, f"{statistics.mean(times):.1f}", f"{rate:.1f}",
            f"{max(r['peak_memory_mb'] for r in cell.results):.0f}"]


def plot_compare(cells: list[Cell], path: Path, task: str) -> None:
    """Validation metric over training steps, mean ± std over seeds (left); test metric per mechanism, mean with
    ± std error bars and each seed as a dot (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    from longattn.experiment.curves import CurveGroup, learning_curves
    from longattn.experiment.stats import summarize
    from longattn.tasks.base import get_task

    task_obj = get_task(task)
    metric, unit = task_obj.select_metric, " (%)" if task_obj.table_scale == 100 else ""
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4))
    done = [cell for cell in cells if cell.results]
    for index, cell in enumerate(done):
        points = learning_curves(CurveGroup(task, cell.attention, cell.results))["points"]
        steps = [p["step"] for p in points]
        mean = [p["metric"] for p in points]
        spread = [0.0 if math.isnan(p["metric_std"]) else p["metric_std"] for p in points]
        curves.plot(steps, mean, marker=".", color=f"C{index}", label=cell.attention)
        curves.fill_between(steps, [m - s for m, s in zip(mean, spread)], [m + s for m, s in zip(mean, spread)],
                            color=f"C{index}", alpha=0.15, linewidth=0)
        values = cell.values()
        summary = summarize(values)
        bars.bar(index, summary.mean, color=f"C{index}", alpha=0.6,
                 yerr=0.0 if math.isnan(summary.std) else summary.std, capsize=4)
        bars.plot([index] * len(values), values, "k.", markersize=4)
    seeds = max((len(cell.results) for cell in done), default=0)
    over = f"mean ± std over {seeds} seed{'s' if seeds != 1 else ''}"
    curves.set(xlabel="optimiser step", ylabel=f"validation {metric}{unit}", title=f"{task}: validation, {over}")
    if done:
        curves.legend(fontsize="small")
    classes = getattr(task_obj, "num_classes", 0) if metric == "accuracy" else 0
    if classes:  # uniform guessing, so that a reader sees how far every mechanism is from it
        bars.axhline(task_obj.table_scale / classes, color="grey", linestyle="--", linewidth=1, label="chance")
        bars.legend(fontsize="small", loc="lower right")
    bars.set_xticks(range(len(done)), [cell.attention for cell in done], rotation=30)
    bars.set(ylabel=f"test {metric}{unit}", title=f"{task}: test, {over} (dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_frontier(cells: list[Cell], costs: dict[str, dict[int, dict[str, Any]]], cost: CostSettings, path: Path,
                  task: str) -> None:
    """The frontier picture: each mechanism's test metric (mean ± std over seeds) against its forward+backward
    time at the longest cost length (log scale), the peak memory beside its name; a mechanism that ran out of
    time or memory there is drawn at the right edge, marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    from longattn.experiment.stats import summarize
    from longattn.tasks.base import get_task

    task_obj = get_task(task)
    length = max(cost.lengths)
    points = [(cell, costs.get(cell.attention, {}).get(length, {})) for cell in cells if cell.results]
    measured = [c["forward_backward_s"] for _, c in points if c.get("status") == "ok"]
    edge = max(measured, default=1.0) * 2  # where the mechanisms without a time at this length are drawn
    fig, axes = plt.subplots(figsize=(6.5, 4.5))
    labels = []
    for index, (cell, point) in enumerate(points):
        summary = summarize(cell.values())
        ok = point.get("status") == "ok"
        x = point["forward_backward_s"] if ok else edge
        axes.errorbar(x, summary.mean, yerr=0.0 if math.isnan(summary.std) else summary.std, fmt="o" if ok else "x",
                      color=f"C{index}", capsize=3)
        label = (f"{cell.attention} ({point['peak_memory_mb']:.0f} MB)" if ok
                 else f"{cell.attention} ({point.get('status', 'not measured')})")
        labels.append((label, x, summary.mean, f"C{index}"))
    unit = " (%)" if task_obj.table_scale == 100 else ""
    axes.set_xscale("log")
    axes.set(xlabel=f"forward+backward at N={length_label(length)}, one layer (s of CPU, 1 thread)",
             ylabel=f"test {task_obj.select_metric}{unit}",
             title=f"{task}: accuracy against cost at N={length_label(length)}")
    fig.tight_layout()
    _place_labels(fig, axes, labels)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# Label offsets (points from the marker) tried in turn until a label overlaps no label placed before it
LABEL_OFFSETS = ((5, 4), (5, -12), (5, 14), (5, -22), (5, 24), (-5, 4), (-5, -12))


def _place_labels(fig: Any, axes: Any, labels: list[tuple[str, float, float, str]]) -> None:
    """Writes each label beside its point at the first offset of LABEL_OFFSETS where its box (as the renderer
    draws it) stays inside the axes and overlaps no label already placed, so mechanisms of about the same cost and
    accuracy stay readable and the costliest one's label is not cut at the right edge (it goes to the left of its
    point); a label that fits nowhere takes the first offset inside the axes, else the first. Offsets to the left
    are right-aligned."""
    renderer = fig.canvas.get_renderer()
    frame = axes.get_window_extent(renderer)

    def inside(box: Any) -> bool:
        return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1

    def write(label: str, x: float, y: float, color: str, offset: tuple[int, int]) -> Any:
        return axes.annotate(label, (x, y), textcoords="offset points", xytext=offset, fontsize="small",
                             color=color, ha="left" if offset[0] > 0 else "right")

    placed = []
    for label, x, y, color in labels:
        fallback = None
        for offset in LABEL_OFFSETS:
            text = write(label, x, y, color, offset)
            box = text.get_window_extent(renderer)
            text.remove()
            if inside(box) and fallback is None:
                fallback = offset
            if inside(box) and not any(box.overlaps(other) for other in placed):
                break
        else:
            offset = fallback or LABEL_OFFSETS[0]
        placed.append(write(label, x, y, color, offset).get_window_extent(renderer))


def _cost_settings(args: argparse.Namespace) -> CostSettings | None:
    if args.no_cost:
        return None
    return CostSettings(lengths=tuple(args.cost_lengths), repeats=args.cost_repeats)


def _mechanisms(args: argparse.Namespace) -> int:
    summary = run_compare(args.task, args.attentions, args.out, preset=args.preset, config_file=args.config,
                          overrides=_data_dir(args) + no_progress(args), seeds=args.seeds, resume=args.resume,
                          reference=args.reference, workers=args.workers, overwrite=args.overwrite,
                          cost=_cost_settings(args))
    return 1 if any(run["error"] for run in summary["runs"]) else 0


def _grid() -> Any:
    """:mod:`longattn.experiment.grid`, imported when a help text or a run needs it."""
    from longattn.experiment import grid

    return grid


def _data_dir(args: argparse.Namespace) -> list[str]:
    """--data-dir as the override it stands for (first: a --set of the same key wins)."""
    return [f"data.data_dir={args.data_dir}"] if args.data_dir else []


def _sweep(args: argparse.Namespace) -> int:
    from longattn.experiment.grid import load_sweep, run_sweep

    spec = load_sweep(args.config)
    summary = run_sweep(spec, args.out, preset=args.preset, tasks=args.tasks,
                        extra_overrides=_data_dir(args) + args.overrides, seeds=args.seeds, resume=args.resume,
                        reference=args.reference, workers=args.workers, overwrite=args.overwrite)
    return 1 if any(cell["error"] for cell in summary["cells"]) else 0


def sweep_arguments(parser: argparse.ArgumentParser, config: str | None = None) -> None:
    """The options of a sweep; ``config`` fixes the sweep file (a paper's table) instead of --config."""
    if config is None:
        parser.add_argument("--config", required=True, help=lambda: "sweep file, or the name of a shipped one "
                            f"({', '.join(_grid().shipped_sweeps())})")
    else:
        parser.set_defaults(config=config)
    parser.add_argument("--preset", help=lambda: "task preset to use instead of the sweep file's (e.g. demo for a "
                        "quick check); " + preset_help(task_names("lra")))
    add_list_argument(parser, "--tasks", names=task_names, kind="task", help="subset of the sweep's tasks")
    add_data_dir_argument(parser, help="data folder of every run (same as --set data.data_dir=DIR)")
    add_set_argument(parser, help="override for every run, e.g. --set train.max_steps=100 (repeatable)")
    add_list_argument(parser, "--seeds", item=int, kind="seed",
                      help=lambda: f"seeds of every row (default: the sweep file's, else {_grid().DEMO_SEEDS} for "
                      f"the demo preset and {_grid().PAPER_SEEDS} for the papers')")
    parser.add_argument("--reference", help="row the others are compared with, paired by seed (default: the sweep "
                        "file's `reference`, else its first row)")
    parser.add_argument("--out", required=True, help="output folder (one folder per row, task and seed)")
    add_resume_argument(parser)
    add_workers_argument(parser)


def _settings(args: argparse.Namespace) -> int:
    from longattn.forecast.select import select_settings

    select_settings(args.dataset, args.data_dir, args.model, args.pred_len, args.grid, args.out,
                    overrides=args.overrides, seeds=args.seeds, attention=args.attention, workers=args.workers,
                    overwrite=args.overwrite)
    return 0


def _settings_arguments(parser: argparse.ArgumentParser) -> None:
    def forecasters() -> list[str]:
        from longattn.models.registry import model_names

        return model_names("forecaster")

    def series() -> str:
        from longattn.data.timeseries import SERIES

        return f"{', '.join(SERIES)} or a path to a CSV with a date column"

    parser.add_argument("--dataset", required=True, help=series)
    add_data_dir_argument(parser, help="folder holding the benchmark CSV files")
    parser.add_argument("--model", required=True, type=name_type("forecaster", forecasters), metavar="MODEL",
                        help=lambda: f"registered forecaster: {', '.join(forecasters())}")
    parser.add_argument("--attention", type=name_type("mechanism", attention_names), metavar="MECHANISM",
                        help="registered attention for models that take one (default: the config's)")
    parser.add_argument("--pred-len", type=int, required=True, help="the horizon, in time steps")
    parser.add_argument("--grid", nargs="+", action="extend", required=True, metavar="KEY=V1,V2",
                        help="candidate values of one key each, e.g. --grid optim.lr=1e-4,1e-3 model.d_model=64,128 "
                        "(every combination is tried)")
    add_set_argument(parser, help="fixed override for every candidate (repeatable)")
    add_list_argument(parser, "--seeds", item=int, kind="seed", default=[0], help="seeds of every candidate")
    parser.add_argument("--out", required=True, help="folder for the candidates' runs and selection.md/json "
                        "(finished candidates are reused, interrupted ones continued)")
    add_overwrite_argument(parser)
    add_workers_argument(parser)


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "compare", help=VERB_HELP["compare"],
        description="Grids of training runs, each run in its own folder under --out, with "
        "a table (mean ± std over seeds, paired differences) and plots. `longattn compare` alone is "
        "`longattn compare mechanisms`: the README's main job.")
    sub = group.add_subparsers(dest="grid", metavar="GRID", required=True)
    p = sub.add_parser("mechanisms", help="train several mechanisms on one task with the same config and budget "
                       "(the default)", description="Train each mechanism with the same config, budget and seeds; "
                       "write table.md, results.json, compare.png and the learning curves to --out.")
    p.add_argument("--task", default="listops", type=name_type("task", task_names), metavar="TASK",
                   help=lambda: f"registered task: {', '.join(task_names())}")
    add_attentions_argument(p, default=list(DEFAULT_ATTENTIONS), help="the mechanisms compared")
    add_config_arguments(p)
    p.set_defaults(preset="demo")
    add_data_dir_argument(p, help="the task's data folder (same as --set data.data_dir=DIR; generated tasks need "
                          "none)")
    add_list_argument(p, "--seeds", item=int, kind="seed", help=lambda: "seeds of every mechanism (default: "
                      f"{_grid().DEMO_SEEDS} for the demo preset, {_grid().PAPER_SEEDS} for the papers' presets)")
    p.add_argument("--reference", help=f"mechanism the others are compared with, paired by seed (default: "
                   f"{DEFAULT_REFERENCE} when compared, else the first)")
    p.add_argument("--out", default="runs/compare", help="output folder")
    add_resume_argument(p)
    add_no_progress_argument(p)
    add_workers_argument(p)
    add_list_argument(p, "--cost-lengths", item="length", kind="length", default=list(DEFAULT_COST_LENGTHS),
                      help="lengths of the cost columns: each mechanism's forward+backward time and peak memory, "
                      "one layer, one thread, measured after the training")
    p.add_argument("--cost-repeats", type=_positive_int, default=CostSettings.repeats,
                   help="timed calls per cost measurement (the median is kept)")
    p.add_argument("--no-cost", action="store_true", help="no cost columns and no frontier picture (without it, "
                   "the cost at --cost-lengths is measured after the training)")
    p.set_defaults(func=_mechanisms)

    s = sub.add_parser("sweep", help="the rows of a sweep file (a config grid or named ablations) on its tasks",
                       description="Run every row (grid point or named variant) of a sweep file on every task; "
                       "write table.md and results.json (see docs/lra.md for the file format). The papers' shipped "
                       "sweeps are also under `longattn paper`.")
    sweep_arguments(s)
    s.set_defaults(func=_sweep)

    t = sub.add_parser("settings", help="choose a forecaster's settings on validation MSE only (every combination "
                       "of --grid values)", description="Train every combination of the --grid values without a "
                       "test split (no test window is ever scored); the lowest mean validation MSE wins. Writes "
                       "selection.md and selection.json (the winner's overrides, ready for a config file).")
    _settings_arguments(t)
    t.set_defaults(func=_settings)
