"""``longattn bench lm``: the causal-LM benchmark (a Llama decoder with each causal mechanism on WikiText-2:
perplexity over seeds, training throughput, decoding cost per token against the prompt length)."""

from __future__ import annotations

import argparse

from longattn.bench import lm
from longattn.experiment.analyses import register_analysis


def _names(values: list[str]) -> list[str]:
    """Space- or comma-separated values."""
    return [part for value in values for part in value.split(",") if part]


def _length(text: str) -> int:
    units = {"k": 1024, "m": 1024 * 1024}
    text = text.strip().lower()
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)


def _run(args: argparse.Namespace) -> int:
    from longattn import attention

    names = _names(args.attentions)
    unknown = sorted(set(names) - set(attention.available()))
    if unknown:
        raise ValueError(f"unknown attention(s) {unknown}; causal ones: "
                         f"{', '.join(n for n in attention.available() if attention.capabilities(n).causal)}")
    config = lm.LMBenchConfig(
        preset=args.preset, attentions=names, seeds=[int(s) for s in _names(args.seeds)], data_dir=args.data_dir,
        overrides=list(args.overrides), measure=_names(args.measure),
        prefixes=[_length(p) for p in _names(args.prefixes)], decode_tokens=args.decode_tokens,
        throughput_steps=args.throughput_steps, workers=args.workers, device=args.device)
    lm.run_lm_bench(config, args.out, resume=args.resume)
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="cpu", help="configs/lm/<preset>.yaml: cpu (this machine) or paper (a GPU)")
    parser.add_argument("--attentions", "--attention", nargs="+", default=list(lm.DEFAULT_ATTENTIONS), metavar="NAME",
                        help=f"causal mechanisms, softmax first as the reference (default: "
                             f"{' '.join(lm.DEFAULT_ATTENTIONS)})")
    parser.add_argument("--seeds", nargs="+", default=["0", "1", "2"], metavar="SEED", help="training seeds")
    parser.add_argument("--data-dir", help="WikiText-2 folder (wiki.*.tokens), e.g. ../shared/data/wikitext2")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value of every run, e.g. --set train.max_steps=100 (repeatable)")
    parser.add_argument("--measure", nargs="+", default=list(lm.MEASUREMENTS), metavar="WHAT",
                        help=f"what to measure: {' '.join(lm.MEASUREMENTS)} (default: all)")
    parser.add_argument("--prefixes", nargs="+", default=[str(p) for p in lm.DEFAULT_PREFIXES], metavar="N",
                        help="prompt lengths of the decoding measurement (k suffix: 1k = 1024)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="timed tokens per prompt length")
    parser.add_argument("--throughput-steps", type=int, default=3, help="timed training steps per mechanism")
    parser.add_argument("--device", default="cpu",
                        help="device of the throughput and decoding measurements: cpu (one thread, process CPU "
                             "time) or cuda (training runs use the preset's train.device)")
    parser.add_argument("--workers", type=int, default=1,
                        help="training runs at once, each with an even share of the threads (OMP_NUM_THREADS)")
    parser.add_argument("--resume", action="store_true",
                        help="keep finished runs and measurements in --out, continue interrupted runs")
    parser.add_argument("--out", default="runs/bench-lm", help="output folder")


register_analysis("lm", "causal-LM benchmark: perplexity, training throughput and decoding cost per token of a Llama "
                  "decoder with each causal mechanism on WikiText-2", _arguments, _run)
