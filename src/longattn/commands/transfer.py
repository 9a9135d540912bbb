"""``longattn pretrain`` / ``finetune`` / ``paper sktformer-table3``: transfer learning (SKTformer / S^3 Table 3).

* ``pretrain``: one MLM pretraining (task ``mlm``) of a BERT with one mechanism;
* ``finetune``: fine-tune pretrained encoders (``pretrain`` folders, or the pretrained MiniLM with any
  mechanism) on GLUE tasks with a spec's search and seeds; Table 3 layout, JSON, plot;
* ``paper sktformer-table3``: both, for every mechanism of a spec (the whole Table 3 grid).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from longattn.commands import VERB_HELP
from longattn.commands._args import (add_attentions_argument, add_config_arguments, add_data_dir_argument,
                                    add_list_argument, add_no_progress_argument, add_resume_argument, add_set_argument,
                                    add_workers_argument, attention_names, deprecated_alias, glue_task_names, name_type,
                                    no_progress, task_data_dirs)
from longattn.config import ConfigError
from longattn.experiment.analyses import register_paper, register_report

# The experiment modules (and torch and transformers with them) are imported by the functions that run a command,
# not here: `longattn pretrain --help` and `longattn finetune --help` answer without them.


def _pretrain(args: argparse.Namespace) -> int:
    from longattn.experiment.config import resolve_config
    from longattn.experiment.run import run

    overrides = [*no_progress(args), *([f"data.data_dir={args.data_dir}"] if args.data_dir else [])]
    config = resolve_config("mlm", args.preset, args.config, overrides, attention=args.attention)
    results = run(config, args.out, resume=args.resume, overwrite=args.overwrite)
    print(json.dumps({k: results.get(k) for k in ("attention", "parameters", "steps", "train_time_s")}
                     | {"val_perplexity": (results.get("val") or {}).get("perplexity"),
                        "test_perplexity": (results.get("test") or {}).get("perplexity")}, indent=2))
    return 0


def _pretrained_attention(folder: str) -> str:
    from longattn.experiment.config import load_saved
    from longattn.hf.bert import MINILM

    saved = Path(folder) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--pretrained {folder}: no config.yaml there; give `longattn pretrain` --out folders "
                          f"or {MINILM!r}")
    return str(load_saved(saved).attention)


def _table_naming(from_minilm: bool, mechanisms: set[str], folder: Path) -> dict[str, str | None]:
    """The table's label and softmax reference: MiniLM conversions compare with MiniLM's own softmax; runs from
    pretraining folders are named by their folder and have no reference."""
    return {"label": "MiniLM" if from_minilm else folder.name,
            "reference": "softmax" if from_minilm and "softmax" in mechanisms else None}


def _finetune(args: argparse.Namespace) -> int:
    from longattn.experiment.results import now
    from longattn.experiment.transfer import finetune_grid, load_spec, write_transfer_table
    from longattn.hf.bert import MINILM

    spec = load_spec(args.config or (DEFAULT_MINILM_SPEC if args.pretrained == [MINILM] else "table3_cpu"))
    if args.tasks:
        spec.setdefault("finetune", {})["tasks"] = list(args.tasks)
    if args.seeds:
        spec.setdefault("finetune", {})["seeds"] = list(args.seeds)
    if args.pretrained == [MINILM]:
        names = args.attentions or list(spec["mechanisms"])
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
    cells = finetune_grid(spec, out, starts, [f"data.data_dir={args.data_dir}"], args.resume,
                          extra_overrides=args.overrides, workers=args.workers, overwrite=args.overwrite)
    summary = write_transfer_table(spec, cells, out, started=started,
                                   **_table_naming(args.pretrained == [MINILM], set(starts), out))
    return 1 if any(run["error"] for run in summary["runs"]) else 0


def _report(args: argparse.Namespace) -> int:
    from longattn.experiment.transfer import collect_finetune_cells, write_transfer_table
    from longattn.hf.bert import MINILM

    folders = [Path(folder) for folder in args.run]
    if args.out is None and len(folders) > 1:
        raise ConfigError("--out is required with several --run folders (where the merged table is written)")
    out = Path(args.out) if args.out is not None else folders[0]
    cells = collect_finetune_cells(folders, args.data_dir)
    if not cells:
        raise ConfigError(f"no finished fine-tuning run under {', '.join(str(f / 'finetune') for f in folders)}")
    from_minilm = all((r.get("config") or {}).get("model", {}).get("pretrained") == MINILM
                      for cell in cells for r in cell.results)
    seeds = sorted({r["seed"] for cell in cells for r in cell.results})
    spec = {"title": f"GLUE fine-tuning: the runs finished in {', '.join(map(str, folders))}",
            "finetune": {"seeds": seeds}}
    write_transfer_table(spec, cells, out, **_table_naming(from_minilm, {cell.row for cell in cells}, folders[0]))
    return 0


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", nargs="+", required=True, metavar="DIR",
                        help="--out folders of `longattn finetune` (or `paper sktformer-table3`), read; several are "
                        "merged (the same run in two is an error)")
    parser.add_argument("--out", help="where table.md, results.json and table3.png go (default: the --run folder; "
                        "required with several)")
    parser.add_argument("--data-dir", metavar="DIR", help="the glue_data/ folder: gives the runs that do not record "
                        "it the majority class's dev score (the floor of the table's share above the majority class)")


def _table3(args: argparse.Namespace) -> int:
    from longattn.experiment.transfer import load_spec, run_table3

    spec = load_spec(args.config)
    folders = task_data_dirs(args.data_dir, list(TABLE3_DATA), what="part")
    missing = [key for key in TABLE3_DATA if key not in folders]
    if missing:
        raise ValueError(f"--data-dir needs {' and '.join(f'{key}=PATH' for key in missing)} "
                         f"({'; '.join(TABLE3_DATA[key] for key in missing)})")
    corpus = [f"data.data_dir={folders['corpus']}", *args.corpus_set]
    summary = run_table3(spec, args.out, corpus, [f"data.data_dir={folders['glue']}"], resume=args.resume,
                         workers=args.workers, overwrite=args.overwrite)
    return 1 if any(run["error"] for run in summary["runs"]) else 0


SPECS = "table3_cpu, table3_paper, minilm"
# The default recipe of `finetune --pretrained minilm` (configs/transfer/minilm.yaml, docs/transfer.md).
DEFAULT_MINILM_SPEC = "minilm"
# The two data folders of the Table 3 grid: --data-dir corpus=PATH glue=PATH.
TABLE3_DATA = {"corpus": "the pretraining corpus, WikiText-2 layout", "glue": "the glue_data/ folder"}


def _table3_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="table3_cpu", help=f"transfer spec (a file, or shipped: {SPECS})")
    parser.add_argument("--data-dir", nargs="+", action="extend", default=[], metavar="PART=DIR",
                        help="the two data folders: corpus=DIR (pretraining corpus, WikiText-2 layout) and glue=DIR "
                        "(the glue_data/ folder), required")
    deprecated_alias(parser, "--corpus-dir", "--data-dir corpus=DIR", "data_dir", append=True,
                     transform=lambda path: f"corpus={path}")
    deprecated_alias(parser, "--glue-dir", "--data-dir glue=DIR", "data_dir", append=True,
                     transform=lambda path: f"glue={path}")
    parser.add_argument("--corpus-set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override for the pretraining runs, e.g. data.train_file=wiki.train.tokens.reordered "
                        "(repeatable)")
    parser.add_argument("--out", required=True, help="output folder (pretrain/<mechanism>, finetune/..., the table)")
    add_resume_argument(parser)
    add_workers_argument(parser)


register_report("finetune", "GLUE table (Table 3 layout; from MiniLM, the share of softmax's score each mechanism "
                "keeps) from the runs finished in `finetune` folders, several merged", _report_arguments, _report)
register_paper("sktformer-table3", "SKTformer / S^3", "Table 3", "transfer learning: MLM-pretrain every mechanism, "
               "fine-tune each on GLUE with the Table 15 search, the Table 3 layout", _table3_arguments, _table3)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pretrain", help=VERB_HELP["pretrain"],
                              description="BERT masked-language-model pretraining (task mlm) on a text corpus "
                              "(WikiText-2 layout by default). Writes config.yaml, metrics.jsonl, checkpoints/ and "
                              "results.json to --out; `longattn finetune --pretrained OUT` continues from it.")
    p.add_argument("--attention", required=True, type=name_type("mechanism", attention_names), metavar="MECHANISM",
                   help="registered mechanism (fnet and ponet replace the attention)")
    add_data_dir_argument(p, help="corpus folder (wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens)")
    add_config_arguments(p, tasks=["mlm"])
    p.add_argument("--out", required=True, help="output folder")
    add_resume_argument(p, help="continue exactly from --out/checkpoints/last.pt")
    add_no_progress_argument(p)
    p.set_defaults(func=_pretrain)

    f = subparsers.add_parser("finetune", help=VERB_HELP["finetune"],
                              description="Fine-tune on GLUE tasks with the spec's search and seeds; report the best "
                              "point per task (mean ± std over seeds) in the layout of SKTformer Table 3; write "
                              "table.md, results.json and table3.png to --out.")
    f.add_argument("--pretrained", nargs="+", required=True,
                   help="`longattn pretrain` --out folders, or `minilm` (the pretrained MiniLM-L6, converted)")
    add_attentions_argument(f, help="with --pretrained minilm: the mechanisms (default: the spec's)")
    f.add_argument("--config", help=f"transfer spec (a file, or shipped: {SPECS}); default: {DEFAULT_MINILM_SPEC} "
                   "(the fine-tuning recipe) with --pretrained minilm, table3_cpu with pretraining folders")
    add_list_argument(f, "--tasks", names=glue_task_names, kind="GLUE task", help="GLUE tasks (default: the spec's)")
    add_list_argument(f, "--seeds", item=int, kind="seed", help="seeds of every run (default: the spec's)")
    add_data_dir_argument(f, "the glue_data/ folder", "--glue-dir", required=True)
    add_set_argument(f, help="override for every fine-tuning run (repeatable)")
    f.add_argument("--out", required=True, help="output folder")
    add_resume_argument(f)
    add_workers_argument(f)
    f.set_defaults(func=_finetune)
