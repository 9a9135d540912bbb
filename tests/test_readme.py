"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


def test_readme_examples_run(capsys):
    namespace: dict = {}
    for block in BLOCKS:  # later blocks may use names from earlier ones, as a reader would
        exec(compile(block, str(README), "exec"), namespace)
    assert "skeleton" in capsys.readouterr().out


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\((docs/[^)]+)\)", README.read_text()))))
def test_readme_links_exist(link):
    path, _, anchor = link.partition("#")
    assert (README.parent / path).is_file(), path
    if anchor:  # a section of the page: one of its headings
        headings = re.findall(r"^#+ (.+)$", (README.parent / path).read_text(), flags=re.M)
        assert anchor in {heading_anchor(h) for h in headings}, link


def test_heading_anchor():
    assert heading_anchor("Grids") == "grids"
    assert heading_anchor("Table 2 / 16 with 5 seeds on CPU (issue 17; what was measured)") == \
        "table-2--16-with-5-seeds-on-cpu-issue-17-what-was-measured"
