"""The user pages' voice check (tools/voice.py) passes on the repository and catches each
lab-notebook marker, outside code blocks only, and a page too long."""

from __future__ import annotations

import pytest

from tests.helpers.paths import ROOT
from tools import voice

pytestmark = pytest.mark.unit


def test_the_repositorys_user_pages_pass(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert voice.main([]) == 0
    assert "none too long" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("measured on the code before (commit 41ac149)", "a commit hash"),
        ("as the issue asked, steps are faster", "an issue of the project"),
        ("Measured on the 2-core development machine", "'development machine'"),
        ("No change measured here: on this machine the write", "'development machine' or 'this"),
        ("(measured in an earlier session)", "'this session' or 'an earlier"),
        ("the goal of 0.5 is **not met** here", "'not met'"),
        ("checked by `tests/e2e/test_serve.py`", "a test file"),
    ],
)
def test_each_marker_is_found(tmp_path, line, what):
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\nfine text\n{line}\n")
    found = voice.findings(page, "page.md")
    assert len(found) == 1 and found[0].startswith(f"page.md:4: {what}")


def test_code_blocks_and_digests_are_left_alone_and_long_pages_flagged(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\ngit checkout 41ac149  # an issue in a code block\n```\n"
        "a sha256 like 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n"
    )
    assert voice.findings(page, "page.md") == []
    page.write_text("line\n" * (voice.MAX_LINES + 1))
    assert voice.findings(page, "page.md") == [
        f"page.md: {voice.MAX_LINES + 1} lines, more than {voice.MAX_LINES}: split the page"
    ]
