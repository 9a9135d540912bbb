"""``longattn bench gpu``: the device check (accuracy, speed against softmax and the floor, training, the
Hugging Face bridge, the MQAR sweep's cost) in one process; ``--device cpu --smoke`` runs the same code on a CPU in seconds."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from longattn.commands._args import add_attentions_argument, add_list_argument, attention_names, name_type
from longattn.commands.bench import _write
from longattn.experiment.analyses import register_analysis

_PARTS = ("compile", "accuracy", "speed", "train", "hf", "recall")


def _save(out: Path, report: dict) -> None:
    """gpu.json and gpu.md as they stand (after every row: a run cut short keeps what it measured)."""
    from longattn.bench.gpu import gpu_tables
    from longattn.experiment.results import write_results

    out.mkdir(parents=True, exist_ok=True)
    write_results(out / "gpu.json", {"rows": [], **report})
    (out / "gpu.md").write_text(gpu_tables(report) + "\n")


def _run(args: argparse.Namespace) -> int:
    from longattn.bench.gpu import GpuCheckConfig, gpu_tables, run_gpu_check

    out = Path(args.out)
    if args.resume and args.overwrite:
        raise ValueError("--resume keeps the rows of --out's gpu.json, --overwrite measures them again: pass one")
    if (out / "gpu.json").exists() and not (args.overwrite or args.resume):
        raise ValueError(f"--out {out} already holds gpu.json: pass --overwrite to measure again into it, or "
                         "--resume to measure only the rows it lacks")
    earlier = json.loads((out / "gpu.json").read_text()) if args.resume and (out / "gpu.json").exists() else None
    if args.overwrite and (out / "train").is_dir():
        shutil.rmtree(out / "train")  # the training part's own run folder, rewritten
    given = {"device": args.device, "attentions": args.attentions, "parts": args.parts, "lengths": args.lengths,
             "tokens": args.tokens, "dim": args.dim, "heads": args.heads, "train_attention": args.train_attention,
             "train_steps": args.train_steps, "hf_attentions": args.hf_attentions, "budget_s": args.budget_s,
             "seed": args.seed, "row_timeout_s": args.row_timeout_s}
    given = {k: v for k, v in given.items() if v is not None}
    config = GpuCheckConfig.smoke(**given) if args.smoke else GpuCheckConfig(**given)
    report = run_gpu_check(config, out, save=lambda partial: _save(out, partial), earlier=earlier)
    _write(out, "gpu", [], gpu_tables(report), report)
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench.gpu import GpuCheckConfig

    defaults = GpuCheckConfig()
    parser.add_argument("--device", default=defaults.device, help="cuda, cuda:1, ... or cpu (with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: every part in seconds (a CPU check)")
    add_list_argument(parser, "--parts", names=lambda: _PARTS, kind="part",
                      help=f"parts to run (default: all, {' '.join(_PARTS)})")
    add_attentions_argument(parser, help="mechanisms (default: all registered)")
    add_list_argument(parser, "--lengths", item="length", kind="length",
                      help="sequence lengths of the speed part, k/m suffixes (default: 1k 4k 16k 64k)")
    parser.add_argument("--tokens", type=int, help=f"tokens per call of the speed part (default: {defaults.tokens})")
    parser.add_argument("--dim", type=int, help=f"model width of the speed part (default: {defaults.dim})")
    parser.add_argument("--heads", type=int, help=f"heads of the speed part (default: {defaults.heads})")
    parser.add_argument("--train-attention", type=name_type("mechanism", attention_names),
                        help=f"mechanism of the training part (default: {defaults.train_attention})")
    parser.add_argument("--train-steps", type=int, help=f"steps of the training part (default: {defaults.train_steps})")
    add_list_argument(parser, "--hf-attentions", names=attention_names, kind="mechanism",
                      help=f"mechanisms of the Hugging Face part (default: {' '.join(defaults.hf_attentions)})")
    parser.add_argument("--budget-s", type=float, help="seconds for the whole run; rows past a part's share are "
                        f"skipped and say so (default: {defaults.budget_s:.0f})")
    parser.add_argument("--seed", type=int, help=f"seed of weights and inputs (default: {defaults.seed})")
    parser.add_argument("--row-timeout-s", type=float, help="seconds one accuracy or speed row may run before it is "
                        f"recorded as timed out (default: {defaults.row_timeout_s:.0f})")
    parser.add_argument("--out", default="runs/bench-gpu", help="folder written: gpu.json, gpu.md, train/")
    parser.add_argument("--overwrite", action="store_true", help="measure again into an --out that holds results")
    parser.add_argument("--resume", action="store_true", help="keep the measured rows of --out's gpu.json and "
                        "measure only the others (those skipped for time, or new)")


register_analysis("gpu", "the GPU device check: accuracy under fp32/bf16/fp16, speed against softmax and the floor, "
                  "training, the Hugging Face bridge (one process, minutes)", _arguments, _run)
