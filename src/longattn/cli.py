"""The ``longattn`` command line: a few verbs, some with their own subcommands.

The modules named in :data:`VERBS` add the top-level verbs through their ``register(subparsers)``, in the order
``longattn --help`` lists them. Only the module of the verb that is run is imported (``longattn --help`` and
``--version`` import none: they list each verb's line of :data:`longattn.commands.VERB_HELP` and answer before
torch could load); for the verbs of :data:`PLUGGED_VERBS` every module of :mod:`longattn.commands` is
imported, so that a module that registers a ``bench``, ``paper`` or ``report`` entry plugs in by existing. The
command modules import torch and the experiments in the functions that run a command (an entry of ``bench``,
``paper`` or ``report`` adds its options when it is used: :class:`longattn.commands._args.EntryParser`), so
``longattn VERB --help`` answers without them, except where the help lists a registry's entries (``train``,
``pretrain``; tests/commands/test_cli_startup.py). The command names of earlier versions are kept in
:data:`ALIASES`: they still work and say, in one line, what replaced them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import longattn.commands
from longattn import __version__
from longattn.commands import VERB_HELP
from longattn.commands._args import HelpFormatter, note

# module of longattn.commands -> the verbs it registers, in the order of `longattn --help` (at most 10 verbs)
VERBS: dict[str, tuple[str, ...]] = {
    "train": ("train", "eval"),
    "compare": ("compare",),
    "bench": ("bench",),
    "report": ("report",),
    "paper": ("paper",),
    "data": ("data",),
    "demo": ("demo",),
    "transfer": ("pretrain", "finetune"),
}

# Earlier command names (a prefix of the arguments) -> what replaced them. The old form runs as the new one.
ALIASES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("forecast",): ("train", "--resume", "--task", "forecasting"),
    ("forecast-table",): ("paper", "sktformer-table2"),
    ("forecast-select",): ("compare", "settings"),
    ("forecast-download",): ("data", "download"),
    ("sweep",): ("compare", "sweep"),
    ("noise",): ("paper", "sktformer-table5"),
    ("crossval",): ("paper", "singularformer-table4"),
    ("table3",): ("paper", "sktformer-table3"),
    ("curves",): ("report", "curves", "--run"),
    ("bench", "fsat-fig3"): ("paper", "fsat-fig3"),
    ("bench", "thresholds"): ("paper", "singularformer-table3"),
    ("bench", "accuracy-cost"): ("paper", "singularformer-fig6"),
    ("bench", "rank-sweep"): ("paper", "singularformer-fig7"),
    ("bench", "attention-correlation"): ("paper", "singularformer-fig8"),
    ("bench", "lr-batch"): ("paper", "skeinformer-fig3"),
    ("bench", "incoherence"): ("paper", "s3-table14"),
}

# Verbs whose subcommands any module of longattn.commands may add (an entry registered on import).
PLUGGED_VERBS = frozenset({"bench", "paper", "report"})

# Verbs whose bare form runs one of their subcommands: `longattn compare` is `longattn compare mechanisms`.
DEFAULT_SUBCOMMANDS = {"compare": "mechanisms"}


def import_plugins() -> None:
    """Import the modules named in LONGATTN_PLUGINS (comma-separated): they register their own tasks,
    models or mechanisms, so a new task needs no edit to longattn."""
    for name in filter(None, (n.strip() for n in os.environ.get("LONGATTN_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f"LONGATTN_PLUGINS names {name!r}, which cannot be imported: {err}") from None


class Parser(argparse.ArgumentParser):
    """Every parser of the command line (subcommands inherit it): defaults shown in --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(verbs: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``verbs`` (None: every verb), each with its options; the other verbs are listed by their
    line of help only, and their modules are not imported."""
    parser = Parser(prog="longattn", description="Efficient attention for long sequences: train, compare, "
                    "benchmark, and reproduce the papers' tables. `longattn VERB --help` says more.")
    parser.add_argument("--version", action="version", version=f"longattn {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="VERB", required=True)
    wanted = {name for name, names in VERBS.items() if verbs is None or set(names) & set(verbs)}
    if wanted and (verbs is None or PLUGGED_VERBS & set(verbs)):
        wanted |= {info.name for info in pkgutil.iter_modules(longattn.commands.__path__)}
    modules, failed = {}, {}
    for name in sorted(wanted):
        try:  # with a plugged verb every module: those with entries (bench, paper) register them on import
            modules[name] = importlib.import_module(f"longattn.commands.{name}")
        except ImportError as err:  # an optional package of the experiments is not installed
            failed[name] = err
    for name, names in VERBS.items():
        if name in modules:
            modules[name].register(subparsers)
        elif name in failed:
            for verb in names:
                _unavailable(subparsers, verb, failed[name])
        else:
            for verb in names:  # listed in `longattn --help`; main() never parses a verb it did not import
                subparsers.add_parser(verb, help=VERB_HELP[verb], add_help=False)
    return parser


def _unavailable(subparsers: argparse._SubParsersAction, name: str, err: ImportError) -> None:
    """A stand-in for a command whose module could not be imported: running it says why."""

    def fail(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError(f"{err}; the experiments need: pip install 'longattn[experiments]'")

    # every argument is taken as it comes (no options to parse), so that running it reaches fail()
    command = subparsers.add_parser(name, help=f"(unavailable: {err})", add_help=False, prefix_chars="\x00")
    command.add_argument("rest", nargs=argparse.REMAINDER)
    command.set_defaults(func=fail)


def resolve_aliases(argv: list[str]) -> list[str]:
    """``argv`` in today's names: an old command name is replaced (with a note saying by what), and a verb
    with a default subcommand gets it when none is named."""
    for old, new in sorted(ALIASES.items(), key=lambda item: -len(item[0])):
        if tuple(argv[:len(old)]) == old:
            rest = argv[len(old):]
            if new[-1].startswith("--") and (not rest or rest[0].startswith("-")):
                new = new[:-1]  # `curves --help`: the option that takes the old positional has nothing to take
            note(f"`longattn {' '.join(old)}` is now `longattn {' '.join(new)}`; the old name still works")
            argv = [*new, *rest]
            break
    if argv and argv[0] in DEFAULT_SUBCOMMANDS:
        rest = argv[1:]
        if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help")):
            argv = [argv[0], DEFAULT_SUBCOMMANDS[argv[0]], *rest]
    return argv


def main(argv: list[str] | None = None) -> int:
    try:
        import_plugins()
    except ValueError as err:
        print(f"longattn: error: {err}", file=sys.stderr)
        return 2
    argv = resolve_aliases(list(sys.argv[1:] if argv is None else argv))
    verb = argv[0] if argv and argv[0] in VERB_HELP else None
    args = build_parser([verb] if verb else []).parse_args(argv)
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
