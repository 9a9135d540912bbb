"""Every time figure of the README and docs/, with the command that backs it.

    python scripts/time_claims.py                 # every claim: page:line, the figure, the command beside it
    python scripts/time_claims.py --unbacked      # only the figures no command backs (exit status 1 if any)
    python scripts/time_claims.py docs/hf.md      # some pages only

A figure is a number with a time unit (``5 min 26 s``, ``130 s``, ``3.8 hours``, ``0.24 ms``), also when a line
break falls inside it; it is backed when the same section (the text between two headings) names a command that
measures it: a ``longattn ...``, ``python ...`` or ``pytest ...`` line in a code block or a code span (which may
run over a line break), or one of the scripts/ of this repository. The backing shown is the command nearest to
the figure. A figure with no such command is to be measured by a command the page names, or removed
(tests/test_time_claims.py keeps every page fully backed).

What is not a figure: a rate (``21.4 steps/s``, ``3.35 TB/s``) and anything inside a code span. A code span is
verbatim text: a command with its options (``--budget-s 300``), a setting (``train.time_limit=600``), a message
or line the program prints, quoted to show its form, not a measurement the page reports. A time the page
claims is written as prose and needs its command (inside a code block every line is counted: a comment there
may claim a time).

Standard library only: it reads the pages as text.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A number (or a range of them) and a time unit; not a rate (steps/s, TB/s: a slash follows or precedes). The
# spaces may be a line break: a figure wrapped across two lines of a paragraph is still one figure.
FIGURE = re.compile(r"(?<![\w./])\d[\d,.]*(?:\s*(?:-|to)\s*\d[\d,.]*)?\s?(?:ms|s|seconds?|min|minutes?|h|hours?)"
                    r"(?:\s\d+\s?s)?\b(?![/.]\w)")
# A code span of a paragraph (it may run over a line break, never over a blank line)
CODE_SPAN = re.compile(r"`([^`]+)`")
# What measures: a command in a code span or a line of a code block
COMMAND = re.compile(r"(?:[A-Z_]+=\S+\s+)*(?:longattn|python|pytest|scripts/)")
LINE_COMMAND = re.compile(r"^\s*((?:[A-Z_]+=\S+\s+)*(?:longattn|python|pytest|scripts/)\s*\S.*)$")
HEADING = re.compile(r"^#{1,6}\s")


@dataclass(frozen=True)
class Claim:
    page: str
    line: int
    figure: str
    command: str | None  # the nearest command of its section, or None
    command_line: int | None

    def describe(self) -> str:
        where = f"{self.page}:{self.line}: {self.figure}"
        return f"{where}  <- line {self.command_line}: {self.command}" if self.command else f"{where}  UNBACKED"


def _sections(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line index of each section: a heading outside code blocks starts one."""
    starts, fenced = [0], False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and HEADING.match(line) and index:
            starts.append(index)
    return [(start, end - 1) for start, end in zip(starts, [*starts[1:], len(lines)])]


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _paragraph_items(lines: list[str], first: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(commands, figures) of the paragraph ``lines`` (its first line's index ``first``), each with the index of
    the line it starts on: commands from its code spans, figures from the text outside them."""
    text = "\n".join(lines)
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)

    def line_of(offset: int) -> int:
        return first + max(index for index, start in enumerate(starts) if start <= offset)

    commands = [(line_of(span.start()), _one_line(span[1])) for span in CODE_SPAN.finditer(text)
                if COMMAND.match(span[1].lstrip())]
    # a span's text is blanked (line breaks kept), so that no figure is read inside it
    prose = CODE_SPAN.sub(lambda span: re.sub(r"[^\n]", " ", span[0]), text)
    figures = [(line_of(match.start()), _one_line(match[0])) for match in FIGURE.finditer(prose)]
    return commands, figures


def page_claims(text: str, page: str) -> list[Claim]:
    """The time figures of one page, each with the nearest command of its section."""
    lines = text.splitlines()
    claims = []
    for first, last in _sections(lines):
        commands, figures, fenced, paragraph = [], [], False, []

        def end_paragraph() -> None:
            if paragraph:
                found = _paragraph_items([line for _, line in paragraph], paragraph[0][0])
                commands.extend(found[0])
                figures.extend(found[1])
                paragraph.clear()

        for index in range(first, last + 1):
            line = lines[index]
            if line.lstrip().startswith("```"):
                end_paragraph()
                fenced = not fenced
            elif fenced:  # a line of a code block: a command, or a comment or output whose figures count
                if LINE_COMMAND.match(line):
                    commands.append((index, LINE_COMMAND.match(line)[1].strip()))
                figures += [(index, match[0]) for match in FIGURE.finditer(line)]
            elif line.strip() and not HEADING.match(line):
                paragraph.append((index, line))
            else:
                end_paragraph()
                if HEADING.match(line):
                    figures += [(index, match[0]) for match in FIGURE.finditer(CODE_SPAN.sub("", line))]
        end_paragraph()
        for index, figure in figures:
            near = min(commands, key=lambda command: abs(command[0] - index), default=None)
            claims.append(Claim(page, index + 1, figure, near[1] if near else None, near[0] + 1 if near else None))
    return claims


def default_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="markdown pages (default: README.md and docs/)")
    parser.add_argument("--unbacked", action="store_true", help="only the figures that no command backs")
    args = parser.parse_args(argv)
    claims = [claim for page in args.pages or default_pages()
              for claim in page_claims(page.read_text(), str(page.resolve().relative_to(ROOT)
                                                             if page.resolve().is_relative_to(ROOT) else page))]
    unbacked = [claim for claim in claims if claim.command is None]
    for claim in unbacked if args.unbacked else claims:
        print(claim.describe())
    print(f"{len(claims)} time figures, {len(claims) - len(unbacked)} backed by a command of their section, "
          f"{len(unbacked)} unbacked")
    return 1 if args.unbacked and unbacked else 0


if __name__ == "__main__":
    sys.exit(main())
