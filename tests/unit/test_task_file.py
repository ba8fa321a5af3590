"""The feeder's tasks live in a file, not in memory: read back by position exactly as
written; building the book of a large taskset holds a few bytes per task, not the tasks;
ids two rows share are named."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from streamrft.infra.config import from_dict
from streamrft.producers.feeder import TaskBook
from streamrft.producers.task_file import TaskFile
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ChatMessage, Task

pytestmark = pytest.mark.unit


def test_tasks_come_back_by_position_as_they_were_written(tmp_path):
    tasks = [
        Task(id=f"t{i}", prompt="p" * i, answer=str(i), metadata={"k": "v" * (i % 3)})
        for i in range(50)
    ]
    tasks.append(Task(id="chat", messages=[ChatMessage(role="user", content="hi")]))
    book = TaskFile(tmp_path / "tasks.bin")
    for t in tasks:
        book.append(t)
    book.seal()
    assert len(book) == 51
    assert [book[i] for i in (50, 0, 17, 49)] == [tasks[50], tasks[0], tasks[17], tasks[49]]
    assert list(book) == tasks
    book.close()
    assert not (tmp_path / "tasks.bin").exists()


def _config(tmp_path, path, **taskset):
    return from_dict(
        {
            "run": {"dir": str(tmp_path / "runs"), "id": "r"},
            "taskset": {"path": str(path), **taskset},
        }
    )


def test_a_large_taskset_is_not_held_in_memory(tmp_path):
    n, width = 20_000, 500
    path = tmp_path / "big.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"q{i}", "prompt": f"{i}" + "x" * width, "answer": "1"}))
            fh.write("\n")
    tracemalloc.start()
    try:
        book = TaskBook(_config(tmp_path, path), tmp_path / "feeder" / "tasks.bin")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(book.file) == n and book.sizes == [n]
    held = n * width  # the prompts alone, had the tasks been kept as objects: 10 MB
    assert peak < held / 4, f"peak {peak / 1e6:.1f} MB building a book of {held / 1e6:.0f} MB"
    assert book.file[12_345].prompt == "12345" + "x" * width
    book.close()


def test_an_id_two_rows_share_is_named(tmp_path):
    path = tmp_path / "dup.jsonl"
    rows = [{"id": f"a{i}", "prompt": "1+1=", "answer": "2"} for i in range(600)]
    rows[550]["id"] = "a7"  # past the first screening batch
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"duplicate task id 'a7' \(tasks 8 and 551 of 600\)"):
        TaskBook(_config(tmp_path, path), tmp_path / "feeder" / "tasks.bin")
    assert not (tmp_path / "feeder" / "tasks.bin").exists()  # removed on the error
