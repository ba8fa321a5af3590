"""The codec's content-type handling and the dead letter's size bound at their edges:
each a mutant of schemas/codec.py that the other tests let live
(../shared/reviews/mutation-2026-11.md)."""

from __future__ import annotations

import json

import pytest

from streamrft.schemas import SchemaError
from streamrft.schemas.codec import (
    CONTROL,
    DEAD_LETTER,
    DEAD_LETTER_MARGIN_BYTES,
    DEAD_LETTER_REASON_CHARS,
    METRICS,
    STATUS,
    TASK,
    dead_letter_of,
)
from streamrft.schemas.experience import Task

pytestmark = pytest.mark.unit

TASK_JSON = json.dumps({"id": "t1", "prompt": "1+1=", "answer": "2"}).encode()


def _ct(value: bytes) -> list[tuple[str, bytes]]:
    return [("content-type", value)]


@pytest.mark.parametrize("codec", [CONTROL, STATUS, METRICS])
def test_json_on_an_event_topic_is_a_schema_error(codec):
    with pytest.raises(SchemaError, match="JSON is accepted only on tasks and experiences"):
        codec.decode(b"{}", _ct(b"application/json"))


@pytest.mark.parametrize(
    "content_type", [b"application/json", b"Application/JSON; charset=utf-8", b" application/json "]
)
def test_json_content_types_in_any_case_and_with_parameters(content_type):
    assert TASK.decode(TASK_JSON, _ct(content_type)).id == "t1"


def test_msgpack_by_name_or_by_default_and_nothing_else():
    value = TASK.encode(Task(id="t2", prompt="2+2=", answer="4"))
    assert TASK.decode(value, _ct(b"application/msgpack")).id == "t2"
    assert TASK.decode(value).id == "t2"
    for foreign in (b"text/plain", b"application/x-protobuf"):
        with pytest.raises(SchemaError, match="is neither application/json nor"):
            TASK.decode(value, _ct(foreign))


ROOM = DEAD_LETTER.max_bytes - DEAD_LETTER_MARGIN_BYTES


def test_a_large_key_and_a_large_value_together_still_fit_a_dead_letter():
    key = b"k" * (ROOM // 2)
    value = b"v" * (ROOM - ROOM // 2 + 1)  # each fits alone, not both
    letter = dead_letter_of("t", 0, 1, key, value, SchemaError("x"), "trainer")
    assert letter.key == key and letter.value is None
    assert "not kept" in letter.reason
    assert len(DEAD_LETTER.encode(letter)) <= DEAD_LETTER.max_bytes
    whole = dead_letter_of("t", 0, 1, key, b"v" * (ROOM - ROOM // 2), SchemaError("x"), "c")
    assert whole.value is not None  # exactly the room: kept


def test_a_reason_of_exactly_the_limit_is_kept_whole():
    reason = "r" * DEAD_LETTER_REASON_CHARS
    assert dead_letter_of("t", 0, 1, None, b"", SchemaError(reason), "c").reason == reason
    longer = dead_letter_of("t", 0, 1, None, b"", SchemaError(reason + "r"), "c").reason
    assert longer.endswith(f"... ({DEAD_LETTER_REASON_CHARS + 1} characters)")


def test_only_tasks_and_groups_have_a_json_form():
    task = Task(id="t3", prompt="3+3=", answer="6")
    assert TASK.accepts_json and not CONTROL.accepts_json
    sent = TASK.encode_json(task)
    assert json.loads(sent)["id"] == "t3"
    assert TASK.decode(sent, TASK.json_headers()) == task
    with pytest.raises(SchemaError, match="has no JSON form"):
        CONTROL.encode_json(task)


def test_a_newer_schema_is_refused_and_the_current_one_read():
    value = TASK.encode(Task(id="t4", prompt="4+4=", answer="8"))
    assert TASK.decode(value, [("streamrft-schema", b"1")]).id == "t4"
    with pytest.raises(SchemaError, match="schema version 2 is newer than this reader's 1"):
        TASK.decode(value, [("streamrft-schema", b"2")])


def test_a_long_foreign_content_type_is_cut_in_the_reason():
    with pytest.raises(SchemaError) as caught:
        TASK.decode(b"x", _ct(b"t" * 200))
    assert "t" * 80 + "'" in str(caught.value) and "t" * 81 not in str(caught.value)


@pytest.mark.parametrize("max_request_bytes", [1 << 20, 16 << 20])
def test_a_record_of_the_run_s_own_producers_is_dead_lettered_with_its_bytes(max_request_bytes):
    """The edge: the largest value the explorer or serve sends under this
    ``kafka.max_request_bytes``, with the longest key (1,024 four-byte characters) and the
    longest reason, is kept whole, and the dead letter still fits a produce request (at
    41ac149 a group near 16 MiB was dead-lettered without its bytes)."""
    from streamrft.infra.produce import largest_value
    from streamrft.schemas import EXPERIENCE_GROUP
    from streamrft.schemas.limits import MAX_ID_CHARS

    value = b"v" * largest_value(max_request_bytes, EXPERIENCE_GROUP)
    key = ("\U0001f600" * MAX_ID_CHARS).encode()
    exc = SchemaError("r" * (DEAD_LETTER_REASON_CHARS + 50))
    letter = dead_letter_of("x" * 249, 0, 1, key, value, exc, "c" * MAX_ID_CHARS, max_request_bytes)
    assert letter.value == value and letter.key == key, letter.reason[-200:]
    assert len(DEAD_LETTER.encode(letter)) + len(key) + 1024 <= max_request_bytes
    bigger = dead_letter_of("t", 2, 7, key, value + b"v" * (40 << 10), exc, "c", max_request_bytes)
    assert bigger.value is None and "stays at t[2]@7" in bigger.reason  # where it can be had


def test_a_mixed_version_fleet_reads_each_others_records():
    """The rule for a fleet mid-upgrade: a newer writer of the same schema version adds
    fields at the end with defaults, which an older reader skips; an older writer's record
    lacks them, and a newer reader takes their defaults."""
    import msgspec

    class NewerTask(Task, kw_only=True):  # a field a later release added
        priority: int = 0

    newer = msgspec.msgpack.encode(NewerTask(id="t5", prompt="5+5=", answer="10", priority=3))
    assert TASK.decode(newer, TASK.headers()) == Task(id="t5", prompt="5+5=", answer="10")
    older = TASK.encode(Task(id="t6", prompt="6+6=", answer="12"))
    assert msgspec.msgpack.decode(older, type=NewerTask).priority == 0
