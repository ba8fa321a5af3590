"""``streamrft publish`` reads a file line by line without ever holding more than the
longest line its topic allows: a longer line comes back as its size only."""

from __future__ import annotations

import pytest

from streamrft.app.publish import LongLine, numbered_lines

pytestmark = pytest.mark.unit


def test_lines_over_the_limit_come_back_as_their_size(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"short\n" + b"y" * 10 + b"\n" + b"x" * 10_000 + b"\n\nlast-no-newline")
    got = list(numbered_lines(path, 10))
    assert got == [
        (1, b"short\n"),
        (2, b"y" * 10 + b"\n"),  # exactly the limit, and its newline
        (3, LongLine(10_001)),
        (4, b"\n"),
        (5, LongLine(15)),  # over the limit, at the end of the file without a newline
    ]


def test_a_long_last_line_without_newline(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"a\n" + b"z" * 25)
    assert list(numbered_lines(path, 10)) == [(1, b"a\n"), (2, LongLine(25))]
