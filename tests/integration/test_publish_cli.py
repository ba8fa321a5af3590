"""Any app can publish: ``streamrft publish`` and JSON records on the real broker.

``streamrft publish`` validates a JSONL file line by line, reports each bad line with its
number and reason, publishes the good ones (read back and compared) and exits 1 when some
were bad. JSON records sent straight to ``tasks`` / ``experiences`` with the JSON
content-type header go through the consumers' own path: a malformed one is dead-lettered,
a good one is taken like msgpack.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from streamrft.app import cli
from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.intake import ExperienceIntake
from streamrft.infra import admin
from streamrft.infra.bus import Counters, EventSender
from streamrft.infra.consume import read_history, read_topic
from streamrft.producers.task_intake import TaskIntake
from streamrft.schemas import DEAD_LETTER, EXPERIENCE_GROUP, TASK, ChatMessage, Task
from streamrft.schemas.codec import HEADER_TYPE
from streamrft.schemas.json_forms import HEADER_CONTENT_TYPE
from tests.harness.fuzz import FuzzMessage, inject
from tests.helpers.cli import start_piped, streamrft_cmd
from tests.helpers.groups import make_group
from tests.helpers.paths import ADDITION

pytestmark = pytest.mark.integration

SUMMARY = re.compile(r"^published (\d+), rejected (\d+) \(", re.M)


def _run_cli(argv: list[str], cwd) -> tuple[int, str, str]:
    proc = start_piped(streamrft_cmd(*argv), cwd)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _summary(out: str) -> tuple[int, int]:
    m = SUMMARY.search(out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def _bad_lines(err: str, path) -> dict[int, str]:
    """Line number -> reason, from ``FILE:LINE: reason`` lines on stderr."""
    found = {}
    for line in err.splitlines():
        if line.startswith(f"{path}:"):
            number, reason = line[len(f"{path}:") :].split(": ", 1)
            found[int(number)] = reason
    return found


def _publish_with_a_config(cfg, tmp_path, path, more_kafka: str = "") -> tuple[int, str, str]:
    """``streamrft publish CONFIG ... experiences PATH`` with a config naming the broker
    (and ``more_kafka`` lines of its ``kafka`` section)."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"kafka:\n  bootstrap_servers: {cfg.kafka.bootstrap_servers}\n{more_kafka}"
        f"taskset:\n  path: {ADDITION}\n"
    )
    run = cfg.topics().run
    argv = ["publish", str(config), "--run-id", run, "experiences", str(path)]
    return _run_cli(argv, tmp_path)


def _records(cfg, topic, codec):
    return asyncio.run(read_topic(cfg.kafka, topic, codec, "publish-check"))


