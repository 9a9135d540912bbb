"""Command-line pieces shared by the commands: the config flags and registry-backed choices."""

from __future__ import annotations

import argparse
from typing import Any

from longattn import attention
from longattn.config import ConfigError
from longattn.tasks.base import task_names

__all__ = ["add_config_arguments", "add_run_arguments", "add_workers_argument", "attention_list", "int_list",
           "seed_list"]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config / --preset / --set: the layers of a run config (see longattn.experiment.config)."""
    parser.add_argument("--config", help="YAML config file (applied after the preset)")
    parser.add_argument("--preset", help="preset of the task, e.g. demo or standard (configs/lra/<task>/<preset>.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, e.g. --set optim.lr=3e-4 (repeatable)")


def add_run_arguments(parser: argparse.ArgumentParser, *, task_required: bool = True) -> None:
    """--task / --model / --attention with their choices taken from the registries."""
    parser.add_argument("--task", required=task_required, choices=task_names(), metavar="TASK",
                        help=f"registered task: {', '.join(task_names())}")
    parser.add_argument("--model", dest="model_name", metavar="MODEL",
                        help="registered model of the task's family (default: the task's)")
    parser.add_argument("--attention", choices=attention.available(), metavar="ATTENTION",
                        help=f"registered mechanism (default: the config's, else the model's): "
                        f"{', '.join(attention.available())}")


def add_workers_argument(parser: argparse.ArgumentParser) -> None:
    """--workers: how many of a grid's runs train at once (longattn.experiment.workers)."""
    parser.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                        help="train N runs at once, each in its own process with an even share of the threads "
                        "(OMP_NUM_THREADS, else torch's default); each run's output goes to log.txt in its "
                        "folder (default 1: one run at a time, output here)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def attention_list(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [n for n in names if n not in attention.available()]
    if unknown:
        raise ConfigError(f"unknown attention(s) {unknown}; valid: {', '.join(attention.available())}")
    return names


def int_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None


seed_list = int_list


def no_progress(args: Any) -> list[str]:
    return list(args.overrides) + (["train.progress=false"] if getattr(args, "no_progress", False) else [])
