"""The typed config core: dataclasses with strict keys, one ``--set`` grammar, YAML files, stacking.

A config is a tree of standard-library dataclasses; each default is written once, as a field default.
Files and command-line overrides are plain nested mappings that are merged in order and then
turned into the dataclasses by :func:`from_dict`, which

* rejects a key the dataclass does not have, naming the nearest valid key;
* checks each value against the field's type (``int``, ``float``, ``bool``, ``str``, ``X | None``,
  ``Literal[...]``, lists, tuples, nested dataclasses; ``dict`` fields are free-form sections whose
  keys another component validates) and its constraints (:func:`option`: ``gt``, ``ge``, ``le``,
  ``choices``), so ``clip_norm=-1`` or ``lr=inf`` never reach training.

Why not a library: Hydra takes over argv, the working directory and the output folders (which fights
``torchrun -m longattn.cli`` and tests that call ``main([...])``); OmegaConf's structured configs
would do, but the few checks above fit in this file and keep the dependency list short.

>>> from dataclasses import dataclass
>>> @dataclass
... class Optim:
...     lr: float = option(1e-4, gt=0)
>>> from_dict(Optim, merge(to_dict(Optim()), parse_set("lr=3e-4"))).lr
0.0003
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from longattn.registry import nearest
from longattn.utils import optional_import, write_text_atomic

__all__ = [
    "ConfigError",
    "config_hash",
    "check_value",
    "from_dict",
    "merge",
    "option",
    "parse_set",
    "parse_value",
    "read_yaml",
    "set_path",
    "to_dict",
    "write_yaml",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override names an unknown key or holds a value of the wrong kind."""


def option(default: Any = dataclasses.MISSING, *, gt: float | None = None, ge: float | None = None,
           le: float | None = None, lt: float | None = None, choices: tuple[Any, ...] | None = None, help: str = "",
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with constraints that :func:`from_dict` checks (and a help text)."""
    metadata = {"gt": gt, "ge": ge, "le": le, "lt": lt, "choices": choices, "help": help}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------- text -> values


def _loader() -> Any:
    """yaml's SafeLoader, except that a mapping naming a key twice is an error (SafeLoader keeps the last value
    without a word: ``optim: {lr: 1e-3}`` written twice would silently train with the second)."""
    yaml = optional_import("yaml")  # the experiments extra; the library itself needs only torch and numpy

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            self.flatten_mapping(node)
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice in one mapping (first on line {seen[key].line + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                    lambda loader, node: loader.construct_mapping(node))
    return UniqueKeyLoader


def _load_yaml(text: str) -> Any:
    return optional_import("yaml").load(text, Loader=_loader())


def parse_value(text: str) -> Any:
    """A ``--set`` value: YAML (``3``, ``true``, ``[1, 2]``, ``{a: 1}``, ``null``), ``1e-4`` read as a number."""
    yaml = optional_import("yaml")  # the experiments extra; the library itself needs only torch and numpy

    try:
        value = _load_yaml(text) if text.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot read value {text!r}: {_yaml_problem(err)}") from None
    return _fix_floats(value)


def _fix_floats(node: Any) -> Any:
    # YAML 1.1 reads "1e-4" as a string (it wants "1.0e-4"); users mean a number.
    if isinstance(node, dict):
        return {k: _fix_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_floats(v) for v in node]
    if isinstance(node, str):
        try:
            return float(node)  # also "inf" and "nan": the field's check then says what is wrong
        except ValueError:
            return node
    return node


def parse_set(text: str) -> dict[str, Any]:
    """``"optim.lr=3e-4"`` -> ``{"optim": {"lr": 0.0003}}``: the one ``--set`` grammar of every command."""
    key, equals, raw = text.partition("=")
    parts = key.strip().split(".")
    if not equals or not all(p.strip() for p in parts):
        raise ConfigError(f"--set {text!r} must look like section.key=value (e.g. optim.lr=3e-4)")
    nested: dict[str, Any] = {}
    set_path(nested, parts, parse_value(raw))
    return nested


def set_path(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(parts)}: {part!r} is not a section")
    node[parts[-1]] = value


def _yaml_problem(err: Exception) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else str(problem)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from ``path``; a missing file or bad YAML is a one-line :class:`ConfigError`."""
    yaml = optional_import("yaml")

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        data = _load_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return _fix_floats(data)


def write_yaml(tree: dict[str, Any], path: str | Path) -> None:
    yaml = optional_import("yaml")

    write_text_atomic(path, yaml.safe_dump(tree, sort_keys=False))  # never half a config (a kill, a full disk)


# ----------------------------------------------------------------------------- trees


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of plain mappings (``update`` wins); key checking is :func:`from_dict`'s job."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain mappings/lists (tuples become lists, as in YAML)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def config_hash(obj: Any) -> str:
    """A short stable hash of a config (dataclass tree or mapping): equal settings, equal hash."""
    text = json.dumps(to_dict(obj), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, strictly (see the module docstring)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        path = f"{where}.{key}" if where else str(key)
        raise ConfigError(
            f"unknown config key {path!r}{nearest(str(key), list(fields))}; "
            f"valid keys{' in ' + where if where else ''}: {', '.join(fields)}"
        )
    values = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        values[name] = _check_field(fields[name], hints[name], value, path)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where or 'config'}: {err}") from None


def _check_field(f: dataclasses.Field, hint: Any, value: Any, path: str) -> Any:
    value = _coerce(hint, value, path)
    meta = f.metadata
    if value is None or isinstance(value, (bool, str, list, dict, tuple)) and not meta.get("choices"):
        return value
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{path} must be one of {', '.join(map(str, choices))}; got {value!r}{nearest(str(value), [str(c) for c in choices])}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for bound, ok, words in (("gt", lambda v, b: v > b, "> "), ("ge", lambda v, b: v >= b, ">= "),
                                 ("le", lambda v, b: v <= b, "<= "), ("lt", lambda v, b: v < b, "< ")):
            limit = meta.get(bound)
            if limit is not None and not ok(value, limit):
                raise ConfigError(f"{path} must be {words}{limit}, got {value!r}")
    return value


def check_value(hint: Any, value: Any, path: str) -> Any:
    """``value`` checked against a type hint (as for a dataclass field); returns it coerced (int 3.0 -> 3)."""
    return _coerce(hint, value, path)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path} may not be null")
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {hint}")
    if value is None:
        raise ConfigError(f"{path} may not be null")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path} must be one of {', '.join(map(str, args))}; got {value!r}{nearest(str(value), [str(a) for a in args])}")
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {value!r}")
        return value
    if hint is int:
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole:
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{path} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path} must have {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or hint is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        if args and args[1] is not Any:
            return {k: _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
        return dict(value)
    return value
