"""Subcommands of the ``longattn`` CLI; each module defines ``register(subparsers)``.

:data:`VERB_HELP` is the one line of each top-level verb, read by ``longattn --help`` without importing the
command modules (they import torch; the top-level help must not wait for it) and by each module's
``register`` for its own parser."""

VERB_HELP: dict[str, str] = {
    "train": "one training run of any task: LRA, forecasting, MLM pretraining, document classification",
    "eval": "re-evaluate a finished run's checkpoint on a split",
    "compare": "grids of training runs: mechanisms x seeds (the default), a sweep or ablation file, a settings search",
    "bench": "measurements: time, memory, FLOPs, approximation error",
    "report": "tables and plots rebuilt from finished output folders (`longattn report --help` lists them)",
    "paper": "reproduce the papers' tables and figures (`longattn paper` lists them)",
    "data": "download datasets into a data folder",
    "demo": "run every mechanism once on generated data: output shape, parameters, time, finiteness",
    "pretrain": "MLM-pretrain a BERT encoder with one mechanism (then `finetune`)",
    "finetune": "fine-tune pretrained encoders on GLUE with a search (Table 3 layout)",
}
