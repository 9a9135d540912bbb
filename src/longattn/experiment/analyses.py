"""The registry of benchmarks and analyses: ``longattn bench <name>`` for every registered entry.

An analysis is a name, a one-line help, a function that adds its command-line arguments and a function
that runs it from the parsed arguments (writing JSON through :func:`longattn.experiment.results.write_results`,
a markdown table and, where people would rather look than read, a plot)::

    register_analysis("speed", "time and peak memory against sequence length", speed_arguments, run_speed)

The shipped benchmarks register themselves in :mod:`longattn.commands.bench`; a plugin module named in
``LONGATTN_PLUGINS`` can add its own the same way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from longattn.config import ConfigError
from longattn.registry import Registry

__all__ = ["ANALYSES", "Analysis", "register_analysis"]


@dataclass(frozen=True)
class Analysis:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


ANALYSES: Registry[Analysis] = Registry("analysis", error=ConfigError)


def register_analysis(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None],
                      run: Callable[[argparse.Namespace], int]) -> Analysis:
    analysis = Analysis(name, help, arguments, run)
    ANALYSES.register(name, analysis)
    return analysis
