"""The table of bad inputs in docs/reliability.md, counted from the reliability marks of the tests.

    python tests/reliability_counts.py                          # print it (from the marks, nothing run)
    python tests/reliability_counts.py --run                    # run the marked tests: a failure counts as
                                                                # silent (a wrong result or no error) or traceback
    python tests/reliability_counts.py --run --write docs/reliability.md   # and put it into the docs
    python tests/reliability_counts.py --check docs/reliability.md         # exit 1 unless the docs hold it

See tests/reliability.py for the marks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # as `python -m pytest` from the checkout

import reliability  # noqa: E402


class _Marks:
    """A pytest plugin that keeps the marks of the collected items and, when they run, of the failed ones."""

    def __init__(self) -> None:
        self.marks: list[dict] = []
        self.by_id: dict[str, list[dict]] = {}
        self.failures: dict[str, list[dict]] = {"silent": [], "traceback": []}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            marks = reliability.item_marks(item)
            self.by_id[item.nodeid] = marks
            self.marks += marks

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed and report.when == "call":
            text = str(report.longrepr)
            # an assertion that failed (a result that differs, an error not raised): silent; anything else a traceback
            kind = "silent" if ("AssertionError" in text or "DID NOT RAISE" in text) else "traceback"
            self.failures[kind] += self.by_id.get(report.nodeid, [])


def collect(run: bool = False) -> dict[str, dict[str, int]]:
    plugin = _Marks()
    files = [str(path) for path in reliability.marked_files(ROOT)]
    arguments = ["-qq", "-p", "no:cacheprovider", *(["-m", "bad_input"] if run else ["--collect-only"]), *files]
    code = pytest.main(arguments, plugins=[plugin])
    if code not in (0, 1):  # 1: some tests failed, which the table counts
        raise SystemExit(f"pytest ended with exit code {code}")
    return reliability.count(plugin.marks, plugin.failures if run else None)


def table_in(doc: Path) -> str | None:
    text = doc.read_text(encoding="utf-8")
    if reliability.TABLE_BEGIN not in text or reliability.TABLE_END not in text:
        return None
    start = text.index(reliability.TABLE_BEGIN)
    return text[start:text.index(reliability.TABLE_END) + len(reliability.TABLE_END)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", action="store_true", help="run the marked tests and count their failures")
    parser.add_argument("--write", type=Path, help="replace the table in this markdown file")
    parser.add_argument("--check", type=Path, help="exit 1 unless this markdown file holds the table")
    args = parser.parse_args()
    table = reliability.markdown(collect(args.run))
    if args.check:
        found = table_in(args.check)
        if found != table:
            print(f"{args.check} does not hold the counts of the tests; update it with\n"
                  f"  python tests/reliability_counts.py --run --write {args.check}\nexpected:\n{table}\n"
                  f"found:\n{found}", file=sys.stderr)
            return 1
        return 0
    if args.write:
        text = args.write.read_text(encoding="utf-8")
        old = table_in(args.write)
        args.write.write_text(text.replace(old, table) if old else text.rstrip("\n") + "\n\n" + table + "\n",
                              encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
