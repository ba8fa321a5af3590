"""``streamrft status`` (the components table) and ``tail --where`` (the filters), as pure
code; both run against a live run in tests/e2e/test_cli_run.py."""

from __future__ import annotations

import pytest

from streamrft.app.watch.run_events import runs_on_broker
from streamrft.app.watch.run_status import Components
from streamrft.app.watch.tail import matches, parse_where
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.events import (
    DeadLetter,
    ModelVersionReady,
    RunDefined,
    RunState,
    StatusEvent,
)


def _status(component, role, state, step, version, at, detail="", **counters):
    return StatusEvent(
        component=component,
        role=role,
        state=state,
        step=step,
        version=version,
        created_at=at,
        detail=detail,
        counters=counters,
    )


def test_the_table_shows_the_newest_heartbeat_lag_and_partitions():
    c = Components()
    c.apply("status", _status("explorer-1", "explorer", RunState.RUNNING, 3, 2, 90.0,
                              "tasks partitions 2,3", tasks_partitions=2))  # fmt: skip
    c.apply("status", _status("explorer-1", "explorer", RunState.WAITING_SYNC, 4, 3, 95.0,
                              "waiting for version 4", tasks_partitions=2))  # fmt: skip
    c.apply("status", _status("trainer", "trainer", RunState.RUNNING, 5, 5, 99.0))
    c.apply("status", _status("explorer-0", "explorer", RunState.RUNNING, 1, -1, 10.0,
                              "no tasks partition: idle", tasks_partitions=0))  # fmt: skip
    c.apply("control", ModelVersionReady(version=6, method="m", uri="u", manifest_sha256="x",
                                         bytes=1, step=6))  # fmt: skip
    c.apply("dead_letters", DeadLetter(source_topic="t", partition=0, offset=1, key=None,
                                       value=b"x", reason="bad", error_type="SchemaError",
                                       component="explorer-1"))  # fmt: skip
    lines = c.table("r", now=100.0).splitlines()
    assert lines[0] == "run r: 3 components, newest version 6, 1 dead letters"
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["trainer", "explorer-0", "explorer-1"]  # trainer first
    assert rows[0][:6] == ["trainer", "trainer", "RUNNING", "5", "5", "1s"]
    assert rows[2][:9] == [
        "explorer-1", "explorer", "WAITING_SYNC", "4", "3", "(-3)", "5s", "ago", "2,3",
    ]  # fmt: skip
    assert lines[-1].endswith("waiting for version 4")
    assert rows[1][4:9] == ["-1", "90s", "ago", "-", "no"]  # no lag before a first version


def test_the_table_says_how_the_run_is_defined():
    c = Components()
    c.apply("status", _status("trainer", "trainer", RunState.RUNNING, 5, 5, 99.0))
    yaml_text = "trainer:\n  nproc: 2\n  nnodes: 3\nsynchronizer:\n  method: nccl\n"
    c.apply("control", RunDefined(config_yaml="x: [", created_at=10.0))  # an older one
    c.apply("control", RunDefined(config_yaml=yaml_text, store_uri="s3://b/r/run.yaml",
                                  created_at=40.0))  # fmt: skip
    lines = c.table("r", now=100.0).splitlines()
    assert lines[1].startswith("component") and lines[2].startswith("trainer")
    assert lines[-1] == (
        "defined 60s ago (config at s3://b/r/run.yaml): trainer 2 rank(s) x 3 host(s), sync nccl"
    )
    c.apply("control", RunDefined(config_yaml="x: [", created_at=90.0))  # unreadable YAML
    assert c.table("r", now=100.0).splitlines()[-1] == (
        "defined 10s ago (config at the control topic): trainer 1 rank(s) x 1 host(s), sync ?"
    )


@pytest.mark.parametrize(
    ("where", "hit"),
    [
        (["component=trainer"], True),
        (["component=explorer-0"], False),
        (["values.train/loss=0.5"], True),
        (["values.train/loss=.50"], True),  # numbers compare as numbers
        (["values.train/loss=abc"], False),
        (["step=3", "component=trainer"], True),
        (["step=3", "component=x"], False),
        (["no.such=1"], False),
        (["partition=1"], True),
        (["key=trainer"], True),
    ],
)
def test_where_filters(where, hit):
    obj = {
        "partition": 1,
        "offset": 7,
        "key": "trainer",
        "value": {"component": "trainer", "step": 3, "values": {"train/loss": 0.5}},
    }
    assert matches(obj, parse_where(where)) is hit


def test_a_where_without_equals_is_a_clear_error():
    with pytest.raises(StreamRFTError, match="expected FIELD=VALUE"):
        parse_where(["component"])


def test_runs_on_a_broker_are_read_off_topic_names():
    names = [
        "streamrft.demo.tasks",
        "streamrft.demo.metrics",
        "streamrft.run-2.status",
        "other.x.tasks",
        "streamrft.demo.explorers",  # not a topic kind
        "__consumer_offsets",
    ]
    assert runs_on_broker(names, "streamrft") == ["demo", "run-2"]
