"""``longattn bench lm``: the causal-LM benchmark (a Llama decoder with each causal mechanism on WikiText-2:
perplexity over seeds, training throughput, decoding cost per token against the prompt length)."""

from __future__ import annotations

import argparse

from longattn.commands._args import (add_data_dir_argument, add_list_argument,
                                    add_resume_argument, add_set_argument, add_workers_argument, preset_help)
from longattn.experiment.analyses import register_analysis


def _run(args: argparse.Namespace) -> int:
    from longattn.bench import lm

    config = lm.LMBenchConfig(
        preset=args.preset, attentions=args.attentions, seeds=args.seeds, data_dir=args.data_dir,
        overrides=list(args.overrides), measure=args.measure, prefixes=args.prefixes,
        decode_tokens=args.decode_tokens, throughput_steps=args.throughput_steps, workers=args.workers,
        device=args.device)
    lm.run_lm_bench(config, args.out, resume=args.resume, overwrite=args.overwrite)
    return 0


def _causal() -> list[str]:
    from longattn import attention

    return [name for name in attention.available() if attention.capabilities(name).causal]


def _arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import lm

    parser.add_argument("--preset", default="cpu", help=preset_help(["lm"]))
    add_list_argument(parser, "--attentions", "--attention", dest="attentions", names=_causal, kind="causal mechanism",
                      default=list(lm.DEFAULT_ATTENTIONS),
                      help="causal mechanisms; softmax is the reference of the paired differences")
    add_list_argument(parser, "--seeds", item=int, kind="seed", default=[0, 1, 2], help="training seeds")
    add_data_dir_argument(parser, "the WikiText-2 folder (wiki.*.tokens), e.g. ../shared/data/wikitext2")
    add_set_argument(parser, help="override config values of every run, e.g. --set train.max_steps=100 (repeatable)")
    add_list_argument(parser, "--measure", kind="measurement", names=lambda: list(lm.MEASUREMENTS),
                      default=list(lm.MEASUREMENTS), help="what to measure")
    add_list_argument(parser, "--prefixes", item="length", kind="N", default=list(lm.DEFAULT_PREFIXES),
                      help="prompt lengths of the decoding measurement (k suffix: 1k = 1024)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="timed tokens per prompt length")
    parser.add_argument("--throughput-steps", type=int, default=3, help="timed training steps per mechanism")
    parser.add_argument("--device", default="cpu",
                        help="device of the throughput and decoding measurements: cpu (one thread, process CPU "
                             "time) or cuda (the training runs use the preset's train.device)")
    add_workers_argument(parser)
    add_resume_argument(parser, help="reuse finished runs and measurements in --out, resume interrupted runs")
    parser.add_argument("--out", default="runs/bench-lm", help="output folder")


register_analysis("lm", "causal-LM benchmark: perplexity, training throughput and decoding cost per token of a Llama "
                  "decoder with each causal mechanism on WikiText-2", _arguments, _run)
