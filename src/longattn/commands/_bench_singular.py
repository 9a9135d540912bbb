"""Singularformer's analyses as ``longattn bench`` subcommands: ``thresholds`` (Table 3), ``accuracy-cost``
(Figure 6), ``rank-sweep`` (Figure 7), ``attention-correlation`` (Figures 8-10)."""

from __future__ import annotations

import argparse
from pathlib import Path

from longattn.bench import thresholds
from longattn.bench.speed import SpeedConfig
from longattn.commands.bench import _int_list, _write
from longattn.experiment.analyses import register_analysis

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
    model, heads, head_dim = _paper_model(args.layers, args.hidden)
    base = SpeedConfig(target="", length=0, batch=args.batch, heads=args.heads or heads,
                       head_dim=args.head_dim or head_dim,
                       threads=args.threads, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                       kind="classifier", model=model, inference_only=True)
    report = thresholds.sweep_thresholds(args.attention, base, _int_list(args.grid), resolution=args.resolution,
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
    parser.add_argument("--attention", nargs="+", default=list(LINEAR_MODELS),
                        help=f"linear models compared with Post-LN softmax (default: {' '.join(LINEAR_MODELS)})")
    parser.add_argument("--grid", default=",".join(map(str, thresholds.DEFAULT_GRID)),
                        help="comma list of lengths where every model is measured before bisecting (k suffix allowed)")
    parser.add_argument("--resolution", type=int, default=thresholds.DEFAULT_RESOLUTION,
                        help="bisect until the bracket is this many tokens wide")
    parser.add_argument("--baseline", default=thresholds.DEFAULT_BASELINE, choices=thresholds.BASELINES,
                        help="Post-LN attention: softmax_math holds the n x n scores (the paper's Transformer), "
                             "softmax is SDPA's fused kernel")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None, help="(default: Table 2's, 6)")
    parser.add_argument("--hidden", type=int, default=None, help="(default: Table 2's, 384)")
    parser.add_argument("--heads", type=int, default=None, help="(default: Table 2's, 6)")
    parser.add_argument("--head-dim", type=int, default=None, help="(default: Table 2's, 384 / 6)")
    parser.add_argument("--threads", type=int, default=SpeedConfig.threads)
    parser.add_argument("--warmup", type=int, default=SpeedConfig.warmup)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=SpeedConfig.seed)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per length's process")
    parser.add_argument("--out", default="runs/bench-thresholds")


register_analysis("thresholds", "lengths from which linear models beat Post-LN in memory and inference speed "
                  "(Singularformer Table 3)", _thresholds_arguments, _thresholds)


def _correlation(args: argparse.Namespace) -> int:
    from longattn.experiment.attention_correlation import run_attention_correlation

    pair = tuple(args.image_pair.split(","))
    if len(pair) != 2:
        raise ValueError(f"--image-pair takes two model names, got {args.image_pair!r}")
    run_attention_correlation(args.runs, args.tasks.split(","), args.out, models=args.models.split(","), fold=args.fold,
                              split=args.split, batch_size=args.batch_size, max_examples=args.max_examples,
                              image_pair=pair)
    print(f"wrote {args.out}/attention_correlation.{{json,md}} and the figures")
    return 0


def _correlation_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment.attention_correlation import MAP_MODELS

    parser.add_argument("--runs", required=True, help="output folder of longattn crossval (<runs>/<task>/<model>/fold<k>)")
    parser.add_argument("--tasks", required=True, help="comma list of tasks, e.g. r8 or r8,cifar10")
    parser.add_argument("--models", default=",".join(MAP_MODELS), help="models whose maps are compared")
    parser.add_argument("--fold", type=int, default=0, help="the fold whose best checkpoints are compared")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-examples", type=int, default=None, help="the first N examples of the split (default: all)")
    parser.add_argument("--image-pair", default="post_ln,singularformer", help="the two models of Figure 10 (image tasks)")
    parser.add_argument("--out", default="runs/attention-correlation")


register_analysis("attention-correlation", "row-wise Pearson correlation of trained models' attention maps "
                  "(Singularformer Figures 8-10)", _correlation_arguments, _correlation)


def _accuracy_cost(args: argparse.Namespace) -> int:
    from longattn.experiment.singular_figures import run_accuracy_cost

    run_accuracy_cost(args.runs, args.out, datasets=args.tasks.split(",") if args.tasks else None,
                      models=args.models.split(",") if args.models else None, batch=args.batch, repeats=args.repeats,
                      timeout_s=args.timeout)
    print(f"wrote {args.out}/figure6.{{json,md,png}}")
    return 0


def _accuracy_cost_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", required=True, help="output folder of longattn crossval (its results.json and fold 0's configs)")
    parser.add_argument("--tasks", default=None, help="comma list of datasets (default: all in results.json)")
    parser.add_argument("--models", default=None, help="comma list of models (default: all in results.json)")
    parser.add_argument("--batch", type=int, default=16, help="examples per inference call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model's process")
    parser.add_argument("--out", default="runs/accuracy-cost")


def _rank_sweep(args: argparse.Namespace) -> int:
    from longattn.experiment.singular_figures import run_rank_sweep

    report = run_rank_sweep(args.task, _int_list(args.ranks), args.out, data_dir=args.data_dir, preset=args.preset,
                            overrides=args.overrides, folds=args.folds,
                            only_folds=_int_list(args.only_folds) if args.only_folds else None, seed=args.seed,
                            resume=args.resume)
    print(f"wrote {args.out}/figure7.{{json,md,png}}")
    return 1 if any(row["errors"] for row in report["rows"]) else 0


def _rank_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="r8")
    parser.add_argument("--ranks", default="4,8,16,32,64,128", help="comma list of r")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value (repeatable)")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--only-folds", default=None, help="comma list of folds to run (the reduced protocol: 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", default="runs/rank-sweep")


register_analysis("accuracy-cost", "accuracy against inference speed, memory as circle size (Singularformer "
                  "Figure 6)", _accuracy_cost_arguments, _accuracy_cost)
register_analysis("rank-sweep", "Singularformer's accuracy against r (its Figure 7)", _rank_sweep_arguments, _rank_sweep)
