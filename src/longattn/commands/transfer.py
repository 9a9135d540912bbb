"""``longattn pretrain`` / ``finetune`` / ``table3``: the transfer-learning experiment of SKTformer / S^3 Table 3.

* ``pretrain``: one MLM pretraining (task ``mlm``) of a BERT with one mechanism;
* ``finetune``: fine-tune pretrained encoders (``pretrain`` folders, or the pretrained MiniLM with any
  mechanism) on GLUE tasks with a spec's search and seeds; Table 3 layout, JSON, plot;
* ``table3``: both, for every mechanism of a spec (the whole Table 3 grid).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from longattn.commands._args import add_config_arguments, add_workers_argument, attention_list, no_progress
from longattn.config import ConfigError
from longattn.experiment.config import load_saved, resolve_config
from longattn.experiment.results import now
from longattn.experiment.run import run
from longattn.experiment.transfer import finetune_grid, load_spec, run_table3, write_transfer_table
from longattn.hf.bert import MINILM


def _pretrain(args: argparse.Namespace) -> int:
    overrides = [*no_progress(args), *([f"data.data_dir={args.data_dir}"] if args.data_dir else [])]
    config = resolve_config("mlm", args.preset, args.config, overrides, attention=args.attention)
    results = run(config, args.out, resume=args.resume)
    print(json.dumps({k: results.get(k) for k in ("attention", "parameters", "steps", "train_time_s")}
                     | {"val_perplexity": (results.get("val") or {}).get("perplexity"),
                        "test_perplexity": (results.get("test") or {}).get("perplexity")}, indent=2))
    return 0


def _pretrained_attention(folder: str) -> str:
    saved = Path(folder) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--pretrained {folder}: no config.yaml there; give `longattn pretrain` --out folders "
                          f"or {MINILM!r}")
    return str(load_saved(saved).attention)


def _finetune(args: argparse.Namespace) -> int:
    spec = load_spec(args.config)
    if args.tasks:
        spec.setdefault("finetune", {})["tasks"] = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.pretrained == [MINILM]:
        names = attention_list(args.attentions) if args.attentions else list(spec["mechanisms"])
        starts = {name: MINILM for name in names}
    else:
        if args.attentions:
            raise ConfigError("--attentions is only for --pretrained minilm: a pretraining folder fixes its mechanism")
        starts = {}
        for folder in args.pretrained:
            name = _pretrained_attention(folder)
            if name in starts:
                raise ConfigError(f"two --pretrained folders use {name!r}: fine-tune them into separate --out folders")
            starts[name] = str(Path(folder).resolve())
    started = now()
    out = Path(args.out)
    cells = finetune_grid(spec, out, starts, [f"data.data_dir={args.glue_dir}"], args.resume,
                          extra_overrides=args.overrides, workers=args.workers)
    reference = "softmax" if args.pretrained == [MINILM] and "softmax" in starts else None
    label = "MiniLM" if args.pretrained == [MINILM] else out.name
    summary = write_transfer_table(spec, cells, out, label=label, reference=reference, started=started)
    return 1 if any(run["error"] for run in summary["runs"]) else 0


def _table3(args: argparse.Namespace) -> int:
    spec = load_spec(args.config)
    corpus = [f"data.data_dir={args.corpus_dir}", *args.corpus_set]
    summary = run_table3(spec, args.out, corpus, [f"data.data_dir={args.glue_dir}"], resume=args.resume,
                         workers=args.workers)
    return 1 if any(run["error"] for run in summary["runs"]) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pretrain", help="MLM-pretrain a BERT with one mechanism (SKTformer Table 3)",
                              description="BERT masked-language-model pretraining (task mlm) on a text corpus "
                              "(WikiText-2 layout by default). Writes config.yaml, metrics.jsonl, checkpoints/ and "
                              "results.json to --out; `longattn finetune --pretrained OUT` continues from it.")
    p.add_argument("--attention", required=True, help="registered mechanism (fnet and ponet replace the attention)")
    p.add_argument("--data-dir", help="corpus folder (wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens)")
    add_config_arguments(p)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="continue exactly from --out/checkpoints/last.pt")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_pretrain)

    f = subparsers.add_parser("finetune", help="fine-tune pretrained encoders on GLUE with a search (Table 3 layout)",
                              description="Fine-tune on GLUE tasks with the spec's search and seeds; report the best "
                              "point per task (mean ± std over seeds) in the layout of SKTformer Table 3; write "
                              "table.md, results.json and table3.png to --out.")
    f.add_argument("--pretrained", nargs="+", required=True,
                   help="`longattn pretrain` --out folders, or `minilm` (the pretrained MiniLM-L6, converted)")
    f.add_argument("--attentions", help="with --pretrained minilm: comma-separated mechanisms (default: the spec's)")
    f.add_argument("--config", default="table3_cpu", help="transfer spec (file or shipped name: table3_cpu, "
                   "table3_paper, minilm_cpu)")
    f.add_argument("--tasks", help="comma-separated GLUE tasks (default: the spec's)")
    f.add_argument("--glue-dir", required=True, help="the glue_data/ folder")
    f.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every fine-tuning run (repeatable)")
    f.add_argument("--out", required=True)
    f.add_argument("--resume", action="store_true", help="reuse finished runs, resume interrupted ones")
    add_workers_argument(f)
    f.set_defaults(func=_finetune)

    t = subparsers.add_parser("table3", help="the whole Table 3 grid: pretrain every mechanism, fine-tune on GLUE",
                              description="MLM-pretrain every mechanism of the spec, fine-tune each on its GLUE tasks "
                              "with the search, and write the Table 3 layout (table.md, results.json, table3.png).")
    t.add_argument("--config", default="table3_cpu", help="transfer spec (file or shipped name)")
    t.add_argument("--corpus-dir", required=True, help="pretraining corpus folder (WikiText-2 layout)")
    t.add_argument("--corpus-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for the pretraining runs, e.g. data.train_file=wiki.train.tokens.reordered")
    t.add_argument("--glue-dir", required=True, help="the glue_data/ folder")
    t.add_argument("--out", required=True)
    t.add_argument("--resume", action="store_true", help="reuse finished runs, resume interrupted ones")
    add_workers_argument(t)
    t.set_defaults(func=_table3)
