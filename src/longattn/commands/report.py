"""``longattn report <what>``: tables and plots rebuilt from finished output folders, training nothing (the
entries of :data:`longattn.experiment.analyses.REPORTS`)."""

from __future__ import annotations

import argparse

from longattn.commands import VERB_HELP
from longattn.commands._args import EntryParser
from longattn.experiment.analyses import REPORTS


def register(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser("report", help=VERB_HELP["report"],
                                   description="Rebuild a table or plots from the runs finished in a folder "
                                   "(--run); nothing is trained.")
    sub = report.add_subparsers(dest="report_command", metavar="REPORT", required=True, parser_class=EntryParser)
    for name in REPORTS.names():
        entry = REPORTS.get(name)
        parser = sub.add_parser(name, help=entry.help, description=entry.help, add_arguments=entry.arguments)
        parser.set_defaults(func=entry.run)