def test_publish_tasks_reports_bad_lines_and_publishes_the_good(make_config, tmp_path):
    cfg = make_config()
    topics = cfg.topics()
    asyncio.run(admin.ensure_topics(cfg.kafka, topics))
    good = [
        Task(id="app-1", prompt="What is 1 + 1?", answer="2"),
        Task(id="app-2", messages=[ChatMessage(role="user", content="2 + 5?")], answer="7"),
        Task(id="app-3", prompt="3 + 3", answer="6", metadata={"source": "app"}),
    ]
    lines = [
        TASK.encode_json(good[0]).decode(),  # 1
        "",  # 2: blank, skipped
        '{"id": "app-x", prompt: "1 + 2"}',  # 3: not JSON
        '{"id": "app-y", "epoch": "one"}',  # 4: a wrong field type
        TASK.encode_json(good[1]).decode(),  # 5
        '{"id": ""}',  # 6: fails validation (empty id)
        '{"prompt": "no id"}',  # 7: a required field missing
        TASK.encode_json(good[2]).decode(),  # 8
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")

    argv = ["publish", "--run-id", topics.run, "tasks", str(path)]
    rc, out, err = _run_cli([*argv, "--bootstrap", cfg.kafka.bootstrap_servers], tmp_path)

    assert rc == 1, err
    assert _summary(out) == (3, 4)
    bad = _bad_lines(err, path)
    assert sorted(bad) == [3, 4, 6, 7], err
    assert "JSON is malformed" in bad[3], bad[3]
    assert "Expected `int`, got `str` - at `$.epoch`" in bad[4], bad[4]
    assert "task id is empty" in bad[6], bad[6]
    assert "missing required field `id`" in bad[7], bad[7]
    records = _records(cfg, topics.tasks, TASK)
    assert all(r.error is None for r in records)
    assert sorted((r.obj for r in records), key=lambda t: t.id) == good
    for r in records:  # msgpack with the codec's own headers, keyed by task id
        assert r.key == r.obj.id.encode()
        assert dict(r.headers)[HEADER_TYPE] == b"task"
        assert HEADER_CONTENT_TYPE not in dict(r.headers)
        assert r.value == TASK.encode(r.obj)


def test_publish_experiences_with_a_config(make_config, tmp_path):
    cfg = make_config()
    topics = cfg.topics()
    asyncio.run(admin.ensure_topics(cfg.kafka, topics))
    good = [
        make_group(topics.run, "task-1", 0),
        make_group(topics.run, "task-2", 0, n=2, rewards=[0.5, -1.0], workflow="my-app"),
    ]
    wrong_type = json.loads(EXPERIENCE_GROUP.encode_json(good[0]))
    wrong_type["experiences"][1]["tokens"] = "1 5 6 7 8 2"
    lines = [
        EXPERIENCE_GROUP.encode_json(good[0]).decode(),  # 1
        # 2: the action mask is one entry short of the response
        EXPERIENCE_GROUP.encode_json(make_group(topics.run, "task-3", 0, masks=[[1]] * 4)).decode(),
        EXPERIENCE_GROUP.encode_json(make_group("another-run", "task-4", 0)).decode(),  # 3
        json.dumps(wrong_type),  # 4
        EXPERIENCE_GROUP.encode_json(good[1]).decode()[:-5],  # 5: cut short
        "  ",  # 6: blank
        EXPERIENCE_GROUP.encode_json(good[1]).decode(),  # 7
    ]
    path = tmp_path / "groups.jsonl"
    path.write_text("\n".join(lines))  # no newline after the last line
    rc, out, err = _publish_with_a_config(cfg, tmp_path, path)

    assert rc == 1, err
    assert _summary(out) == (2, 4)
    bad = _bad_lines(err, path)
    assert sorted(bad) == [2, 3, 4, 5], err
    assert "action_mask" in bad[2], bad[2]
    assert "another-run" in bad[3] and topics.run in bad[3], bad[3]
    assert "tokens" in bad[4], bad[4]
    records = _records(cfg, topics.experiences, EXPERIENCE_GROUP)
    assert all(r.error is None for r in records)
    assert sorted((r.obj for r in records), key=lambda g: g.id) == good
    assert sorted(r.key for r in records) == [b"task-1", b"task-2"]


def test_a_line_past_the_limits_is_left_out_and_the_rest_published(make_config, tmp_path):
    """A line longer than its topic's largest record is read through in pieces and left
    out; a group whose record would not fit the broker's produce request (the run's
    ``kafka.max_request_bytes``) is left out with that reason; the lines around them are
    published (at 41ac149 the first was read whole into memory and the second aborted the
    file midway with no summary)."""
    cfg = make_config()
    topics = cfg.topics()
    asyncio.run(admin.ensure_topics(cfg.kafka, topics))
    width = 60_000  # 4 rows of 60k tokens: ~2.5 MB as a record, over a 1 MiB request
    big = make_group(
        topics.run, "task-big", 0, n=4,
        tokens=[[1] * 4 + [5] * width] * 4, logprobs=[[-0.5] * width] * 4, masks=[[1] * width] * 4,
    )  # fmt: skip
    good = [make_group(topics.run, "task-1", 0), make_group(topics.run, "task-2", 0)]
    over = b'{"id": "huge", "prompt": "' + b"x" * (EXPERIENCE_GROUP.max_bytes + 10) + b'"}'
    path = tmp_path / "groups.jsonl"
    with path.open("wb") as f:
        f.write(EXPERIENCE_GROUP.encode_json(good[0]) + b"\n")  # 1
        f.write(over + b"\n")  # 2: longer than any experience group may be
        f.write(EXPERIENCE_GROUP.encode_json(big) + b"\n")  # 3: valid, too big for the broker
        f.write(EXPERIENCE_GROUP.encode_json(good[1]) + b"\n")  # 4
    rc, out, err = _publish_with_a_config(cfg, tmp_path, path, f"  max_request_bytes: {1 << 20}\n")

    assert rc == 1, err
    assert _summary(out) == (2, 2)
    bad = _bad_lines(err, path)
    assert sorted(bad) == [2, 3], err
    assert f"line of {len(over) + 1} bytes, over {EXPERIENCE_GROUP.max_bytes}" in bad[2], bad[2]
    assert "kafka.max_request_bytes (1048576)" in bad[3], bad[3]
    records = _records(cfg, topics.experiences, EXPERIENCE_GROUP)
    assert sorted((r.obj for r in records), key=lambda g: g.id) == good


def test_an_empty_file_publishes_nothing_and_says_so(make_config, tmp_path):
    cfg = make_config()
    topics = cfg.topics()
    asyncio.run(admin.ensure_topics(cfg.kafka, topics))
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    argv = ["publish", "--run-id", topics.run, "tasks", str(path)]
    rc, out, err = _run_cli([*argv, "--bootstrap", cfg.kafka.bootstrap_servers], tmp_path)
    assert rc == 0, err
    assert _summary(out) == (0, 0)


def test_publish_finds_the_run_s_broker_and_says_what_is_wrong(
    make_config, tmp_path, monkeypatch, capsys
):
    cfg = make_config()
    topics = cfg.topics()
    asyncio.run(admin.ensure_topics(cfg.kafka, topics))
    path = tmp_path / "one.jsonl"
    path.write_text(TASK.encode_json(Task(id="found-1", prompt="1 + 2")).decode() + "\n")
    # no --config, no --bootstrap: the run's resolved config names the broker (as for
    # `streamrft explore --run-id`), under the default run.dir `runs` of the working folder
    run_dir = tmp_path / "runs" / topics.run
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"kafka:\n  bootstrap_servers: {cfg.kafka.bootstrap_servers}\n"
    )
    monkeypatch.chdir(tmp_path)

    assert cli.main(["publish", "--run-id", topics.run, "tasks", str(path)]) == 0
    assert _summary(capsys.readouterr().out) == (1, 0)
    assert [r.obj.id for r in _records(cfg, topics.tasks, TASK)] == ["found-1"]

    missing = tmp_path / "missing.jsonl"
    assert cli.main(["publish", "--run-id", topics.run, "tasks", str(missing)]) == 2
    assert f"{missing}: no such file" in capsys.readouterr().err

    bootstrap = ["--bootstrap", cfg.kafka.bootstrap_servers]
    assert cli.main(["publish", "--run-id", "no-such-run", "tasks", str(path), *bootstrap]) == 2
    err = capsys.readouterr().err
    assert "streamrft.no-such-run.tasks" in err and "does not exist" in err, err


