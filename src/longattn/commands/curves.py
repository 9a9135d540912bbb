"""``longattn report curves --run DIR``: learning curves of the runs in an existing output folder (compare, sweep,
a paper's grid, or one run): validation loss and metric against step and training time, one plot per task."""

from __future__ import annotations

import argparse
from pathlib import Path

from longattn.experiment.analyses import register_report


def _cmd(args: argparse.Namespace) -> int:
    from longattn.experiment.curves import groups_from_folder, write_learning_curves

    written = write_learning_curves(groups_from_folder(args.run), args.run)
    print((args.run / "curves.md").read_text())
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", type=Path, required=True, metavar="DIR",
                        help="output folder of compare, a paper's grid, ... or of one run (read; the curves are "
                        "written there)")


register_report("curves", "learning curves of the runs in a folder: every run's results.json under --run (runs "
                "that differ only in the seed averaged), written as curves.json, curves.md, curves_<task>.png",
                _arguments, _cmd)
