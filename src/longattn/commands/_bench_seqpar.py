"""``longattn bench seqpar``: sequence-parallel attention, bytes / time / memory against N and P."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from longattn.commands._args import add_list_argument
from longattn.commands.bench import _lengths, _write
from longattn.experiment.analyses import register_analysis


def _run(args: argparse.Namespace) -> int:
    from longattn.bench import seqpar

    names = args.attentions or list(seqpar.DEFAULT_ATTENTIONS)
    options = dict(seqpar.MECHANISM_OPTIONS)
    for name, extra in json.loads(args.options).items():
        options[name] = {**options.get(name, {}), **extra}
    rows = []
    configs = []
    for procs in args.procs:
        config = seqpar.SeqparConfig(
            attentions=names, lengths=args.lengths, processes=procs, batch=args.batch, dim=args.dim,
            heads=args.heads, max_len=args.max_len, threads=args.threads, warmup=args.warmup, repeats=args.repeats,
            seed=args.seed, quadratic_max_length=args.quadratic_max_length, options=options,
        )
        configs.append(seqpar.config_dict(config))
        rows += seqpar.run_seqpar(config)
    summary = seqpar.summarise(rows)
    growth = seqpar.bytes_growth(summary)
    table = seqpar.seqpar_table(summary) + "\n\n" + seqpar.growth_table(growth)
    out = Path(args.out)
    _write(out, "seqpar", summary, table, {"configs": configs, "per_rank": rows, "bytes_growth": growth})
    seqpar.plot_seqpar(summary, out / "seqpar.png")
    print(f"wrote {out / 'seqpar.png'}")
    return 0


def _parallel_forms() -> list[str]:
    from longattn.parallel import parallel_forms

    return list(parallel_forms())


def _arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import seqpar

    add_list_argument(parser, "--attentions", "--attention", dest="attentions", names=_parallel_forms,
                      kind="mechanism with a sequence-parallel form",
                      help=f"mechanisms (default: {' '.join(seqpar.DEFAULT_ATTENTIONS)})")
    _lengths(parser, seqpar.DEFAULT_LENGTHS)
    add_list_argument(parser, "--procs", item=int, kind="P", default=[int(p) for p in seqpar.DEFAULT_PROCESSES.split(",")],
                      help="process counts P")
    parser.add_argument("--batch", type=int, default=1, help="sequences per call")
    parser.add_argument("--dim", type=int, default=32, help="model width")
    parser.add_argument("--heads", type=int, default=2, help="attention heads")
    parser.add_argument("--max-len", type=int, default=None,
                        help="max_len of layers that need one (default: the largest N, the same layer for every N)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (the median is kept)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    parser.add_argument("--quadratic-max-length", type=int, default=seqpar.DEFAULT_QUADRATIC_MAX_LENGTH,
                        help="skip quadratic mechanisms (softmax) above this N")
    parser.add_argument("--options", default="{}", help='JSON build options per mechanism, e.g. \'{"skeleton": {"smoother": false}}\'')
    parser.add_argument("--out", default="runs/bench-seqpar", help="output folder")


register_analysis("seqpar", "sequence-parallel attention: bytes communicated, time and memory per rank vs N and processes",
                  _arguments, _run)
