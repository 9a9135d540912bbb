"""The causal-LM benchmark (``longattn bench lm``): a small Llama decoder with each causal mechanism on WikiText-2.

Three measurements, each written to the output folder and reused by ``--resume``:

* **training** (the grid): the ``lm`` task at a preset (``cpu``, ``paper``) for every mechanism and seed, one
  ordinary run per (mechanism, seed) under ``runs/`` (resumable, checkpointed; ``--workers`` runs at once);
  validation perplexity per seed, mean ± std, the paired difference from softmax over the same seeds
  (:mod:`longattn.experiment.stats`), test and word-level perplexities, learning curves;
* **throughput**: training tokens per second of one optimiser step (forward, backward, AdamW) at the preset's
  batch, context and precision, the median of ``throughput_steps`` steps after one warm-up;
* **decode**: milliseconds per generated token after a prompt of each length in ``prefixes`` (1k, 4k, 16k), in
  float32: the model's cached forward of one token (embedding, every layer with its decoding state, output layer),
  the median over ``decode_tokens`` tokens after two warm-up ones, taken in rounds that visit the prompt lengths
  in turn. Softmax is transformers' own SDPA attention with its KV cache; every other mechanism decodes with its
  longattn state (:mod:`longattn.attention.decoding`). The model has the preset's shape and random weights (a
  token's cost does not depend on their values) and positions up to the longest prefix, which sets cosFormer's M.
  The ratio of the longest to the shortest prefix is the growth: about 1 for the recurrent and windowed states,
  the KV cache's for softmax.

Both measurements run on ``device``: on the CPU (the default) on one thread, in process CPU time; on a GPU in
wall time between CUDA synchronisations, the device named in the table.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from longattn.attention import capabilities
from longattn.experiment.config import resolve_config
from longattn.experiment.curves import curve_groups, write_learning_curves
from longattn.experiment.grid import Cell, convergence_legend, convergence_mark, paired_against, run_cells
from longattn.experiment.results import markdown_table, now, write_results
from longattn.experiment.stats import format_difference, legend, mean_std, summarize
from longattn.utils import optional_import

__all__ = ["DEFAULT_ATTENTIONS", "DEFAULT_PREFIXES", "GROWTH_LIMIT", "LMBenchConfig", "decode_timing",
           "lm_tables", "plot_decode", "run_lm_bench", "training_throughput"]

DEFAULT_ATTENTIONS = ("softmax", "linear", "performer", "cosformer", "local")
DEFAULT_PREFIXES = (1024, 4096, 16384)
REFERENCE = "softmax"
# the acceptance figure: decoding time per token may grow at most this much from the shortest to the longest
# prefix for the recurrent and windowed states
GROWTH_LIMIT = 1.3
MEASUREMENTS = ("train", "throughput", "decode")


@dataclass
class LMBenchConfig:
    """What ``longattn bench lm`` runs (see the module docstring)."""

    preset: str = "cpu"
    attentions: list[str] = field(default_factory=lambda: list(DEFAULT_ATTENTIONS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    data_dir: str | None = None
    overrides: list[str] = field(default_factory=list)
    measure: list[str] = field(default_factory=lambda: list(MEASUREMENTS))
    prefixes: list[int] = field(default_factory=lambda: list(DEFAULT_PREFIXES))
    decode_tokens: int = 32
    throughput_steps: int = 3
    workers: int | None = 1
    device: str = "cpu"  # of the throughput and decoding measurements (training runs use train.device)


def _run_config(config: LMBenchConfig, attention: str, seed: int = 0) -> Any:
    data = {"data_dir": config.data_dir} if config.data_dir else None
    return resolve_config("lm", config.preset, None, config.overrides, attention=attention, seed=seed, data=data)


# ----------------------------------------------------------------------------- throughput


class _Clock:
    """Timing of the measurements: on CPU one thread and process CPU time, on CUDA the wall time between
    synchronisations (the kernels of a step have finished when it is read)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> "_Clock":
        self.threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.threads)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()


