"""The docs checks (tools/docs_checks.py) pass on the repository and catch a code-block
line too wide for the site's column and a command-line flag without help text."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers.paths import ROOT
from tools import docs_checks

pytestmark = pytest.mark.unit

WIDE = "x" * (docs_checks.MAX_CODE_WIDTH + 1)
FITS = "x" * docs_checks.MAX_CODE_WIDTH


def test_the_repositorys_pages_and_parser_pass(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert docs_checks.main([]) == 0
    assert "every flag has help" in capsys.readouterr().out


def page(tmp_path, text: str):
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_a_wide_line_in_a_code_block_is_found_with_its_line(tmp_path):
    path = page(tmp_path, f"# Page\n\n```bash\n{FITS}\n{WIDE}\n```\n")
    found = docs_checks.wide_code_lines(path, "page.md")
    assert len(found) == 1
    assert found[0].startswith(f"page.md:5: code line of {len(WIDE)} characters, more than 88")


def test_prose_tables_and_closed_blocks_are_left_alone(tmp_path):
    text = f"# Page\n\n{WIDE}\n\n| a | {WIDE} |\n\n```\n{FITS}\n```\n\n{WIDE}\n"
    assert docs_checks.wide_code_lines(page(tmp_path, text), "page.md") == []


def test_fences_tilde_longer_and_indented(tmp_path):
    # a ``` line inside a ```` block does not close it; the line after it is still code
    text = f"````markdown\n```\n{WIDE}\n````\n"
    assert len(docs_checks.wide_code_lines(page(tmp_path, text), "p")) == 1
    # a tilde fence, and a fence with an info string that does not close the block
    text = f"~~~\n```python\n{WIDE}\n~~~\n{WIDE}\n"
    assert len(docs_checks.wide_code_lines(page(tmp_path, text), "p")) == 1
    # inside a list item the fence's indentation is not counted, and an unclosed block
    # runs to the end
    text = f"- item\n\n    ```bash\n    {FITS}\n    ```\n\n```\n{WIDE}\n"
    found = docs_checks.wide_code_lines(page(tmp_path, text), "p")
    assert [f.split(":")[1] for f in found] == ["8"]


def test_a_line_long_only_by_its_url_is_excused():
    url = "https://download.pytorch.org/whl/" + "a" * 80
    assert not docs_checks.too_wide(f"pip install torch --index-url {url}")
    assert docs_checks.too_wide(f"pip install torch --index-url {url}  # {WIDE}")
    assert docs_checks.too_wide(WIDE) and not docs_checks.too_wide(FITS + "   ")


def test_main_fails_on_a_page_with_a_wide_code_line(tmp_path, monkeypatch, capsys):
    path = page(tmp_path, f"```\n{WIDE}\n```\n")
    monkeypatch.chdir(ROOT)
    assert docs_checks.main([str(path)]) == 1
    assert "code line of 89 characters" in capsys.readouterr().out


def test_flags_and_commands_without_help_are_found():
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--documented", help="does a thing")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--bare")
    sub = parser.add_subparsers(dest="command", help="the command")
    run = sub.add_parser("run", help="runs", aliases=["go"])
    run.add_argument("config")
    tasks = sub.add_parser("tasks")
    actions = tasks.add_subparsers(dest="action")
    make = actions.add_parser("make", help="makes")
    make.add_argument("-n", type=int)
    assert docs_checks.flags_without_help(parser) == [
        "tool --bare",
        "tool run config",
        "tool tasks (the command itself)",
        "tool tasks action",
        "tool tasks make -n",
    ]
