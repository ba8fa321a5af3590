"""Check that the user-facing pages speak about the software as it is.

    python -m tools.voice [PAGE ...]

A user page (``README.md`` and ``docs/**/*.md`` except the contributor pages) must not read
like a lab notebook: no commit hashes, no "issue" (the history of the project's making),
no "development machine" or "this machine" (a figure names its hardware), no "this
session", no "not met", no test files (test
internals belong on the contributor pages); and no page is
longer than :data:`MAX_LINES` lines (split it). Prints each finding as ``path:line: what``
and exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

MAX_LINES = 400
CONTRIBUTOR_PAGES = {"docs/contributing.md", "docs/architecture.md"}
"""Pages for people working on streamrft itself: test internals and history belong there."""
MARKERS = {
    "a commit hash": re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b"),
    "an issue of the project": re.compile(r"\bissues?\b", re.IGNORECASE),
    "'development machine' or 'this machine' (name the hardware)": re.compile(
        r"\b(development|this) machine", re.IGNORECASE
    ),
    "'this session' or 'an earlier session' (the history of the project's making)": re.compile(
        r"\b(this|earlier|previous|last) session\b", re.IGNORECASE
    ),
    "'not met'": re.compile(r"\bnot met\b", re.IGNORECASE),
    "a test file (test internals belong on Contributing)": re.compile(
        r"\btests/[\w/.-]+|\btest_\w+\.py\b"
    ),
}
FENCE = re.compile(r"^\s*(```|~~~)")


def user_pages(root: Path) -> list[Path]:
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p for p in pages if p.relative_to(root).as_posix() not in CONTRIBUTOR_PAGES]


def findings(path: Path, shown_as: str) -> list[str]:
    """What ``path`` says that a user page should not (code blocks are left alone)."""
    out = []
    lines = path.read_text().splitlines()
    if len(lines) > MAX_LINES:
        out.append(f"{shown_as}: {len(lines)} lines, more than {MAX_LINES}: split the page")
    in_code = False
    for n, line in enumerate(lines, start=1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        for what, pattern in MARKERS.items():
            m = pattern.search(line)
            if m:
                out.append(f"{shown_as}:{n}: {what} ({m.group(0)!r}): {line.strip()[:100]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.voice", description=__doc__)
    parser.add_argument("pages", nargs="*", help="default: README.md and the user pages of docs/")
    args = parser.parse_args(argv)
    root = Path.cwd()
    pages = [Path(p) for p in args.pages] or user_pages(root)
    found = [f for p in pages for f in findings(p, p.as_posix().removeprefix(f"{root}/"))]
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} finding(s) in user pages (see tools/voice.py)", file=sys.stderr)
        return 1
    print(f"voice: {len(pages)} user pages read as the software's, none too long")
    return 0


if __name__ == "__main__":
    sys.exit(main())
