"""docs/reliability.md holds the counts of bad inputs the tests try, as tests/reliability_counts.py writes them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_in_the_docs_is_counted_from_the_tests(request):
    import reliability
    from reliability_counts import table_in

    doc = ROOT / "docs" / "reliability.md"
    if {str(path) for path in reliability.marked_files(ROOT)} <= getattr(request.config, "reliability_files", set()):
        # this session collected every marked test (the whole suite): count its marks
        expected = reliability.markdown(reliability.count(request.config.reliability_marks))
        assert table_in(doc) == expected, ("docs/reliability.md does not hold the counts of the tests; update it "
                                           "with python tests/reliability_counts.py --run --write docs/reliability.md")
        return
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "reliability_counts.py"), "--check", str(doc)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]


def test_silent_and_traceback_counts_are_zero():
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    total = next(line for line in text.splitlines() if line.startswith("| **total**"))
    cells = [cell.strip(" *") for cell in total.strip("|").split("|")]
    assert cells[-2:] == ["0", "0"], total


@pytest.mark.parametrize("outcome", ["clear error", "correct result"])
def test_a_mark_must_name_a_known_family_and_outcome(outcome):
    sys.path.insert(0, str(ROOT / "tests"))
    import reliability

    assert reliability.bad_input(reliability.GLUE, outcome).kwargs["outcome"] == outcome
    with pytest.raises(ValueError, match="unknown family"):
        reliability.bad_input("no such family", outcome)
    with pytest.raises(ValueError, match="outcome must be one of"):
        reliability.bad_input(reliability.GLUE, "fine")
