"""Every time figure of the README and of the pages listed here is backed by a command of its section
(scripts/time_claims.py lists them all, backed or not, for every page of docs/)."""

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

# The pages a newcomer reads first: each time figure there names its command (the other pages are listed by
# `python scripts/time_claims.py --unbacked`, to be backed or removed)
BACKED_PAGES = ["README.md", "docs/hf.md"]


@pytest.mark.parametrize("page", BACKED_PAGES)
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
