"""The feeder's tasks live in a file, not in memory: read back by position exactly as
written; building the book of a large taskset holds a few bytes per task, not the tasks;
ids two rows share are named."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from streamrft.infra.config import from_dict
from streamrft.producers.task_book import TaskBook
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
    book = TaskFile(tmp_path / "feeder")
    for t in tasks:
        book.append(t)
    book.seal()
    assert len(book) == 51
    assert [book[i] for i in (50, 0, 17, 49)] == [tasks[50], tasks[0], tasks[17], tasks[49]]
    assert list(book) == tasks
    assert list((tmp_path / "feeder").iterdir()) == []  # a file without a name
    assert book.size_bytes > 0
    book.close()


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
        book = TaskBook(_config(tmp_path, path), tmp_path / "feeder")
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
    with pytest.raises(ConfigError, match=r"duplicate task id 'a7' \(.*dup.jsonl:8 and .*:551\)"):
        TaskBook(_config(tmp_path, path), tmp_path / "feeder")


def _mix(tmp_path, sources, **taskset):
    for i, source in enumerate(sources):
        if "rows" in source:
            path = tmp_path / f"s{i}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in source.pop("rows")))
            source["path"] = str(path)
    return from_dict(
        {
            "run": {"dir": str(tmp_path / "runs"), "id": "r"},
            "taskset": {"sources": sources, **taskset},
        }
    )


def _rows(prefix, n):
    return [{"id": f"{prefix}{i}", "prompt": "1+1=", "answer": "2"} for i in range(n)]


def test_a_mix_that_gives_a_source_nothing_or_repeats_ids_with_a_hash_is_refused(tmp_path):
    from streamrft.producers.feeder import Feeder

    few = _mix(tmp_path, [{"rows": _rows("a", 5)}, {"rows": _rows("b", 5), "weight": 0.01}])
    with pytest.raises(ConfigError, match=r"'s1' gets 0 of an epoch's 10 tasks at weight 0.01"):
        Feeder(few)
    hashed = _mix(tmp_path, [{"rows": [*_rows("a", 3), *_rows("a#", 1)]}], epoch_tasks=8)
    with pytest.raises(ConfigError, match=r"'s0' is repeated within an epoch \(8 of its 4"):
        Feeder(hashed)
    # the same ids are fine where nothing repeats
    once = _mix(tmp_path, [{"rows": [*_rows("a", 3), *_rows("a#", 1)]}])
    feeder = Feeder(once)
    assert sorted(t.id for t in feeder.epoch_tasks(0)) == ["s0/a#0", "s0/a0", "s0/a1", "s0/a2"]
    feeder.book.close()


def test_progress_for_sources_of_other_sizes_is_refused(tmp_path):
    from streamrft.producers.feeder import load_progress, save_progress

    path = tmp_path / "progress.json"
    save_progress(path, 1, 20, 40, [30, 10])
    assert load_progress(path, 40, [30, 10]) == (1, 20)
    with pytest.raises(ConfigError, match=r"sources of \[30, 10\] rows .* 40 from \[31, 10\]"):
        load_progress(path, 40, [31, 10])
    path.write_text(json.dumps({"epoch": 1, "sent": 20, "tasks": 40}))  # an older file
    assert load_progress(path, 40, [31, 10]) == (1, 20)
