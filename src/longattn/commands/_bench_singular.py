"""Singularformer's analyses as ``longattn bench`` subcommands: ``thresholds`` (Table 3),
``attention-correlation`` (Figures 8-10)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from longattn.bench import thresholds
from longattn.bench.speed import SpeedConfig
from longattn.commands.bench import _int_list, _write
from longattn.experiment.analyses import register_analysis

LINEAR_MODELS = ("bigbird", "linformer", "flash", "singular")
# Singularformer's Figure 5 classifier with Table 2's sizes: 6 layers of width 384 in 6 heads, hidden
# size 384, max + mean pooling into two dense layers, Post-LN blocks (the baseline of Table 3). The
# vocabulary only sizes the embedding table, which the memory figures leave out (peak above resident).
PAPER_MODEL = {"vocab_size": 10_000, "num_classes": 8, "layers": 6, "hidden": 384, "norm": "post",
               "pooling": "maxmean", "head": "singular", "dropout": 0.1, "embedding_dropout": 0.2}
PAPER_HEADS, PAPER_HEAD_DIM = 6, 64


def _thresholds(args: argparse.Namespace) -> int:
    model = dict(PAPER_MODEL, layers=args.layers, hidden=args.hidden)
    base = SpeedConfig(target="", length=0, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
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
    parser.add_argument("--layers", type=int, default=PAPER_MODEL["layers"])
    parser.add_argument("--hidden", type=int, default=PAPER_MODEL["hidden"])
    parser.add_argument("--heads", type=int, default=PAPER_HEADS)
    parser.add_argument("--head-dim", type=int, default=PAPER_HEAD_DIM)
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
