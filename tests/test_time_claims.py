"""Every time figure of the README and of every page of docs/ is backed by a command of its section
(scripts/time_claims.py lists them all with their commands)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("time_claims", ROOT / "scripts" / "time_claims.py")
time_claims = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("time_claims", time_claims)  # its dataclass looks its module up
_SPEC.loader.exec_module(time_claims)

# Every page the script reads (README.md and docs/, subfolders included): a new page is covered as it is added
PAGES = [str(page.relative_to(ROOT)) for page in time_claims.default_pages()]


def test_the_pages_include_the_readme_and_the_docs_subfolders():
    assert "README.md" in PAGES and "docs/hf.md" in PAGES
    assert any(page.count("/") > 1 for page in PAGES)  # docs/doccls/*.md, the generated tables


@pytest.mark.parametrize("page", PAGES)
def test_every_time_figure_names_the_command_that_measured_it(page):
    claims = time_claims.page_claims((ROOT / page).read_text(), page)
    unbacked = [claim.describe() for claim in claims if claim.command is None]
    assert not unbacked, "time figures without a command that measures them:\n" + "\n".join(unbacked)


def test_figures_and_their_commands_are_found_by_section():
    text = "\n".join([
        "# A", "The job took 5 min 26 s wall and 130 s of CPU; 21.4 steps/s and 3.35 TB/s are rates.",
        "```bash", "OMP_NUM_THREADS=1 longattn compare --out runs/c", "```",
        "## B", "A fine-tuning of about 40 s.",
        "## C", "Measured by `python scripts/time_claims.py`: 0.24 ms, and 1.5-3.3 hours.",
    ])
    claims = time_claims.page_claims(text, "page.md")
    assert [(c.line, c.figure, c.command) for c in claims] == [
        (2, "5 min 26 s", "OMP_NUM_THREADS=1 longattn compare --out runs/c"),
        (2, "130 s", "OMP_NUM_THREADS=1 longattn compare --out runs/c"),
        (7, "40 s", None),  # its section names no command
        (9, "0.24 ms", "python scripts/time_claims.py"),
        (9, "1.5-3.3 hours", "python scripts/time_claims.py"),
    ]
    assert time_claims.main(["--unbacked", str(ROOT / "docs" / "hf.md")]) == 0


def test_a_line_break_splits_neither_a_figure_nor_a_command():
    text = "\n".join([
        "# A", "The full set takes 10-15", "minutes to build.",
        "## B", "Measured with `longattn bench speed --lengths 16k", "--repeats 3`: 132.5 ms.",
        "", "A new paragraph: 4 s.",
    ])
    claims = time_claims.page_claims(text, "page.md")
    assert [(c.line, c.figure, c.command, c.command_line) for c in claims] == [
        (2, "10-15 minutes", None, None),
        (6, "132.5 ms", "longattn bench speed --lengths 16k --repeats 3", 5),
        (8, "4 s", "longattn bench speed --lengths 16k --repeats 3", 5),
    ]


def test_code_spans_are_verbatim_text_but_code_blocks_and_headings_are_read():
    text = "\n".join([
        "# A", "Every collective waits `LONGATTN_DIST_TIMEOUT_S` (default `900 s`), then prints `did not",
        "complete within 900 s`.",
        "```bash", "# this takes 3 minutes", "```",
        "## Measured in 5 s",
    ])
    claims = time_claims.page_claims(text, "page.md")
    assert [(c.line, c.figure) for c in claims] == [(5, "3 minutes"), (7, "5 s")]
