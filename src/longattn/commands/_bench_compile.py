"""``longattn bench compile``: every Triton kernel the library launches compiled ahead of time for real GPUs
(sm_80, sm_90, ...) on this machine, no GPU needed; per kernel configuration the status, shared memory against
the target's limit, registers, spills and compile time (longattn.bench.aot)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from longattn.commands._args import add_attentions_argument, add_list_argument
from longattn.commands.bench import _write
from longattn.experiment.analyses import register_analysis


def _run(args: argparse.Namespace) -> int:
    from longattn.bench.aot import AotConfig, aot_table, run_aot

    given = {f.name: getattr(args, f.name) for f in fields(AotConfig) if getattr(args, f.name, None) is not None}
    config = AotConfig.suite(**given) if args.quick else AotConfig(**given)
    report = run_aot(config)
    table = aot_table(report)
    _write(Path(args.out), "aot", report.pop("rows"), table, report)
    return 0 if report["failures"] == 0 and report["hazards"] == 0 and not report["outside_device_guard"] else 1


def _arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench.aot import DTYPES, AotConfig

    defaults = AotConfig()
    add_list_argument(parser, "--archs", item=int, kind="arch",
                      help=f"compute capabilities to compile for (default: {' '.join(map(str, defaults.archs))})")
    add_attentions_argument(parser, help="mechanisms (default: all registered)")
    add_list_argument(parser, "--dtypes", names=lambda: list(DTYPES), kind="dtype",
                      help=f"dtypes (default: {' '.join(defaults.dtypes)})")
    add_list_argument(parser, "--head-dims", item=int, kind="head dim",
                      help=f"head dims (default: {' '.join(map(str, defaults.head_dims))})")
    add_list_argument(parser, "--lengths", item="length", kind="length",
                      help=f"sequence lengths (default: {' '.join(map(str, defaults.lengths))})")
    parser.add_argument("--timeout-s", type=float, help=f"seconds one compile may take (default: {defaults.timeout_s:.0f})")
    parser.add_argument("--quick", action="store_true", help="the test suite's check: bf16, head dim 64, one "
                        "configuration per kernel")
    parser.add_argument("--out", default="runs/bench-compile", help="folder written: aot.json, aot.md")


register_analysis("compile", "the Triton kernels compiled ahead of time for real GPUs (no GPU needed): compile "
                  "errors, shared memory against the limit, registers, spills, compile times", _arguments, _run)