# -- JSON records straight to the topics, read by the consumers' own path ------------------
def _json_message(value: bytes, key: bytes, codec=EXPERIENCE_GROUP) -> FuzzMessage:
    return FuzzMessage(value, codec.json_headers(), key)


def test_json_experiences_are_taken_like_msgpack_and_bad_ones_dead_lettered(make_config):
    cfg = make_config(kafka={"partitions": 1})  # one partition: read in the order sent
    topics = cfg.topics()
    as_json = make_group(topics.run, "json-task", 0, rewards=[1.0, 0.0, 0.5, 0.0])
    as_msgpack = make_group(topics.run, "msgpack-task", 0)
    malformed = b'{"id": "broken", "experiences": [ {'
    invalid = EXPERIENCE_GROUP.encode_json(make_group(topics.run, "bad", 0, masks=[[1]] * 4))
    messages = [
        _json_message(malformed, b"broken"),
        _json_message(EXPERIENCE_GROUP.encode_json(as_json), b"json-task"),
        _json_message(invalid, b"bad"),
        FuzzMessage(EXPERIENCE_GROUP.encode(as_msgpack), EXPERIENCE_GROUP.headers(), b"msgpack"),
    ]

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        offsets = await inject(cfg, topics.experiences, messages)
        counters = Counters()
        events = EventSender(cfg, "trainer", "trainer", counters)
        intake = ExperienceIntake(cfg, ExperienceBuffer(max_staleness=5), events, counters, 64)
        await events.start()
        await intake.start({})
        try:

            async def nothing() -> None:
                pass

            taken = await asyncio.wait_for(
                intake.collect(2, lambda: 0, asyncio.Event(), nothing), 60
            )
        finally:
            await intake.stop()
            await events.stop()
        letters = await read_history(cfg.kafka, topics.dead_letters, DEAD_LETTER, "dl")
        return offsets, taken, letters, counters.snapshot()

    offsets, taken, letters, counters = asyncio.run(scenario())
    assert sorted(taken, key=lambda g: g.id) == sorted([as_json, as_msgpack], key=lambda g: g.id)
    assert counters["dead_letters"] == 2
    by_value = {dl.value: dl for dl in letters}
    assert set(by_value) == {malformed, invalid}
    assert by_value[malformed].reason == "experience_group: Input data was truncated"
    assert "action_mask" in by_value[invalid].reason
    assert {(dl.partition, dl.offset) for dl in letters} == {offsets[0], offsets[2]}
    assert all(dl.source_topic == topics.experiences for dl in letters)


