"""S^3 Attention Table 14 and Figure 2: the token matrix before and after the Smoother's Fourier convolution.

Appendix E of S^3 Attention trains S^3 Attention with r = s1 = s2 = 8 for 100 steps on Text and
Pathfinder, then computes, for every validation example, the mu-incoherence (Definition 1,
:func:`longattn.analysis.mu_incoherence`) of its token matrix X (the Smoother's input, real tokens
only) and of X^smooth (eq. 3, the Fourier convolution of the same X) at rank 16 and 32. Here each
seed is one such run; a seed's figure is the mean over the validation examples, and the table gives
the mean over seeds with its standard error (sample standard deviation / sqrt(seeds)).

The matrices are read by a forward pre-hook on the chosen layer's Smoother (its input and mask) and
X^smooth by the Smoother's own public ``fourier_smooth``: the model's computation is not touched.
Figure 2 is X and X^smooth of one validation example as images.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from longattn.analysis import mu_incoherence
from longattn.attention.smoother import Smoother
from longattn.experiment.config import resolve_config
from longattn.experiment.run import run
from longattn.tasks.base import get_task
from longattn.train.loop import evaluate

__all__ = ["PAPER_TABLE_14", "incoherence_table", "plot_incoherence", "plot_token_matrices",
           "run_incoherence", "smoother_incoherence", "summarise"]

PAPER_RANKS = (16, 32)
PAPER_STEPS = 100
PAPER_TASKS = ("text", "pathfinder")
# "S^3 Attention with (r, s1, s2 = 8)" (Appendix E); r is the Smoother's segment count
PAPER_ATTENTION_OPTIONS = {"s1": 8, "s2": 8, "smoother_segments": 8}
# Table 14: mean (standard error) of mu before / after the Fourier convolution, per rank
PAPER_TABLE_14 = {
    "text": {32: ((2.75, 0.027), (2.05, 0.007)), 16: ((3.98, 0.046), (3.23, 0.038))},
    "pathfinder": {32: ((3.83, 0.221), (1.99, 0.001)), 16: ((4.88, 0.264), (3.48, 0.001))},
}


@contextlib.contextmanager
def _smoother_inputs(model: nn.Module, layer: int) -> Iterator[tuple[Smoother, list[tuple[Tensor, Tensor | None]]]]:
    """The ``layer``-th Smoother of ``model`` and a list that fills with its (input, mask) at every call."""
    smoothers = [m for m in model.modules() if isinstance(m, Smoother) and m.fourier]
    if not smoothers:
        raise ValueError("the model has no Smoother with a Fourier convolution (skeleton attention, smoother on)")
    if not 0 <= layer < len(smoothers):
        raise ValueError(f"layer must be in [0, {len(smoothers) - 1}] (the model's Smoothers), got {layer}")
    captured: list[tuple[Tensor, Tensor | None]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        captured.append((args[0].detach(), None if mask is None else mask.detach()))

    handle = smoothers[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield smoothers[layer], captured
    finally:
        handle.remove()


def _token_matrices(smoother: Smoother, x: Tensor, mask: Tensor | None) -> Iterator[tuple[Tensor, Tensor]]:
    """(X, X^smooth) of every example of a batch, real tokens only, [n_real, dim] each."""
    with torch.no_grad():
        smooth = smoother.fourier_smooth(x, mask)
    for b in range(x.shape[0]):
        real = slice(None) if mask is None else mask[b]
        yield x[b, real], smooth[b, real]


def smoother_incoherence(model: nn.Module, dataset: Any, collate: Any, step_fn: Any, ranks: tuple[int, ...],
                         layer: int = 0, batch_size: int = 32, keep_example: int | None = 0) -> dict[str, Any]:
    """mu of X and X^smooth at each rank for every example of ``dataset`` (an eval pass of ``model``):
    ``{"before": {rank: [...]}, "after": {rank: [...]}, "example": (X, X^smooth) of example keep_example}``.
    Examples with fewer real tokens than a rank are skipped at that rank (mu is undefined there)."""
    result: dict[str, Any] = {"before": {r: [] for r in ranks}, "after": {r: [] for r in ranks}, "example": None}
    seen = 0
    with _smoother_inputs(model, layer) as (smoother, captured):
        evaluate(model, dataset, collate, step_fn, {}, batch_size=batch_size, device=next(model.parameters()).device)
    for x, mask in captured:
        for before, after in _token_matrices(smoother, x, mask):
            if seen == keep_example:
                result["example"] = (before.cpu(), after.cpu())
            seen += 1
            for rank in ranks:
                if rank <= min(before.shape):
                    result["before"][rank].append(mu_incoherence(before, rank))
                    result["after"][rank].append(mu_incoherence(after, rank))
    return result


def _mean_se(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], None
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))


def run_incoherence(tasks: list[str], seeds: list[int], out_dir: str | Path, *, ranks: tuple[int, ...] = PAPER_RANKS,
                    steps: int = PAPER_STEPS, preset: str | None = None, overrides: dict[str, list[str]] | None = None,
                    layer: int = 0, overwrite: bool = False
                    ) -> tuple[list[dict[str, Any]], dict[str, tuple[Tensor, Tensor]]]:
    """Train skeleton attention ``steps`` steps per (task, seed) and measure the incoherence of the
    validation set's token matrices (one row per task, seed and rank), and keep Figure 2's matrices
    (the first validation example of each task's first seed). The measures need the trained models in
    memory, so runs already in ``out_dir`` are trained again only with ``overwrite`` (refused otherwise)."""
    rows: list[dict[str, Any]] = []
    examples: dict[str, tuple[Tensor, Tensor]] = {}
    options = [f"attention_options.skeleton.{k}={v}" for k, v in PAPER_ATTENTION_OPTIONS.items()]
    for task in tasks:
        for seed in seeds:
            config = resolve_config(task, preset, None, [*options, *(overrides or {}).get(task, []),
                                                         f"train.max_steps={steps}", f"train.eval_every={steps}"],
                                    attention="skeleton", seed=seed)
            trained: dict[str, nn.Module] = {}
            cache: dict[Any, Any] = {}
            folder = Path(out_dir) / "runs" / task / f"seed{seed}"
            results = run(config, folder, overwrite=overwrite, data_cache=cache, plots=False,
                          on_step_end=lambda trainer, step: trained.setdefault("model", trainer.model))
            data = next(iter(cache.values()))
            step_fn = get_task(task).step_fn(config, data)
            measured = smoother_incoherence(trained["model"], data.val, data.collate, step_fn, ranks, layer,
                                            config.train.eval_batch_size or config.train.batch_size)
            if seed == seeds[0] and measured["example"] is not None:
                examples[task] = measured["example"]
            for rank in ranks:
                before, after = measured["before"][rank], measured["after"][rank]
                rows.append({"task": task, "seed": seed, "rank": rank, "steps": results["steps"],
                             "examples": len(before), "mu_before": _mean_se(before)[0], "mu_after": _mean_se(after)[0],
                             "mu_before_se_examples": _mean_se(before)[1], "mu_after_se_examples": _mean_se(after)[1],
                             "val_accuracy": (results.get("val") or {}).get("accuracy")})
    return rows, examples


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task and rank: mean and standard error over seeds of each seed's mean mu, before and after."""
    out = []
    for task, rank in dict.fromkeys((r["task"], r["rank"]) for r in rows):
        mine = [r for r in rows if r["task"] == task and r["rank"] == rank and r["mu_before"] is not None]
        before, before_se = _mean_se([r["mu_before"] for r in mine])
        after, after_se = _mean_se([r["mu_after"] for r in mine])
        out.append({"task": task, "rank": rank, "seeds": len(mine), "mu_before": before, "mu_before_se": before_se,
                    "mu_after": after, "mu_after_se": after_se,
                    "reduction": None if not before else 1 - after / before})
    return out


def _cell(mean: float | None, se: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.2f}" + ("" if se is None else f" ({se:.3f})")


def incoherence_table(summary: list[dict[str, Any]]) -> str:
    """Table 14's layout (ranks as columns), our rows beside the paper's."""
    ranks = sorted({s["rank"] for s in summary}, reverse=True)
    header = "| task | seeds | " + " | ".join(f"mu_X (rank {r}) | mu_X^smooth (rank {r}) | reduction" for r in ranks) + " |"
    lines = ["mean over seeds (standard error over seeds) of each run's mean over the validation examples", "",
             header, "|" + "---|" * (2 + 3 * len(ranks))]
    for task in dict.fromkeys(s["task"] for s in summary):
        by_rank = {s["rank"]: s for s in summary if s["task"] == task}
        cells = []
        for r in ranks:
            s = by_rank[r]
            cells += [_cell(s["mu_before"], s["mu_before_se"]), _cell(s["mu_after"], s["mu_after_se"]),
                      "-" if s["reduction"] is None else f"{100 * s['reduction']:.0f}%"]
        lines.append(f"| {task} | {by_rank[ranks[0]]['seeds']} | " + " | ".join(cells) + " |")
        paper = PAPER_TABLE_14.get(task)
        if paper and all(r in paper for r in ranks):
            cells = []
            for r in ranks:
                (b, bse), (a, ase) = paper[r]
                cells += [_cell(b, bse), _cell(a, ase), f"{100 * (1 - a / b):.0f}%"]
            lines.append(f"| {task} (S^3 Table 14) | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_incoherence(summary: list[dict[str, Any]], path: str | Path) -> None:
    """Bars of mu before and after the Fourier convolution per task and rank, with standard-error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{s['task']}\nrank {s['rank']}" for s in summary]
    xs = range(len(summary))
    for offset, key, name in ((-0.2, "mu_before", "X"), (0.2, "mu_after", "X^smooth")):
        ax.bar([x + offset for x in xs], [s[key] or 0 for s in summary], width=0.4, label=f"mu({name})",
               yerr=[s[f"{key}_se"] or 0 for s in summary], capsize=3)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("mu-incoherence")
    ax.set_title("Incoherence before / after the Fourier convolution (S^3 Table 14)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_token_matrices(before: Tensor, after: Tensor, path: str | Path, title: str) -> None:
    """S^3 Figure 2: the token matrix X and X^smooth (tokens along x, features along y) as images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for ax, matrix, name in ((axes[0], before, "X (Smoother input)"), (axes[1], after, "X^smooth (Fourier convolution)")):
        image = ax.imshow(matrix.T.float().numpy(), aspect="auto", cmap="RdBu_r", interpolation="nearest")
        ax.set_title(name)
        ax.set_ylabel("feature")
        fig.colorbar(image, ax=ax)
    axes[1].set_xlabel("token")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
