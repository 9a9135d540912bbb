"""The model registry: every model family (LRA classifiers, forecasters, and those to come) by name.

>>> from longattn.models.registry import build_model, model_names
>>> "dlinear" in model_names(family="forecaster")
True

A model is registered with its builder (a class or a function) and its family::

    @register_model("dlinear", family="forecaster")
    class DLinear(nn.Module):
        def __init__(self, channels: int, seq_len: int, pred_len: int, kernel_size: int = 25): ...

The builder's keyword defaults are the model's defaults (written nowhere else); :func:`build_model`
rejects options the builder does not take, naming the valid ones. Every module of
``longattn.models`` is imported the first time the registry is read, so a new model is one new file.

Family contracts:

* ``forecaster``: ``builder(channels, seq_len, pred_len, **options)``, forward ``(x [B, seq_len, C],
  marks [B, seq_len, M] or None) -> [B, pred_len, C]`` in the scaled units of the data.
* ``classifier``: ``builder(encoder_kwargs..., num_classes, ...)``, see :mod:`longattn.models.classifier`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from longattn.registry import Registry, nearest, signature_defaults

__all__ = ["MODELS", "build_model", "model_defaults", "model_names", "register_model"]

MODELS: Registry[Callable[..., nn.Module]] = Registry("model", package="longattn.models", error=ValueError)


def register_model(name: str, family: str, **metadata: Any) -> Callable[[Any], Any]:
    """Class/function decorator adding a model builder to :data:`MODELS` under ``family``."""
    return MODELS.register(name, family=family, **metadata)


def model_names(family: str | None = None) -> list[str]:
    return MODELS.names(family=family) if family else MODELS.names()


def model_family(name: str) -> str:
    return MODELS.metadata(name)["family"]


def _parameters(builder: Callable[..., nn.Module]) -> dict[str, inspect.Parameter]:
    target = builder.__init__ if isinstance(builder, type) else builder
    return {k: v for k, v in inspect.signature(target).parameters.items() if k != "self"}


def model_defaults(name: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword defaults of model ``name``'s builder (its one source of defaults)."""
    return signature_defaults(MODELS.get(name), skip)


def build_model(name: str, family: str | None = None, **kwargs: Any) -> nn.Module:
    """Build registered model ``name``; options the builder does not take raise a clear error."""
    if family is not None and name not in model_names(family):
        valid = model_names(family)
        raise ValueError(f"unknown {family} {name!r}{nearest(name, valid)}; valid: {', '.join(valid)}")
    builder = MODELS.get(name)
    params = _parameters(builder)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            valid = sorted(params)
            raise ValueError(
                f"unknown option(s) {unknown}{nearest(unknown[0], valid)} for model {name!r}; valid: {', '.join(valid)}"
            )
    return builder(**kwargs)
