"""``longattn train`` and ``longattn eval``: one run of any registered task, and re-evaluating its checkpoints."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from longattn.commands import VERB_HELP
from longattn.commands._args import (add_config_arguments, add_data_dir_argument, add_no_progress_argument,
                                    add_resume_argument, add_renamed_argument, add_run_arguments, no_progress)
from longattn.config import merge, parse_set

# torch and the experiment modules are imported by the functions that run a command, not here: `longattn eval
# --help` answers without them (`longattn train --help` lists the registered tasks and mechanisms, which loads
# them).


def _train(args: argparse.Namespace) -> int:
    import torch

    from longattn.experiment.config import resolve_config
    from longattn.experiment.run import run
    from longattn.experiment.threads import plan_threads
    from longattn.tasks.base import get_task
    from longattn.tasks.forecasting import find_preset

    preset = args.preset
    if args.task == "forecasting" and args.dataset and preset is None and args.config is None:
        preset = find_preset(args.dataset)  # the dataset's shipped config (configs/forecast/<dataset>.yaml)
    data = {"dataset": args.dataset, "data_dir": args.data_dir, "pred_len": args.pred_len}
    config = resolve_config(args.task, preset, args.config, no_progress(args), attention=args.attention,
                            model_name=args.model_name, seed=args.seed, data=data, train={"device": args.device})
    threads_before = torch.get_num_threads()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # torchrun's ranks share the machine as it set them up
        plan = plan_threads(1, grid=False)  # a single run: every core it is given (OMP_NUM_THREADS: its budget)
        torch.set_num_threads(plan.threads)
        print(plan.describe(), flush=True)  # the run's log (stdout) opens with it; stderr keeps errors alone
    try:
        results = run(config, args.out, resume=args.resume, overwrite=args.overwrite, log=print,
                      plots=not args.no_plot)
    finally:  # a caller's own thread setting is back once the run is done
        torch.set_num_threads(threads_before)
    if results.get("world_size", 1) == 1 or os.environ.get("RANK", "0") == "0":
        print(json.dumps(get_task(config.task).summary(results), indent=2, default=str))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from longattn.experiment.results import write_results
    from longattn.experiment.run import evaluate_run

    options: dict = {}
    for text in args.data_option:
        options = merge(options, parse_set(text))
    result = evaluate_run(args.run, split=args.split, checkpoint=args.checkpoint, data_options=options)
    suffix = "".join(f"_{k}={v}" for k, v in options.items())
    write_results(Path(args.run) / f"eval_{args.split}_{Path(args.checkpoint).stem}{suffix}.json", result)
    print(json.dumps(result, indent=2))
    return 0


def _series() -> list[str]:
    from longattn.data.timeseries import SERIES

    return list(SERIES)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help=VERB_HELP["train"],
        description="Train one model on one registered task. Writes config.yaml, metrics.jsonl, checkpoints/ and "
        "results.json to --out. Config layers: the task's defaults, --preset, --config, --set, then the flags "
        "below. Run under torchrun for DDP. Forecasting: --task forecasting --dataset ETTm2 --model skt "
        "--pred-len 96 --data-dir DIR.")
    add_run_arguments(p)
    add_config_arguments(p)
    add_data_dir_argument(p, help="the task's data folder (same as --set data.data_dir=DIR; generated tasks need "
                          "none)")
    p.add_argument("--seed", type=int, help="seed of the weights and the data order (default: the config's, 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the config's)")
    p.add_argument("--dataset", help=lambda: f"forecasting: {', '.join(_series())} or a path to a CSV with a date column "
                   "(its shipped config is the preset unless --preset or --config is given)")
    p.add_argument("--pred-len", type=int, help="forecasting: the horizon, in time steps")
    p.add_argument("--out", required=True, help="output folder")
    add_resume_argument(p, help="continue exactly from --out/checkpoints/last.pt (a fresh run if there is none)")
    add_no_progress_argument(p)
    p.add_argument("--no-plot", action="store_true", help="no plots of the run (e.g. forecasting's forecast.png)")
    p.set_defaults(func=_train)

    e = subparsers.add_parser("eval", help=VERB_HELP["eval"],
                              description="Re-evaluate the best (or last, or any) checkpoint of a `longattn train` "
                              "run, in eval mode, on every example of the split; writes "
                              "eval_<split>_<checkpoint>.json into the run's folder.")
    add_renamed_argument(e, "--run", "--out", required=True, metavar="DIR",
                         help="the --out folder of a training run (read)")
    e.add_argument("--split", default="test", choices=("train", "val", "test"), help="the split evaluated")
    e.add_argument("--checkpoint", default="best", help="best, last, or a checkpoint path")
    e.add_argument("--data-option", action="append", default=[], metavar="KEY=VALUE",
                   help="dataset option for this evaluation, e.g. noise_amplitude=4 (repeatable)")
    e.set_defaults(func=_eval)
