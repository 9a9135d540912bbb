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
from longattn import __version__


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
    parser.add_argument("--version", action="version", version=f"longattn {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(longattn.commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue  # shared helpers, not commands
        try:
            module = importlib.import_module(f"longattn.commands.{info.name}")
        except ImportError as err:  # an optional package of the experiments is not installed
            _unavailable(subparsers, info.name, err)
            continue
        module.register(subparsers)
    return parser


def _unavailable(subparsers: argparse._SubParsersAction, name: str, err: ImportError) -> None:
    """A stand-in for a command whose module could not be imported: running it says why."""

    def fail(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError(f"{err}; the experiments need: pip install 'longattn[experiments]'")

    # every argument is taken as it comes (no options to parse), so that running it reaches fail()
    command = subparsers.add_parser(name, help=f"(unavailable: {err})", add_help=False, prefix_chars="\x00")
    command.add_argument("rest", nargs=argparse.REMAINDER)
    command.set_defaults(func=fail)


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
    except (ValueError, OSError, KeyError, ImportError) as err:
        # User errors (bad config key, missing or unwritable file, bad option) get one clear line, not a trace.
        print(f"longattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was saved stays (runs resume from their last checkpoint)
        print(f"longattn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
