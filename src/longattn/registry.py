"""One small registry of named things: attention mechanisms, models, tasks, analyses and benchmarks.

>>> from longattn.registry import Registry
>>> colours = Registry("colour")
>>> @colours.register("red")
... def red() -> str:
...     return "#f00"
>>> colours.get("red")()
'#f00'
>>> colours.names()
['red']

``get`` of an unknown name raises an error that names the valid ones (and the nearest, for typos), so
the command line can take its ``choices=`` from :meth:`Registry.names` and fail before any data is built.
A registry may name a ``package`` whose modules register its entries: they are imported the first
time the registry is read (fairseq's auto-import of its tasks), so nothing must remember to import them.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "RegistryError", "nearest", "signature_defaults"]


class RegistryError(KeyError):
    """An unknown or duplicate name. A ``KeyError`` whose message prints as written (not repr'd)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def nearest(name: str, valid: list[str] | tuple[str, ...] | set[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name (case aside: ``etm2`` finds ``ETTm2``), or ``""``."""
    lowered = {str(v).lower(): v for v in sorted(valid)}
    close = difflib.get_close_matches(str(name).lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


class Registry(Generic[T]):
    """Names to objects, with metadata per entry; see the module docstring."""

    def __init__(self, kind: str, package: str | None = None, error: type[Exception] = RegistryError) -> None:
        self.kind = kind
        self.package = package
        self.error = error
        self._entries: dict[str, T] = {}
        self._metadata: dict[str, dict[str, Any]] = {}
        self._loaded = package is None

    def register(self, name: str, obj: T | None = None, **metadata: Any) -> Any:
        """``@registry.register("name", key=value)`` as a decorator, or ``registry.register("name", obj)``."""

        def add(target: T) -> T:
            if name in self._entries and self._entries[name] is not target:
                raise self.error(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = target
            self._metadata[name] = dict(metadata)
            return target

        return add if obj is None else add(obj)

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        package = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")

    def get(self, name: str) -> T:
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            valid = self.names()
            raise self.error(
                f"unknown {self.kind} {name!r}{nearest(name, valid)}; valid: {', '.join(valid) or '(none)'}"
            ) from None

    def metadata(self, name: str) -> dict[str, Any]:
        self.get(name)
        return self._metadata[name]

    def names(self, **where: Any) -> list[str]:
        """Sorted names; ``names(family="forecaster")`` keeps the entries whose metadata match."""
        self._load()
        return sorted(n for n in self._entries if all(self._metadata[n].get(k) == v for k, v in where.items()))

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} entries)"


def signature_defaults(fn: Callable[..., Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword defaults of ``fn`` (a builder or a class): the one place a model's defaults are written."""
    target = fn.__init__ if isinstance(fn, type) else fn
    return {
        name: p.default
        for name, p in inspect.signature(target).parameters.items()
        if name not in ("self",) + skip and p.default is not inspect.Parameter.empty
    }
