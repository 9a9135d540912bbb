"""Singularformer's analyses as ``longattn paper`` entries: ``singularformer-table3`` (thresholds),
``singularformer-fig6`` (accuracy against cost), ``singularformer-fig7`` (rank sweep), ``singularformer-fig8``
(attention-map correlation, Figures 8-10)."""

from __future__ import annotations

import argparse
from pathlib import Path

from longattn.commands._args import (add_attentions_argument, add_data_dir_argument, add_set_argument, preset_help,
                                    add_list_argument, add_renamed_argument, add_resume_argument,
                                    name_type, task_names)
from longattn.commands.bench import _write
from longattn.experiment.analyses import register_paper

LINEAR_MODELS = ("bigbird", "linformer", "flash", "singular")
# The vocabulary only sizes the embedding table, which the memory figures leave out (peak above resident).
VOCABULARY, CLASSES = 10_000, 8


def _paper_model(layers: int | None, hidden: int | None) -> tuple[dict, int, int]:
    """Singularformer's Figure 5 classifier with Table 2's sizes, taken from the registered Post-LN model's
    defaults (longattn.models.doc_classifier): (build_classifier keywords, heads, head dim)."""
    import longattn.models.doc_classifier  # noqa: F401  (registers the Table 4 models)
    from longattn.models.registry import model_defaults

    paper = model_defaults("post_ln")
    model = {"vocab_size": VOCABULARY, "num_classes": CLASSES, "layers": layers or paper["layers"],
             "hidden": hidden or paper["hidden"], "norm": paper["norm"], "pooling": "maxmean", "head": "singular",
             "dropout": paper["dropout"], "embedding_dropout": paper["embedding_dropout"]}
    return model, paper["heads"], paper["dim"] // paper["heads"]


def _thresholds(args: argparse.Namespace) -> int:
    from longattn.bench import thresholds
    from longattn.bench.speed import SpeedConfig

    model, heads, head_dim = _paper_model(args.layers, args.hidden)
    base = SpeedConfig(target="", length=0, batch=args.batch, heads=args.heads or heads,
                       head_dim=args.head_dim or head_dim,
                       threads=args.threads, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                       kind="classifier", model=model, inference_only=True)
    report = thresholds.sweep_thresholds(args.attentions, base, args.grid, resolution=args.resolution,
                                         timeout_s=args.timeout, baseline=args.baseline,
                                         progress=lambda text: print(f"measuring {text}", flush=True))
    table = (f"Thresholds against the Post-LN Transformer (attention: {args.baseline}; inference, batch {args.batch}; "
             f"times: median process CPU time, {args.threads} thread(s), measured side by side):\n\n" + thresholds.thresholds_table(report)
             + "\n\nEvery measured point:\n\n" + thresholds.points_table(report))
    out = Path(args.out)
    _write(out, "thresholds", report["points"], table, {k: v for k, v in report.items() if k != "points"})
    thresholds.plot_thresholds(report, out / "thresholds.png")
    print(f"wrote {out / 'thresholds.png'}")
    return 0


def _thresholds_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import thresholds
    from longattn.bench.speed import SpeedConfig

    add_attentions_argument(parser, default=list(LINEAR_MODELS), help="linear models compared with Post-LN softmax")
    add_list_argument(parser, "--grid", item="length", kind="N", default=list(thresholds.DEFAULT_GRID),
                      help="lengths where every model is measured before bisecting (k suffix allowed)")
    parser.add_argument("--resolution", type=int, default=thresholds.DEFAULT_RESOLUTION,
                        help="bisect until the bracket is this many tokens wide")
    parser.add_argument("--baseline", default=thresholds.DEFAULT_BASELINE, choices=thresholds.BASELINES,
                        help="Post-LN attention: softmax_math holds the n x n scores (the paper's Transformer), "
                             "softmax is SDPA's fused kernel")
    parser.add_argument("--batch", type=int, default=4, help="sequences per inference call")
    parser.add_argument("--layers", type=int, default=None, help="encoder layers (default: Table 2's, 6)")
    parser.add_argument("--hidden", type=int, default=None, help="model width (default: Table 2's, 384)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: Table 2's, 6)")
    parser.add_argument("--head-dim", type=int, default=None, help="width of one head (default: Table 2's, 384 / 6)")
    parser.add_argument("--threads", type=int, default=SpeedConfig.threads, help="torch threads")
    parser.add_argument("--warmup", type=int, default=SpeedConfig.warmup, help="untimed calls first")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (the median is kept)")
    parser.add_argument("--seed", type=int, default=SpeedConfig.seed, help="seed of the weights and inputs")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per length's process")
    parser.add_argument("--out", default="runs/bench-thresholds", help="output folder")


register_paper("singularformer-table3", "Singularformer", "Table 3", "lengths from which linear models beat Post-LN "
               "in memory and inference speed", _thresholds_arguments, _thresholds)


