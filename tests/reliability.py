"""The bad inputs and faults the reliability tests try, counted from the tests themselves.

A test (or one parametrised case of it) that feeds bad input or a fault to the library carries the mark
``bad_input(family, outcome, cases=1)``: ``family`` is a row of the table in docs/reliability.md, ``outcome``
what the test asserts the library does with it ("clear error": the library's own exception with a message
naming the file, line, key, option or rank; "correct result": the same result as without the fault, or the
documented one), ``cases`` how many distinct bad inputs the test tries. ``tests/reliability_counts.py``
collects the marked tests and writes (or checks) the table: nothing there is typed by hand.
"""

from __future__ import annotations

import pytest

CLEAR_ERROR, CORRECT_RESULT = "clear error", "correct result"
OUTCOMES = (CLEAR_ERROR, CORRECT_RESULT)

# The rows of the table in docs/reliability.md, in its order.
ATTENTION_PADDING = "attention: NaN / inf / 1e30 at padded positions, module form (every mechanism)"
ATTENTION_FUNCTIONAL = "attention: the same, functional forms, and queries of another length"
ATTENTION_DTYPE = "attention: input dtype other than the layer's (bf16, float64)"
ATTENTION_AUTOCAST = "attention: any input dtype under autocast"
ATTENTION_EMPTY = "attention: empty batch (B = 0)"
ATTENTION_FINITE = "attention: check_finite mode (NaN padded, inf real, inf without mask; functional)"
ARCHIVES = "data: archives and downloads (damaged, cut, wrong checksum, counts, crafted pickles)"
TIME_SERIES = "data: time-series CSV (order, duplicates, gaps, cells, line numbers)"
GLUE = "data: GLUE files (label column, scores, header)"
FOLDERS = "data: class folders and other readers (dangling links, unreadable files)"
TRAINING = "training: non-finite loss or weights, folder in use, damaged or crafted checkpoints, hung rank"
RESUME = "training: resume after damage, kill, full disk or a torn log (one process and 2-process DDP)"
OUTPUT_FOLDERS = "output folders: a finished or interrupted run, a grid's cells (train, compare, sweep, ...)"
FOREIGN_WEIGHTS = "another run's checkpoint, damaged safetensors, a config that no longer matches"
SEQUENCE_PARALLEL = "sequence parallelism: ranks with mismatched inputs, a rank that does not answer"
FAMILIES = (ATTENTION_PADDING, ATTENTION_FUNCTIONAL, ATTENTION_DTYPE, ATTENTION_AUTOCAST, ATTENTION_EMPTY,
            ATTENTION_FINITE, ARCHIVES, TIME_SERIES, GLUE, FOLDERS, TRAINING, RESUME, OUTPUT_FOLDERS,
            FOREIGN_WEIGHTS, SEQUENCE_PARALLEL)


def bad_input(family: str, outcome: str, cases: int = 1) -> pytest.MarkDecorator:
    """The mark of a reliability test: ``cases`` bad inputs of ``family``, each giving ``outcome``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: add it to tests/reliability.py FAMILIES")
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    if cases < 1:
        raise ValueError(f"cases must be at least 1, got {cases}")
    return pytest.mark.bad_input(family=family, outcome=outcome, cases=cases)


def cases(family: str, outcome: str, values: dict, *, count: int = 1) -> list:
    """``values`` ({id: value, or a tuple of values}) as pytest params, each marked as ``count`` bad input(s)
    of ``family``."""
    return [pytest.param(*(value if isinstance(value, tuple) else (value,)), id=key,
                         marks=bad_input(family, outcome, count)) for key, value in values.items()]
