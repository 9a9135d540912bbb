"""``longattn bench gpu``: the device check (accuracy, speed against softmax and the floor, training, the
Hugging Face bridge) in one process; ``--device cpu --smoke`` runs the same code on a CPU in seconds."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from longattn.bench.gpu import GpuCheckConfig, gpu_tables, run_gpu_check
from longattn.commands.bench import _write
from longattn.experiment.analyses import register_analysis

_DEFAULTS = GpuCheckConfig()
_PARTS = ("accuracy", "speed", "train", "hf")


def _words(values: list[str] | None) -> list[str]:
    """A list option: space-separated, commas accepted too."""
    return [w for value in values or [] for w in value.split(",") if w]


def _lengths(values: list[str] | None) -> list[int]:
    units = {"k": 1024, "m": 1024 * 1024}
    out = []
    for word in _words(values):
        word = word.lower()
        try:
            out.append(int(word[:-1]) * units[word[-1]] if word[-1] in units else int(word))
        except (ValueError, KeyError):
            raise ValueError(f"--lengths takes whole numbers with optional k/m suffixes, got {word!r}") from None
    return out


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out / "gpu.json").exists() and not args.overwrite:
        raise ValueError(f"--out {out} already holds gpu.json: pass --overwrite to measure again into it")
    if args.overwrite and (out / "train").is_dir():
        shutil.rmtree(out / "train")  # the training part's own run folder, rewritten
    given = {"device": args.device, "attentions": _words(args.attentions), "parts": _words(args.parts) or None,
             "lengths": _lengths(args.lengths) or None, "tokens": args.tokens, "dim": args.dim, "heads": args.heads,
             "train_attention": args.train_attention, "train_steps": args.train_steps,
             "hf_attentions": _words(args.hf_attentions) or None, "budget_s": args.budget_s, "seed": args.seed}
    given = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(given.get("parts", [])) - set(_PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; choose from {' '.join(_PARTS)}")
    config = GpuCheckConfig.smoke(**given) if args.smoke else GpuCheckConfig(**given)
    report = run_gpu_check(config, out)
    _write(out, "gpu", [], gpu_tables(report), report)
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=_DEFAULTS.device, help="cuda (default), cuda:1, ... or cpu (with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the whole command in seconds (a CPU check)")
    parser.add_argument("--parts", nargs="+", metavar="PART", help=f"parts to run (default all: {' '.join(_PARTS)})")
    parser.add_argument("--attentions", nargs="+", metavar="NAME", help="mechanisms (default: all registered)")
    parser.add_argument("--lengths", nargs="+", metavar="N",
                        help="speed part's sequence lengths, k/m suffixes (default 1k 4k 16k 64k)")
    parser.add_argument("--tokens", type=int, default=None, help=f"tokens per call (default {_DEFAULTS.tokens:,})")
    parser.add_argument("--dim", type=int, default=None, help=f"model width of the speed part (default {_DEFAULTS.dim})")
    parser.add_argument("--heads", type=int, default=None, help=f"heads of the speed part (default {_DEFAULTS.heads})")
    parser.add_argument("--train-attention", default=None,
                        help=f"mechanism of the training part (default {_DEFAULTS.train_attention})")
    parser.add_argument("--train-steps", type=int, default=None, help=f"(default {_DEFAULTS.train_steps})")
    parser.add_argument("--hf-attentions", nargs="+", metavar="NAME",
                        help=f"mechanisms of the Hugging Face part (default {' '.join(_DEFAULTS.hf_attentions)})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole run; rows past a part's share are skipped and say so "
                             f"(default {_DEFAULTS.budget_s:.0f})")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="runs/bench-gpu", help="folder written: gpu.json, gpu.md, train/")
    parser.add_argument("--overwrite", action="store_true", help="measure again into an --out that has results")


register_analysis("gpu", "the GPU device check: accuracy under fp32/bf16/fp16, speed against softmax and the floor, "
                  "training, the Hugging Face bridge (one process, minutes)", _arguments, _run)