def test_json_tasks_are_taken_like_msgpack_and_bad_ones_dead_lettered(make_config):
    cfg = make_config(kafka={"partitions": 1})  # one partition: read in the order sent
    topics = cfg.topics()
    as_json = Task(id="json-1", prompt="1 + 4", answer="5", metadata={"from": "app"})
    as_msgpack = Task(id="msgpack-1", prompt="2 + 4", answer="6")
    malformed = b'{"id": "broken", '
    wrong_type = b'{"id": "typed", "batch": "first"}'
    messages = [
        _json_message(malformed, b"broken", TASK),
        _json_message(TASK.encode_json(as_json), b"json-1", TASK),
        _json_message(wrong_type, b"typed", TASK),
        FuzzMessage(TASK.encode(as_msgpack), TASK.headers(), b"msgpack-1"),
    ]

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        offsets = await inject(cfg, topics.tasks, messages)
        counters = Counters()
        events = EventSender(cfg, "explorer-0", "explorer", counters)
        await events.start()
        intake = TaskIntake(cfg, "explorer-0", events, counters)
        await intake.start()
        try:
            taken = await asyncio.wait_for(intake.take(2, lambda: False, lambda: False), 60)
        finally:
            await intake.stop()
            await events.stop()
        letters = await read_history(cfg.kafka, topics.dead_letters, DEAD_LETTER, "dl")
        return offsets, taken.tasks, letters, counters.snapshot()

    offsets, tasks, letters, counters = asyncio.run(scenario())
    assert sorted(tasks, key=lambda t: t.id) == [as_json, as_msgpack]
    assert counters["dead_letters"] == 2
    by_value = {dl.value: dl for dl in letters}
    assert set(by_value) == {malformed, wrong_type}
    assert by_value[malformed].reason == "task: Input data was truncated"
    assert by_value[wrong_type].reason == "task: Expected `int`, got `str` - at `$.batch`"
    assert {(dl.partition, dl.offset) for dl in letters} == {offsets[0], offsets[2]}