def training_throughput(config: LMBenchConfig, attention: str, data: Any = None) -> dict[str, Any]:
    """Training tokens per second of one optimiser step at the preset's size (module docstring)."""
    from longattn.experiment.run import build_run_model
    from longattn.tasks.base import get_task

    from longattn.train.loop import precision_autocast

    run_config = _run_config(config, attention)
    task = get_task("lm")
    data = data if data is not None else task.build_data(run_config)
    device = torch.device(config.device)
    torch.manual_seed(0)
    model = build_run_model(run_config, task, data).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=run_config.optim.lr)
    batch_size = run_config.train.batch_size
    batch = {k: v.to(device) for k, v in data.collate([data.train[i] for i in range(batch_size)]).items()}
    step = task.step_fn(run_config, data)
    times = []
    with _Clock(device) as clock:
        for index in range(config.throughput_steps + 1):
            started = clock.now()
            with precision_autocast(device, run_config.train.precision):
                loss = step(model, batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if index:  # the first step warms up (allocations, lazy initialisation)
                times.append(clock.now() - started)
    seconds = statistics.median(times)
    tokens = batch_size * run_config.data.context
    return {"attention": attention, "batch": batch_size, "context": run_config.data.context,
            "precision": run_config.train.precision, "device": str(device), "step_s": seconds,
            "tokens_per_s": tokens / seconds, "steps": len(times)}


# ----------------------------------------------------------------------------- decoding


def _decode_model(config: LMBenchConfig, attention: str, vocab_size: int) -> Any:
    from longattn.hf.llama import LlamaLM

    run_config = _run_config(config, attention)
    positions = max(config.prefixes) + config.decode_tokens + 4
    torch.manual_seed(0)
    return LlamaLM(vocab_size, positions, attention, run_config.chosen_attention_options(),
                   **run_config.model).eval()


@torch.no_grad()
def decode_timing(config: LMBenchConfig, attention: str, vocab_size: int, rounds: int = 4) -> dict[str, Any]:
    """Milliseconds per generated token after each prompt length of ``config.prefixes`` (module docstring).

    Every prompt is prefilled first; the timed tokens are then taken in ``rounds`` rounds that visit the
    prompts in turn, so that a slow spell of the machine (another job, the allocator warming up) falls on
    every prompt length alike instead of on whichever was measured at that moment."""
    device = torch.device(config.device)
    model = _decode_model(config, attention, vocab_size).lm.to(device)
    generator = torch.Generator().manual_seed(0)
    share, extra = divmod(config.decode_tokens, rounds)  # the timed tokens spread over the rounds
    per_round = [count for count in [share + 1] * extra + [share] * (rounds - extra) if count]
    states, times, prefill = [], {prefix: [] for prefix in config.prefixes}, {}
    with _Clock(device) as clock:

        def step(token: torch.Tensor, cache: Any) -> tuple[torch.Tensor, float]:
            started = clock.now()
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            return token, clock.now() - started

        for prefix in config.prefixes:
            prompt = torch.randint(0, vocab_size, (1, prefix), generator=generator).to(device)
            started = clock.now()
            out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            prefill[prefix] = clock.now() - started
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(2):  # two warm-up tokens
                token, _ = step(token, cache)
            states.append([prefix, token, cache])
        for count in per_round:
            for state in states:
                prefix, token, cache = state
                for _ in range(count):
                    token, seconds = step(token, cache)
                    times[prefix].append(seconds)
                state[1] = token
    rows = [{"prefix": prefix, "ms_per_token_median": 1000 * statistics.median(times[prefix]),
             "ms_per_token_mean": 1000 * statistics.fmean(times[prefix]), "prefill_s": prefill[prefix],
             "tokens": len(times[prefix])} for prefix in config.prefixes]
    first, last = rows[0]["ms_per_token_median"], rows[-1]["ms_per_token_median"]
    kind = capabilities(attention).decode_state
    return {"attention": attention, "decode_state": "kv_cache (transformers)" if attention == REFERENCE else kind,
            "device": str(device), "rows": rows, "growth": last / first,
            "bounded": kind in ("recurrent", "window") and attention != REFERENCE}


# ----------------------------------------------------------------------------- the benchmark


def _saved(path: Path, settings: dict[str, Any], resume: bool) -> dict[str, Any] | None:
    """A measurement saved by an earlier run of the benchmark with the same settings (``--resume``)."""
    if not resume or not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved["result"] if saved.get("settings") == settings else None


def _save(path: Path, settings: dict[str, Any], result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"settings": settings, "result": result}, indent=2))
    tmp.replace(path)


