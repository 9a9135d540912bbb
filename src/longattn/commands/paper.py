"""``longattn paper``: the papers' tables and figures, one entry each (the entries of
:data:`longattn.experiment.analyses.PAPERS`). ``longattn paper`` alone lists them."""

from __future__ import annotations

import argparse

from longattn.commands import VERB_HELP
from longattn.commands._args import EntryParser
from longattn.experiment.analyses import PAPERS


def entries_table() -> str:
    """What ``longattn paper`` can reproduce: one line per entry, with its paper and table or figure."""
    entries = [PAPERS.get(name) for name in sorted(PAPERS.names())]
    width = max(len(entry.name) for entry in entries)
    return "\n".join(f"  {entry.name:<{width}}  {entry.paper} {entry.item}: {entry.help}" for entry in entries)


def _list(args: argparse.Namespace) -> int:
    print("The papers' tables and figures this command reproduces (`longattn paper NAME --help` for one):\n")
    print(entries_table())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    paper = subparsers.add_parser("paper", help=VERB_HELP["paper"],
                                  description="Each entry runs one table or figure of a paper with the "
                                  "paper's settings by default; `longattn paper` alone lists them.")
    sub = paper.add_subparsers(dest="paper_command", metavar="NAME", parser_class=EntryParser)
    for name in PAPERS.names():
        entry = PAPERS.get(name)
        parser = sub.add_parser(name, help=f"{entry.paper} {entry.item}: {entry.help}",
                                description=f"{entry.paper} {entry.item}: {entry.help}.", add_arguments=entry.arguments)
        parser.set_defaults(func=entry.run)
    paper.set_defaults(func=_list)
