"""The README's Python examples run as written."""

import contextlib
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


def readme_commands() -> list[str]:
    """Every ``longattn ...`` command line of the README: in code spans and in bash blocks (continuations joined)."""
    text = README.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        found += re.findall(r"\blongattn [^\n#&|;]*", re.sub(r"\\\s*\n\s*", " ", block))
    for span in re.findall(r"`([^`\n]*)`", text):
        found += re.findall(r"\blongattn [^`#&|;]*", span)
    return sorted({command.strip() for command in found if "..." not in command})


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_lines_parse(command, capsys):
    """Each command line parses as written (a bare `longattn VERB` names a command that exists)."""
    from longattn.cli import build_parser, resolve_aliases

    argv = resolve_aliases(command.split()[1:])
    capsys.readouterr()
    bare = all(not word.startswith("-") for word in argv)
    exits = bare or argv[-1] in ("--help", "--version")  # argparse prints and exits with 0
    with pytest.raises(SystemExit) if exits else contextlib.nullcontext() as stop:
        build_parser().parse_args([*argv, "--help"] if bare else argv)
    assert stop is None or stop.value.code == 0, capsys.readouterr().err
    assert "note:" not in capsys.readouterr().err  # no old spelling in the README


def test_readme_has_command_lines():
    commands = readme_commands()
    assert "longattn compare" in commands and len(commands) > 20