def run_lm_bench(config: LMBenchConfig, out: str | Path, resume: bool = False,
                 overwrite: bool = False) -> dict[str, Any]:
    """Run the measurements of ``config.measure`` into ``out``; write ``lm.json``, ``lm.md`` and the plots.

    Training runs already in ``out`` are refused unless ``resume`` (reuse finished ones, continue interrupted
    ones; saved measurements of the same settings are reused too) or ``overwrite`` (train and measure again)."""
    from longattn.tasks.base import get_task

    started = now()
    out = Path(out)
    unknown = sorted(set(config.measure) - set(MEASUREMENTS))
    if unknown:
        raise ValueError(f"unknown measurement(s) {unknown}; choose from {', '.join(MEASUREMENTS)}")
    not_causal = [name for name in config.attentions if not capabilities(name).causal]
    if not_causal:
        raise ValueError(f"{', '.join(not_causal)} cannot be causal: a decoder needs a causal mechanism")
    for name in config.attentions:  # bad options fail here, before anything trains
        _run_config(config, name)
    cells: list[Cell] = []
    if "train" in config.measure:
        data = {"data_dir": config.data_dir} if config.data_dir else {}
        cells = [Cell(name, "lm", "lm", config.preset, overrides=list(config.overrides),
                      explicit={"attention": name, **({"data": data} if data else {})})
                 for name in config.attentions]
        run_cells(cells, config.seeds, out / "runs", resume=resume, overwrite=overwrite, workers=config.workers,
                  run_dir=lambda cell, seed: out / "runs" / cell.row / f"seed{seed}")
        write_learning_curves(curve_groups(cells), out)
    throughput, decoding = {}, {}
    need_data = "throughput" in config.measure or "decode" in config.measure
    task_data = get_task("lm").build_data(_run_config(config, config.attentions[0])) if need_data else None
    for name in config.attentions:
        if "throughput" in config.measure:
            settings = {"run_config": json.loads(json.dumps(asdict(_run_config(config, name)), default=str)),
                        "steps": config.throughput_steps}
            path = out / "measurements" / f"throughput-{name}.json"
            throughput[name] = _saved(path, settings, resume) or training_throughput(config, name, task_data)
            _save(path, settings, throughput[name])
            print(f"throughput {name}: {throughput[name]['tokens_per_s']:.0f} training tokens/s", flush=True)
        if "decode" in config.measure:
            settings = {"run_config": json.loads(json.dumps(asdict(_run_config(config, name)), default=str)),
                        "prefixes": config.prefixes, "tokens": config.decode_tokens}
            path = out / "measurements" / f"decode-{name}.json"
            vocab = task_data.info["vocab_size"]
            decoding[name] = _saved(path, settings, resume) or decode_timing(config, name, vocab)
            _save(path, settings, decoding[name])
            times = ", ".join(f"{r['prefix']}: {r['ms_per_token_median']:.2f}" for r in decoding[name]["rows"])
            print(f"decode {name}: ms/token at prefix {times}", flush=True)
    text, summary = lm_tables(config, cells, throughput, decoding)
    (out / "lm.md").write_text(text)
    write_results(out / "lm.json", {**summary, "config": asdict(config)}, seeds=config.seeds, started=started)
    if decoding:
        plot_decode(decoding, out / "decode.png")
    print(text)
    return summary


def _word_perplexities(cell: Cell, split: str) -> list[float]:
    return [r["word_perplexity"][split] for r in cell.results if r.get("word_perplexity", {}).get(split)]


