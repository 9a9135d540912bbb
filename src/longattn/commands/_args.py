"""The one grammar of the ``longattn`` command line, shared by every command.

* Lists are space-separated, ``--attentions softmax skeleton --seeds 0 1 2``; commas are accepted too
  (``--seeds 0,1,2``), so both spellings work everywhere (:func:`add_list_argument`).
* A name is checked against its registry when the command line is read, with the nearest valid name for a typo
  (``unknown mechanism 'skeletn' (did you mean 'skeleton'?)``): :func:`name_type`, :func:`add_list_argument`.
* The data folder is always ``--data-dir`` (:func:`add_data_dir_argument`); ``--out`` is always the folder a
  command writes, ``--run`` the folder it reads. Older spellings stay as hidden aliases that say what replaced
  them (:func:`deprecated_alias`).
* Every option shows its default in ``--help`` (:class:`HelpFormatter`).
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Iterable
from typing import Any

from longattn.registry import nearest
from longattn.utils import note

__all__ = ["EntryParser", "HelpFormatter", "ListAction", "add_config_arguments", "add_data_dir_argument", "add_list_argument",
           "add_renamed_argument", "add_run_arguments", "add_set_argument", "add_workers_argument", "attention_names", "deprecated_alias",
           "glue_task_names", "help_text", "length", "name_type", "no_progress", "note", "preset_help", "task_data_dirs", "task_names"]

Names = Callable[[], Iterable[str]]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with every option's default shown (lists space-separated, as they are typed); an option
    whose help already says what its default is, or that has none (None, off), is left as written.

    A help given as a callable is called when the help is printed: a text that names a registry's entries
    (tasks, mechanisms) imports them, and torch with them, only for the --help that shows it."""

    def _format_action(self, action: argparse.Action) -> str:
        return super()._format_action(_resolved(action))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = _resolved(action).help or ""
        default = action.default
        # a switch (--no-X stores False; its default True would read as if skipping were the default) says in
        # its own help what happens without it
        if (default in (None, False, argparse.SUPPRESS) or default == [] or "default" in text.lower()
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
                or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        old = getattr(action, "old_spellings", ())
        if old:  # an option's earlier spellings still work but are not advertised
            action = copy.copy(action)
            action.option_strings = [flag for flag in action.option_strings if flag not in old]
        return super()._format_action_invocation(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, (list, tuple)) and action.default:
            action = copy.copy(action)
            action.default = " ".join(map(str, action.default))
        return super()._expand_help(action)


class EntryParser(argparse.ArgumentParser):
    """The parser of one entry of a registry of subcommands (``bench NAME``, ``paper NAME``, ``report NAME``),
    made with ``add_subparsers(parser_class=EntryParser)`` and ``add_parser(..., add_arguments=fn)``: ``fn`` adds
    its options when this entry parses or prints its help, not when the tree is built. The defaults of an entry's
    options come from its own modules (torch, for most); ``longattn bench --help`` lists the entries without them."""

    def __init__(self, *args: Any, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    def complete(self) -> "EntryParser":
        """This parser with its entry's options added (once)."""
        add, self._add_arguments = self._add_arguments, None
        if add is not None:
            add(self)
        return self

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.complete()
        return super().format_usage()

    def format_help(self) -> str:
        self.complete()
        return super().format_help()


def _resolved(action: argparse.Action) -> argparse.Action:
    """``action`` with a callable help replaced by its text (a copy; the parser keeps the callable)."""
    if not callable(action.help):
        return action
    action = copy.copy(action)
    action.help = action.help()
    return action


def help_text(action: argparse.Action) -> str | None:
    """The help of ``action`` as printed (a callable help called)."""
    return _resolved(action).help


def _check_names(kind: str, values: list[str], names: Names | None) -> str | None:
    """The error for the first of ``values`` that is not among ``names()``, or None."""
    if names is None:
        return None
    valid = list(names())
    for value in values:
        if value not in valid:
            return f"unknown {kind} {value!r}{nearest(value, valid)}; valid: {', '.join(valid)}"
    return None


def name_type(kind: str, names: Names) -> Callable[[str], str]:
    """An argparse ``type`` that accepts one of ``names()`` and names the nearest valid one for a typo."""

    def check(text: str) -> str:
        error = _check_names(kind, [text], names)
        if error:
            raise argparse.ArgumentTypeError(error)
        return text

    check.__name__ = kind  # argparse names the type in some messages
    return check


def length(text: str) -> int:
    """A whole number with an optional k (x1024) or m (x1024^2) suffix: 4096, 4k, 1m."""
    units = {"k": 1024, "m": 1024 * 1024}
    part = text.strip().lower()
    try:
        return int(part[:-1]) * units[part[-1]] if part and part[-1] in units else int(part)
    except ValueError:
        raise ValueError(f"expected a whole number (k and m suffixes allowed), got {text!r}") from None


class ListAction(argparse.Action):
    """``nargs="+"`` whose items may also be comma-separated (``a b``, ``a,b`` and ``a, b`` are one list);
    each item converted by ``item`` and, given ``names``, checked against them with a nearest-name hint.
    Given twice, the option's lists add up."""

    def __init__(self, option_strings: list[str], dest: str, *, item: Callable[[str], Any] = str,
                 names: Names | None = None, kind: str = "value", **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "+")
        super().__init__(option_strings, dest, **kwargs)
        self.item, self.names, self.kind = item, names, kind

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        texts = [part.strip() for value in values for part in str(value).split(",") if part.strip()]
        if not texts:
            raise argparse.ArgumentError(self, "expected at least one value")
        error = _check_names(self.kind, texts, self.names)
        if error:
            raise argparse.ArgumentError(self, error)
        try:
            items = [self.item(text) for text in texts]
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentError(self, str(err)) from None
        seen = getattr(namespace, "_lists_given", set())
        previous = getattr(namespace, self.dest, None) if self.dest in seen else None
        setattr(namespace, "_lists_given", seen | {self.dest})
        setattr(namespace, self.dest, [*(previous or []), *items])


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


ITEM_TYPES: dict[Any, Callable[[str], Any]] = {int: _whole, float: _number, "length": length}


def add_list_argument(parser: argparse.ArgumentParser, *flags: str, item: Any = str, names: Names | None = None,
                      kind: str = "value", **kwargs: Any) -> argparse.Action:
    """A list option in the one list syntax: ``--flag a b c`` (commas accepted: ``--flag a,b,c``). ``item``:
    str, int, float or "length" (k/m suffixes); ``names``: the valid names, for the nearest-name hint."""
    kwargs.setdefault("metavar", kind.upper().replace(" ", "_"))
    return parser.add_argument(*flags, action=ListAction, item=ITEM_TYPES.get(item, item), names=names, kind=kind,
                               **kwargs)


def task_names(family: str | None = None) -> list[str]:
    """The registered tasks (of ``family``), read when a name is checked or a help text printed."""
    from longattn.tasks.base import task_names as registered

    return registered(family) if family else registered()


def attention_names() -> list[str]:
    from longattn import attention

    return attention.available()


def glue_task_names() -> list[str]:
    from longattn.data.glue import GLUE_TASKS

    return GLUE_TASKS.names()


def add_attentions_argument(parser: argparse.ArgumentParser, help: str, **kwargs: Any) -> argparse.Action:
    """``--attentions`` (also ``--attention``): registered mechanisms, checked with the nearest-name hint."""
    return add_list_argument(parser, "--attentions", "--attention", dest="attentions", names=attention_names,
                             kind="mechanism", help=help, **kwargs)


def add_set_argument(parser: argparse.ArgumentParser, dest: str = "overrides",
                     help: str = "override config values, e.g. --set optim.lr=3e-4 train.max_steps=100 "
                     "(repeatable)") -> argparse.Action:
    """``--set KEY=VALUE [KEY=VALUE ...]`` (repeatable): config overrides, in order (a later one wins)."""
    return parser.add_argument("--set", dest=dest, nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                               help=help)


class _Renamed(argparse._StoreAction):
    """A stored option with earlier spellings: they still work, say once what replaced them, and are not shown
    in --help."""

    def __init__(self, option_strings: list[str], dest: str, *, old_spellings: tuple[str, ...] = (),
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.old_spellings = old_spellings

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string in self.old_spellings:
            note(f"{option_string} is now {self.option_strings[0]}; the old spelling still works")
        super().__call__(parser, namespace, values, option_string)


def add_renamed_argument(parser: argparse.ArgumentParser, flag: str, *old: str, **kwargs: Any) -> argparse.Action:
    """Option ``flag`` that also takes its earlier spellings ``old`` (each use of one prints what replaced it)."""
    return parser.add_argument(flag, *old, action=_Renamed, old_spellings=old, **kwargs)


class _DeprecatedAlias(argparse.Action):
    """An old option spelling: says once what replaced it, then does what the new one does."""

    def __init__(self, option_strings: list[str], dest: str, *, replacement: str, store: Callable[..., Any],
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.replacement, self.store = replacement, store

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        note(f"{option_string} is now {self.replacement}; the old spelling still works")
        self.store(namespace, values)


def deprecated_alias(parser: argparse.ArgumentParser, flag: str, replacement: str, dest: str, *,
                     transform: Callable[[Any], Any] = lambda value: value, append: bool = False,
                     nargs: Any = None) -> argparse.Action:
    """Hidden ``flag`` that prints "FLAG is now REPLACEMENT" and stores ``transform(value)`` into ``dest``
    (appended to its list with ``append``); ``nargs=0`` for a switch."""

    def store(namespace: argparse.Namespace, value: Any) -> None:
        value = transform(value)
        if append:
            value = [*(getattr(namespace, dest, None) or []), value]
        setattr(namespace, dest, value)

    return parser.add_argument(flag, dest=f"_alias_{flag.strip('-').replace('-', '_')}", action=_DeprecatedAlias,
                               replacement=replacement, store=store, nargs=nargs, default=argparse.SUPPRESS)


def add_data_dir_argument(parser: argparse.ArgumentParser, help: str, *old: str, **kwargs: Any) -> argparse.Action:
    """``--data-dir``: the one name of the data-folder option (``old``: earlier spellings it replaces).

    The folder is made absolute: runs record it in their config, and the same data reached from another working
    directory (``../data`` here, ``/home/me/data`` there) must not count as another configuration on ``--resume``."""
    kwargs.setdefault("type", absolute_path)
    return add_renamed_argument(parser, "--data-dir", *old, metavar=kwargs.pop("metavar", "DIR"), help=help, **kwargs)


def absolute_path(text: str) -> str:
    """``text`` as an absolute path (``~`` expanded, symbolic links kept)."""
    return os.path.abspath(os.path.expanduser(text))


def task_data_dirs(pairs: list[str], keys: list[str], what: str = "task") -> dict[str, str]:
    """``--data-dir KEY=PATH ...`` -> {key: path}, for a command whose runs read several data folders."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, path = pair.partition("=")
        if not sep or not path or key not in keys:
            raise ValueError(f"--data-dir takes {what.upper()}=PATH for {' or '.join(keys)}, got {pair!r}"
                             f"{nearest(key, keys) if sep else ''}")
        out[key] = absolute_path(path)
    return out


def preset_help(tasks: list[str] | None = None) -> str:
    """The ``--preset`` help: the shipped preset names of each task (all tasks when ``tasks`` is None)."""
    from longattn.tasks.base import get_task, task_names

    groups: dict[tuple[str, ...], list[str]] = {}
    for name in tasks or task_names():
        groups.setdefault(tuple(get_task(name).presets()), []).append(name)
    listed = "; ".join(f"{', '.join(names)}: {', '.join(presets) or '(none)'}" for presets, names in groups.items())
    if tasks is not None and len(tasks) == 1:
        listed = ", ".join(get_task(tasks[0]).presets())
        return f"shipped preset ({listed}) or a YAML file; the config file and --set are applied after it"
    return f"shipped preset of the task ({listed}) or a YAML file; the config file and --set are applied after it"


def add_config_arguments(parser: argparse.ArgumentParser, tasks: list[str] | None = None) -> None:
    """--config / --preset / --set: the layers of a run config (see longattn.experiment.config)."""
    parser.add_argument("--config", help="YAML config file (applied after the preset)")
    parser.add_argument("--preset", help=lambda: preset_help(tasks))
    add_set_argument(parser)


def add_run_arguments(parser: argparse.ArgumentParser, *, task_required: bool = True) -> None:
    """--task / --model / --attention with their names checked against the registries (read when a name is
    checked or this help printed)."""
    parser.add_argument("--task", required=task_required, type=name_type("task", task_names), metavar="TASK",
                        help=lambda: f"registered task: {', '.join(task_names())}")
    parser.add_argument("--model", dest="model_name", metavar="MODEL",
                        help="registered model of the task's family (default: the task's)")
    parser.add_argument("--attention", type=name_type("mechanism", attention_names), metavar="MECHANISM",
                        help=lambda: "registered mechanism (default: the config's, else the model's): "
                        f"{', '.join(attention_names())}")


def add_workers_argument(parser: argparse.ArgumentParser) -> None:
    """--workers: how many of a grid's runs train at once (longattn.experiment.workers); not given (None), the
    thread policy chooses (longattn.experiment.threads)."""
    parser.add_argument("--workers", type=_positive_int, metavar="N",
                        help="train N runs at once, each in its own process with an even share of the threads "
                        "(OMP_NUM_THREADS, else the cores this process is given); each run's output then goes to "
                        "log.txt in its folder (default: one run per core, one thread each; 1 on one core, "
                        "output here; the first line printed says the choice)")


def add_resume_argument(parser: argparse.ArgumentParser,
                        help: str = "reuse finished runs in --out and resume interrupted ones") -> None:
    """--resume and --overwrite (one or the other): what happens to runs already in --out. With neither, a
    command refuses an --out that holds runs (longattn.train.outputs.check_output_folder)."""
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--resume", action="store_true", help=help)
    add_overwrite_argument(choice)


def add_overwrite_argument(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    """--overwrite alone: for the commands that always resume (the forecasting grids)."""
    parser.add_argument("--overwrite", action="store_true",
                        help="train again, replacing the runs already in --out (finished ones too)")


def add_no_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while training")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def no_progress(args: Any) -> list[str]:
    """``--set`` overrides, with the progress bar switched off for ``--no-progress``."""
    return list(args.overrides) + (["train.progress=false"] if getattr(args, "no_progress", False) else [])
