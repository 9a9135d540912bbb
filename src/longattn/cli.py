"""The ``longattn`` command line.

Each module in :mod:`longattn.commands` adds one or more subcommands through a
``register(subparsers)`` function, so new experiments plug in without touching this file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import longattn.commands


def import_plugins() -> None:
    """Import the modules named in LONGATTN_PLUGINS (comma-separated): they register their own tasks,
    models or mechanisms, so a new task needs no edit to longattn."""
    for name in filter(None, (n.strip() for n in os.environ.get("LONGATTN_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f"LONGATTN_PLUGINS names {name!r}, which cannot be imported: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longattn", description="Efficient attention for long sequences: train, compare, benchmark."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(longattn.commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue  # shared helpers, not commands
        module = importlib.import_module(f"longattn.commands.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        import_plugins()
    except ValueError as err:
        print(f"longattn: error: {err}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as err:
        # User errors (bad config key, missing file, bad option) get one clear line, not a trace.
        print(f"longattn {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
