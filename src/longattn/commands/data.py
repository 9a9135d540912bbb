"""``longattn data download NAME ... --data-dir DIR``: fetch datasets into a folder, checksum-verified where a
checksum is published: the forecasting benchmark CSVs, GLUE, the document classification sets and the other
archives of :mod:`longattn.data.download`."""

from __future__ import annotations

import argparse

from longattn.commands import VERB_HELP
from longattn.commands._args import add_data_dir_argument, add_list_argument, glue_task_names
from longattn.registry import nearest

# The dataset modules (torch with them) are imported by the functions that name or fetch the datasets, not here:
# `longattn data --help` answers without them.


def _textcls() -> list[str]:
    from longattn.data.textcls import TEXTCLS_DATASETS

    return [name for name in TEXTCLS_DATASETS.names() if name != "mimic3_50"]  # MIMIC-III is never downloaded


def downloadable() -> list[str]:
    """Every name ``data download`` takes: series, glue, text classification sets, then the other archives."""
    from longattn.data.download import ARCHIVES
    from longattn.data.timeseries import SERIES

    archives = [name for name in sorted(ARCHIVES) if not name.startswith(("glue_", "r8_")) and name not in _textcls()]
    return [*SERIES, "glue", *_textcls(), *archives]


def _dataset(text: str) -> str:
    from longattn.data.timeseries import resolve_series

    if text in downloadable():
        return text
    try:
        return resolve_series(text)[0]  # benchmark series are case-insensitive (etth1, exchange_rate, ...)
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown dataset {text!r}{nearest(text, downloadable())}; downloadable: "
                                         f"{', '.join(downloadable())}") from None


def _download(args: argparse.Namespace) -> int:
    from longattn.data.download import download
    from longattn.data.glue import download_glue
    from longattn.data.textcls import download_textcls
    from longattn.data.timeseries import SERIES, download_series

    options = {"base_url": args.base_url, "allow_unverified": args.allow_unverified}
    for name in args.datasets:
        if name in SERIES:
            print(download_series(name, args.data_dir))
        elif name == "glue":
            print(download_glue(args.data_dir, args.glue_tasks, **options))
        elif name in _textcls():
            print(download_textcls(name, args.data_dir, **options))
        else:
            print(download(name, args.data_dir, extract=not args.no_extract, **options))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help=VERB_HELP["data"],
                                 description="Datasets: `longattn data download NAME ... --data-dir DIR`. Generated "
                                 "tasks (ListOps, Pathfinder) need no download.")
    sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    d = sub.add_parser("download", help="download datasets and verify their checksums",
                       description="Download each dataset into --data-dir and verify it (SHA-256 or MD5 where "
                       "published; the forecasting CSVs also by shape). A verified copy already there is kept.")
    d.add_argument("datasets", nargs="+", type=_dataset, metavar="NAME",
                   help=lambda: f"datasets: {', '.join(downloadable())}")
    add_data_dir_argument(d, required=True, help="the folder the datasets go into")
    add_list_argument(d, "--glue-tasks", names=glue_task_names, kind="GLUE task",
                      help="with glue: these tasks only (default: all eight)")
    d.add_argument("--base-url", help="mirror folder URL (file names are appended)")
    d.add_argument("--allow-unverified", action="store_true",
                   help="download archives that have no published checksum (lra_release, QQP, BBC, SCOPe)")
    d.add_argument("--no-extract", action="store_true", help="keep archives packed")
    d.set_defaults(func=_download)
