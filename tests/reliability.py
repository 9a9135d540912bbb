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
DECODING = ("decoding: a state from another layer, mechanism, batch, head count, dtype or device, bad select / repeat "
            "arguments, a transformers cache passed between converted models")
PACKING = ("packing: cu_seqlens as floats, a list, 2-D, not from 0, not rising, short, crossing a row; a mask of "
           "another shape (module form, functional form, bridge)")
ARCHIVES = "data: archives and downloads (damaged, cut, wrong checksum, counts, crafted pickles)"
TIME_SERIES = "data: time-series CSV (order, duplicates, gaps, cells, line numbers)"
GLUE = "data: GLUE files (label column, scores, header)"
FOLDERS = "data: class folders (dangling links in BBC, 20 Newsgroups, IMDb, image folders)"
OTHER_READERS = ("files of other readers: YAML configs, saved run configs, summaries, MIMIC-III CSV, ListOps tsv, "
                 "dataset cache")
TRAINING = ("training: non-finite loss or weights, folder in use, damaged or crafted checkpoints, hung rank, ranks "
            "started with other settings")
RESUME = "training: resume after damage, kill, full disk or a torn log (one process and 2-process DDP)"
OUTPUT_FOLDERS = "output folders: a finished or interrupted run, a grid's cells (train, compare, sweep, ...)"
FOREIGN_WEIGHTS = "another run's checkpoint, damaged safetensors, a config that no longer matches"
SP_LENGTHS = ("sequence parallelism: a length N (1-70) that 2, 3 or 4 ranks do not divide, each on every form, "
              "padding included")
SEQUENCE_PARALLEL = "sequence parallelism: ranks with mismatched inputs, a rank that does not answer"
COMPILE = ("torch.compile: a training step of every mechanism under each declared backend, bidirectional and "
           "causal; a mechanism that declares none")
FAMILIES = (ATTENTION_PADDING, ATTENTION_FUNCTIONAL, ATTENTION_DTYPE, ATTENTION_AUTOCAST, ATTENTION_EMPTY,
            ATTENTION_FINITE, DECODING, PACKING, ARCHIVES, TIME_SERIES, GLUE, FOLDERS, OTHER_READERS, TRAINING, RESUME, OUTPUT_FOLDERS,
            FOREIGN_WEIGHTS, SP_LENGTHS, SEQUENCE_PARALLEL, COMPILE)


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


# ----------------------------------------------------------------------------- counting (docs/reliability.md)

TABLE_BEGIN = "<!-- bad-input counts: written by tests/reliability_counts.py; do not edit by hand -->"
TABLE_END = "<!-- end of bad-input counts -->"
COLUMNS = ("bad inputs and faults tried", CLEAR_ERROR + "s", CORRECT_RESULT + "s", "silent wrong results", "tracebacks")


def marked_files(root) -> list:
    """The test files that carry reliability marks (those that import this module)."""
    return sorted(path for path in (root / "tests").rglob("test_*.py")
                  if "from reliability import" in path.read_text(encoding="utf-8"))


def item_marks(item) -> list[dict]:
    """The ``bad_input`` marks of a collected test item (one per kind of outcome it asserts)."""
    return [dict(mark.kwargs) for mark in item.iter_markers("bad_input")]


def count(marks: list[dict], failures: dict[str, list[dict]] | None = None) -> dict[str, dict[str, int]]:
    """{family: {column: number}} from the marks of the collected items; ``failures``: the marks of the items
    whose test failed, by kind ("silent" or "traceback"), from a run (see reliability_counts.py --run)."""
    table = {family: dict.fromkeys(COLUMNS, 0) for family in FAMILIES}
    for mark in marks:
        row = table[mark["family"]]
        row[COLUMNS[0]] += mark.get("cases", 1)
        row[mark["outcome"] + "s"] += mark.get("cases", 1)
    for kind, column in (("silent", COLUMNS[3]), ("traceback", COLUMNS[4])):
        for mark in (failures or {}).get(kind, []):
            row = table[mark["family"]]
            row[column] += mark.get("cases", 1)
            row[mark["outcome"] + "s"] -= mark.get("cases", 1)
    return {family: row for family, row in table.items() if row[COLUMNS[0]]}


def markdown(table: dict[str, dict[str, int]]) -> str:
    rows = [["family", *COLUMNS]] + [[family, *map(str, row.values())] for family, row in table.items()]
    total = ["**total**", *(f"**{sum(row[c] for row in table.values())}**" for c in COLUMNS)]
    rows.append(total)
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(COLUMNS + ("",)))
    return "\n".join([TABLE_BEGIN, *lines, TABLE_END])
