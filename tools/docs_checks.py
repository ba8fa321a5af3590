"""Check the docs site reads without sideways scrolling, and every command-line flag says
what it does.

    python -m tools.docs_checks [PAGE ...]

Two checks, each finding printed as ``where: what``; exits 1 when there is one:

- **Code-block width.** A line inside a fenced code block of ``README.md`` (the site's home
  page) or ``docs/**/*.md`` is at most :data:`MAX_CODE_WIDTH` characters, counted from
  the fence's indentation. At that width a block fits the column of the site at 1400 px,
  so a comment at the end of a line is not hidden. A long comment goes on the line above;
  a long command is split with ``\\``. A line is excused only when its URLs are what make
  it long (a URL cannot break).
- **Flag help.** Every argument of every ``streamrft`` command and subcommand
  (``app/cli.py`` ``build_parser``) has help text, and so does each subcommand: the
  command-line reference (``docs/reference/cli.md``) shows it as the argument's
  description. ``argparse.SUPPRESS`` hides an argument on purpose and is allowed.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_CODE_WIDTH = 88
"""The widest line a fenced code block may hold (characters)."""
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_URL = re.compile(r"https?://\S+")


def site_pages(root: Path) -> list[Path]:
    """The pages the site shows: ``README.md`` (its home page) and ``docs/**/*.md``."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def code_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of each line inside a fenced code block, the fence's
    indentation removed. A block closes at a fence of the same character at least as long,
    with nothing after it; an unclosed block runs to the end of the text."""
    opened: tuple[str, int, int] | None = None  # fence character, its length, indentation
    for n, line in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(line)
        if opened is None:
            if m:
                opened = (m["fence"][0], len(m["fence"]), len(m["indent"]))
            continue
        char, length, indent = opened
        if m and m["fence"][0] == char and len(m["fence"]) >= length and not m["info"].strip():
            opened = None
            continue
        yield n, line[min(indent, len(line) - len(line.lstrip())) :]


def too_wide(line: str, limit: int = MAX_CODE_WIDTH) -> bool:
    """Whether a code line is wider than ``limit``: URLs left out of the count, so a line
    is excused when only its unbreakable URLs take it past."""
    return len(line.rstrip()) > limit and len(_URL.sub("", line.rstrip())) > limit


def wide_code_lines(path: Path, shown_as: str, limit: int = MAX_CODE_WIDTH) -> list[str]:
    """A finding for each code-block line of the page at ``path`` wider than ``limit``."""
    return [
        f"{shown_as}:{n}: code line of {len(line.rstrip())} characters, more than {limit} "
        f"(put a long comment above the line; split a long command with \\): {line.strip()[:60]}"
        for n, line in code_lines(path.read_text())
        if too_wide(line, limit)
    ]


def flags_without_help(parser: argparse.ArgumentParser, prog: str | None = None) -> list[str]:
    """Each argument of ``parser`` and its subcommands (and each subcommand) without help
    text, as ``"<command> <argument>"``."""
    prog = prog or parser.prog
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.metavar or action.dest
        if not action.help:
            out.append(f"{prog} {name}")
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            seen: set[int] = set()
            for command, sub in action.choices.items():
                if id(sub) in seen:  # an alias of a command already walked
                    continue
                seen.add(id(sub))
                if not helps.get(command):
                    out.append(f"{prog} {command} (the command itself)")
                out += flags_without_help(sub, f"{prog} {command}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs_checks", description=__doc__)
    parser.add_argument("pages", nargs="*", help="default: README.md and docs/**/*.md")
    args = parser.parse_args(argv)
    root = Path.cwd()
    pages = [Path(p) for p in args.pages] or site_pages(root)
    found = [f for p in pages for f in wide_code_lines(p, p.as_posix().removeprefix(f"{root}/"))]
    from streamrft.app.cli import build_parser

    found += [
        f"{where}: no help text (app/cli.py; it is the command-line reference's description)"
        for where in flags_without_help(build_parser())
    ]
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} finding(s) (see tools/docs_checks.py)", file=sys.stderr)
        return 1
    print(
        f"docs_checks: code lines of {len(pages)} pages within {MAX_CODE_WIDTH} characters; "
        "every flag has help"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