def _correlation(args: argparse.Namespace) -> int:
    from longattn.experiment.attention_correlation import run_attention_correlation

    pair = tuple(args.image_pair)
    if len(pair) != 2:
        raise ValueError(f"--image-pair takes two model names, got {' '.join(args.image_pair)!r}")
    run_attention_correlation(args.run, args.tasks, args.out, models=args.models, fold=args.fold,
                              split=args.split, batch_size=args.batch_size, max_examples=args.max_examples,
                              image_pair=pair)
    print(f"wrote {args.out}/attention_correlation.{{json,md}} and the figures")
    return 0


def _correlation_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment.attention_correlation import MAP_MODELS

    _crossval_run(parser, "<run>/<task>/<model>/fold<k>")
    add_list_argument(parser, "--tasks", required=True, names=task_names, kind="task", help="tasks, e.g. r8 cifar10")
    add_list_argument(parser, "--models", names=_classifiers, kind="model", default=list(MAP_MODELS),
                      help="models whose maps are compared")
    parser.add_argument("--fold", type=int, default=0, help="the fold whose best checkpoints are compared")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"], help="the split read")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per forward pass")
    parser.add_argument("--max-examples", type=int, default=None, help="the first N examples of the split (default: all)")
    add_list_argument(parser, "--image-pair", names=_classifiers, kind="model", default=["post_ln", "singularformer"],
                      help="the two models of Figure 10 (image tasks)")
    parser.add_argument("--out", default="runs/attention-correlation", help="output folder")


def _classifiers() -> list[str]:
    from longattn.models.registry import model_names

    return model_names("classifier")


def _crossval_run(parser: argparse.ArgumentParser, layout: str) -> None:
    add_renamed_argument(parser, "--run", "--runs", required=True, metavar="DIR",
                         help=f"output folder of `longattn paper singularformer-table4` ({layout}; read)")


register_paper("singularformer-fig8", "Singularformer", "Figures 8-10", "row-wise Pearson correlation of trained "
               "models' attention maps", _correlation_arguments, _correlation)


def _accuracy_cost(args: argparse.Namespace) -> int:
    from longattn.experiment.singular_figures import run_accuracy_cost

    run_accuracy_cost(args.run, args.out, datasets=args.tasks, models=args.models, batch=args.batch,
                      repeats=args.repeats,
                      timeout_s=args.timeout)
    print(f"wrote {args.out}/figure6.{{json,md,png}}")
    return 0


def _accuracy_cost_arguments(parser: argparse.ArgumentParser) -> None:
    _crossval_run(parser, "its results.json and fold 0's configs")
    add_list_argument(parser, "--tasks", names=task_names, kind="task", help="datasets (default: all in results.json)")
    add_list_argument(parser, "--models", names=_classifiers, kind="model", help="models (default: all in results.json)")
    parser.add_argument("--batch", type=int, default=16, help="examples per inference call")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (the median is kept)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model's process")
    parser.add_argument("--out", default="runs/accuracy-cost", help="output folder")


def _rank_sweep(args: argparse.Namespace) -> int:
    from longattn.experiment.singular_figures import run_rank_sweep

    report = run_rank_sweep(args.task, args.ranks, args.out, data_dir=args.data_dir, preset=args.preset,
                            overrides=args.overrides, folds=args.folds, only_folds=args.only_folds, seed=args.seed,
                            resume=args.resume, overwrite=args.overwrite)
    print(f"wrote {args.out}/figure7.{{json,md,png}}")
    return 1 if any(row["errors"] for row in report["rows"]) else 0


def _rank_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="r8", type=name_type("task", task_names), metavar="TASK",
                        help="document classification dataset")
    add_list_argument(parser, "--ranks", item=int, kind="r", default=[4, 8, 16, 32, 64, 128],
                      help="ranks r of Singularformer")
    add_data_dir_argument(parser, help="the dataset's folder (same as --set data.data_dir=DIR)")
    parser.add_argument("--preset", default="cpu", help=preset_help(["r8"]))
    add_set_argument(parser)
    parser.add_argument("--folds", type=int, default=5, help="number of folds")
    add_list_argument(parser, "--only-folds", item=int, kind="fold", help="folds to run (the reduced protocol: 0; "
                      "default: all)")
    parser.add_argument("--seed", type=int, default=0, help="training seed of every fold")
    add_resume_argument(parser)
    parser.add_argument("--out", default="runs/rank-sweep", help="output folder")


register_paper("singularformer-fig6", "Singularformer", "Figure 6", "accuracy against inference speed, memory as "
               "circle size, of the models of a finished Table 4", _accuracy_cost_arguments, _accuracy_cost)
register_paper("singularformer-fig7", "Singularformer", "Figure 7", "accuracy against the rank r",
               _rank_sweep_arguments, _rank_sweep)
