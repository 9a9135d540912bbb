"""``longattn curves DIR``: learning curves of the runs in an existing output folder (compare, sweep, noise,
forecast-table, or one run): validation loss and metric against step and training time, one plot per task."""

from __future__ import annotations

import argparse
from pathlib import Path

from longattn.experiment.curves import groups_from_folder, write_learning_curves


def _cmd(args: argparse.Namespace) -> int:
    written = write_learning_curves(groups_from_folder(args.folder), args.folder)
    print((args.folder / "curves.md").read_text())
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("curves", help="learning curves of the runs in an output folder",
                              description="Read every run's results.json under FOLDER (runs that differ only in "
                              "the seed are averaged) and write curves.json, curves.md and curves_<task>.png there.")
    p.add_argument("folder", type=Path, help="output folder of compare, sweep, noise, ... or a run")
    p.set_defaults(func=_cmd)
