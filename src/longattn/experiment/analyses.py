"""The registries of ``longattn bench <name>`` (measurements) and ``longattn paper <name>`` (the papers' tables
and figures).

An analysis is a name, a one-line help, a function that adds its command-line arguments and a function
that runs it from the parsed arguments (writing JSON through :func:`longattn.experiment.results.write_results`,
a markdown table and, where people would rather look than read, a plot)::

    register_analysis("speed", "time and peak memory against sequence length", speed_arguments, run_speed)

A paper's table or figure is the same, with the paper and the table or figure it reproduces::

    register_paper("fsat-fig3", "FSAT", "Figure 3", "training time and memory per sequence against N",
                   fsat_fig3_arguments, run_fsat_fig3)

The shipped entries register themselves in the modules of :mod:`longattn.commands` (each module there is
imported by the command line, so a new entry is one new file); a plugin module named in ``LONGATTN_PLUGINS``
can add its own the same way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from longattn.config import ConfigError
from longattn.registry import Registry

__all__ = ["ANALYSES", "Analysis", "PAPERS", "PaperEntry", "REPORTS", "register_analysis", "register_paper",
           "register_report"]


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


# ``longattn report <name>``: tables and plots rebuilt from finished output folders (same shape as an analysis).
REPORTS: Registry[Analysis] = Registry("report", error=ConfigError)


def register_report(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None],
                    run: Callable[[argparse.Namespace], int]) -> Analysis:
    report = Analysis(name, help, arguments, run)
    REPORTS.register(name, report)
    return report


@dataclass(frozen=True)
class PaperEntry:
    """One table or figure of a paper that ``longattn paper <name>`` reproduces."""

    name: str
    paper: str
    item: str  # "Table 2", "Figure 3", ...
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


PAPERS: Registry[PaperEntry] = Registry("paper table or figure", error=ConfigError)


def register_paper(name: str, paper: str, item: str, help: str, arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], int]) -> PaperEntry:
    """``longattn paper NAME``: ``item`` of ``paper``, described by ``help``, with the command's arguments and
    runner (as :func:`register_analysis`)."""
    entry = PaperEntry(name, paper, item, help, arguments, run)
    PAPERS.register(name, entry)
    return entry