def lm_tables(config: LMBenchConfig, cells: list[Cell], throughput: dict[str, dict[str, Any]],
              decoding: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The markdown of ``lm.md`` and the summary of ``lm.json``."""
    parts, summary = [f"## Causal LM benchmark, preset `{config.preset}`\n"], {"rows": []}
    by_name = {cell.row: cell for cell in cells}
    reference = by_name.get(REFERENCE)
    if cells:
        rows = []
        for cell in cells:
            val, test = cell.values("perplexity", "val"), cell.values("perplexity", "test")
            not_converged = cell.not_converged()
            mark = convergence_mark(len(not_converged), len(cell.results))
            difference = None if cell is reference or reference is None else \
                paired_against(cell, reference, "perplexity", "val")
            rows.append([f"`{cell.row}`", len(cell.results),
                         "failed: " + cell.error if cell.error else mean_std(val) + mark,
                         "reference" if cell is reference else format_difference(difference), mean_std(test),
                         mean_std(_word_perplexities(cell, "val"), 1),
                         mean_std([r["train_tokens_per_s"] for r in cell.results if r.get("train_tokens_per_s")], 0)])
            summary["rows"].append({
                "attention": cell.row, "seeds": [r["seed"] for r in cell.results], "val_perplexity": val,
                "val_summary": summarize(val).as_dict(), "test_perplexity": test,
                "val_word_perplexity": _word_perplexities(cell, "val"), "not_converged_seeds": not_converged,
                "difference_from_softmax": difference.as_dict() if difference else None, "error": cell.error})
        parts.append(f"Validation perplexity (per BPE token) per seed, seeds {config.seeds}: mean ± std; Δ paired "
                     f"with {REFERENCE}.\n\n" + markdown_table(
                         ["mechanism", "seeds", "val perplexity", f"Δ vs {REFERENCE} (val)", "test perplexity",
                          "val word perplexity", "observed train tokens/s (wall)"], rows)
                     + f"\n\n{legend(REFERENCE)}\n"
                     + convergence_legend(any(row["not_converged_seeds"] for row in summary["rows"])))
    if throughput:
        rows = [[f"`{name}`", f"{t['tokens_per_s']:.0f}", f"{1000 * t['step_s']:.0f}", t["batch"], t["context"]]
                for name, t in throughput.items()]
        parts.append(f"Training throughput on {_where(config.device)} (median of {config.throughput_steps} "
                     "steps):\n\n" + markdown_table(
                         ["mechanism", "tokens/s", "ms/step", "batch", "context"], rows) + "\n")
        summary["throughput"] = throughput
    if decoding:
        prefixes = config.prefixes
        rows = []
        for name, d in decoding.items():
            cells_ms = [f"{r['ms_per_token_median']:.2f}" for r in d["rows"]]
            verdict = ("within" if d["growth"] <= GROWTH_LIMIT else "OVER") if d["bounded"] else "-"
            rows.append([f"`{name}`", d["decode_state"], *cells_ms, f"{d['growth']:.2f}x",
                         f"{verdict} {GROWTH_LIMIT}x" if d["bounded"] else "-"])
        parts.append(f"Decoding, ms per token after a prompt of N tokens (float32 on {_where(config.device)}, median of "
                     f"{config.decode_tokens} tokens):\n\n" + markdown_table(
                         ["mechanism", "state", *[f"N = {p}" for p in prefixes], f"{prefixes[-1]} / {prefixes[0]}",
                          "bound"], rows) + "\n")
        summary["decode"] = decoding
    return "\n".join(parts), summary


def _where(device: str) -> str:
    if torch.device(device).type == "cpu":
        return "one CPU thread, process CPU time"
    name = torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else device
    return f"{name} (torch {torch.__version__}), wall time between synchronisations"


def plot_decode(decoding: dict[str, dict[str, Any]], path: Path) -> None:
    """ms per token against the prompt length, one line per mechanism (log-log)."""
    plt = optional_import("matplotlib.pyplot")
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, d in decoding.items():
        axis.plot([r["prefix"] for r in d["rows"]], [r["ms_per_token_median"] for r in d["rows"]], marker="o",
                  label=name)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("prompt length (tokens)")
    axis.set_ylabel("ms per generated token")
    axis.set_title("decoding cost per token")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
