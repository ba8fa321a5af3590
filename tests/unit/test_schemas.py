"""Wire types: codec round trips, schema evolution, invariants, headers, topic names."""

from __future__ import annotations

import json
import math
import struct

import msgspec
import pytest

from streamrft.schemas import (
    CODEC_BY_KIND,
    CONTROL,
    DEAD_LETTER,
    EXPERIENCE_GROUP,
    METRICS,
    SCHEMA_VERSION,
    STATUS,
    TASK,
    TOPIC_KINDS,
    Codec,
    ConfigError,
    DeadLetter,
    Experience,
    ExperienceGroup,
    MetricsEvent,
    ModelVersionReady,
    RunState,
    SchemaError,
    Segment,
    ShardInfo,
    Shutdown,
    StatusEvent,
    SyncRequest,
    Task,
    TopicNames,
    TrainedGroup,
    WeightManifest,
    decode_manifest,
    encode_manifest,
    make_group_id,
    pack_f32,
    pack_i32,
    pack_u8,
    unpack_f32,
    unpack_i32,
    validate_group,
)
from streamrft.schemas.arrays import unpack_u8
from tests.helpers.groups import make_group
from tests.helpers.imports import modules_after_import

pytestmark = pytest.mark.unit


# -- helpers ---------------------------------------------------------------------------------


def make_experience(
    exp_id: str = "run/t1@0/explorer-0#0",
    prompt: tuple[int, ...] = (1, 5, 6, 7),
    response: tuple[int, ...] = (8, 2),
    logprobs: tuple[float, ...] = (-0.5, -1.25),
    mask: tuple[int, ...] = (1, 1),
    reward: float = 1.0,
    version: int = 3,
) -> Experience:
    return Experience(
        id=exp_id,
        tokens=pack_i32(prompt + response),
        prompt_length=len(prompt),
        logprobs=pack_f32(logprobs),
        action_mask=pack_u8(mask),
        reward=reward,
        model_version=version,
        response_text="8",
        info={"correct": 1.0},
    )


def two_experiences(version: int = 3) -> ExperienceGroup:
    """Two experiences of different lengths, the second with a masked token."""
    return make_group(
        "run",
        "t1",
        version,
        2,
        [1.0, 0.0],
        explorer="explorer-0",
        tokens=[(1, 5, 6, 7, 8, 2), (1, 5, 6, 7, 9, 9, 2)],
        logprobs=[(-0.5, -1.25), (-0.25, -2.0, -0.125)],
        masks=[(1, 1), (1, 0, 1)],
        response_text="8",
        infos=[{"correct": 1.0}] * 2,
        created_at=1700000000.5,
        workflow="math",
    )


# -- raw arrays ------------------------------------------------------------------------------


def test_arrays_are_little_endian_and_round_trip():
    assert pack_i32([1, -2]) == struct.pack("<ii", 1, -2)
    assert pack_f32([1.5, -0.25]) == struct.pack("<ff", 1.5, -0.25)
    assert pack_u8([1, 0, 1]) == b"\x01\x00\x01"
    ids = [0, 1, 2**31 - 1, -(2**31), 77]
    assert unpack_i32(pack_i32(ids)) == ids
    assert unpack_f32(pack_f32([-0.5, 3.0])) == [-0.5, 3.0]
    # float32, not float64: 0.1 comes back rounded to single precision
    assert unpack_f32(pack_f32([0.1]))[0] == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    assert unpack_f32(pack_f32([0.1]))[0] != 0.1
    assert unpack_u8(pack_u8([1, 0, 1])) == [1, 0, 1]


def test_experience_lengths_and_group_id():
    exp = make_experience(prompt=(1, 2, 3), response=(4, 5), logprobs=(0.0, 0.0))
    assert exp.num_tokens == 5
    assert exp.response_length == 2
    assert make_group_id("r", "t9", 2) == "r/t9@2"


# -- round trips -----------------------------------------------------------------------------


def test_task_round_trip():
    task = Task(
        id="arith-00042",
        prompt="3+5=",
        answer="8",
        workflow="math",
        epoch=2,
        metadata={"source": "unit"},
    )
    back = TASK.decode(TASK.encode(task), TASK.headers())
    assert back == task
    assert back.metadata == {"source": "unit"}


def test_task_defaults_fill_in():
    back = TASK.decode(msgspec.msgpack.encode({"id": "t", "prompt": "1+1="}))
    assert back == Task(id="t", prompt="1+1=", answer="", workflow="math", epoch=0, metadata={})


def test_experience_group_round_trip_keeps_arrays_bit_exact():
    group = two_experiences()
    data = EXPERIENCE_GROUP.encode(group)
    back = EXPERIENCE_GROUP.decode(data, EXPERIENCE_GROUP.headers())
    assert back == group
    second = back.experiences[1]
    assert unpack_i32(second.tokens) == [1, 5, 6, 7, 9, 9, 2]
    assert second.prompt_length == 4
    assert unpack_f32(second.logprobs) == [-0.25, -2.0, -0.125]
    assert list(second.action_mask) == [1, 0, 1]
    assert second.reward == 0.0
    # the arrays travel as msgpack bin, not as lists of numbers
    raw = msgspec.msgpack.decode(data)
    assert isinstance(raw["experiences"][0]["tokens"], bytes)


def dispatch(event) -> tuple:
    match event:
        case ModelVersionReady(version=v, uri=uri):
            return ("ready", v, uri)
        case Shutdown(reason=reason):
            return ("shutdown", reason)
        case SyncRequest(explorer=who, min_version=v):
            return ("sync", who, v)
    return ("unknown",)


def test_control_union_round_trip_and_dispatch():
    events = [
        ModelVersionReady(
            version=12,
            method="object_store",
            uri="s3://bucket/run/v000012/manifest.json",
            manifest_sha256="ab" * 32,
            bytes=123456,
            step=12,
            lora=True,
            created_at=5.0,
        ),
        Shutdown(reason="done", created_at=6.0),
        SyncRequest(explorer="explorer-1", min_version=4),
    ]
    decoded = [CONTROL.decode(CONTROL.encode(e), CONTROL.headers()) for e in events]
    assert decoded == events
    assert [type(d) for d in decoded] == [ModelVersionReady, Shutdown, SyncRequest]
    assert [dispatch(d) for d in decoded] == [
        ("ready", 12, "s3://bucket/run/v000012/manifest.json"),
        ("shutdown", "done"),
        ("sync", "explorer-1", 4),
    ]


def test_control_tag_on_the_wire():
    raw = msgspec.msgpack.decode(CONTROL.encode(Shutdown(reason="x")))
    assert raw["type"] == "shutdown"
    # a message written by hand (another language, a CLI) decodes by its tag
    event = CONTROL.decode(
        msgspec.msgpack.encode({"type": "sync_request", "explorer": "e", "min_version": 7})
    )
    assert event == SyncRequest(explorer="e", min_version=7)
    with pytest.raises(SchemaError, match="control"):
        CONTROL.decode(msgspec.msgpack.encode({"type": "reboot_the_universe"}))


def test_status_round_trip():
    ev = StatusEvent(
        component="explorer-0",
        role="explorer",
        state=RunState.WAITING_SYNC,
        step=7,
        version=6,
        created_at=1.0,
        detail="waiting for v7",
        counters={"groups_published": 224.0},
    )
    back = STATUS.decode(STATUS.encode(ev), STATUS.headers())
    assert back == ev
    assert back.state is RunState.WAITING_SYNC
    assert msgspec.msgpack.decode(STATUS.encode(ev))["state"] == "WAITING_SYNC"
    bad = msgspec.msgpack.encode({**msgspec.to_builtins(ev), "state": "DANCING"})
    with pytest.raises(SchemaError):
        STATUS.decode(bad)


def test_metrics_round_trip_with_ledger():
    ev = MetricsEvent(
        run="r",
        component="trainer",
        step=3,
        version=3,
        values={"loss": -0.5, "reward_mean": 0.25},
        trained=[TrainedGroup("r/t1@0/e0", 2), TrainedGroup("r/t2@0/e0", 3)],
    )
    data = METRICS.encode(ev)
    back = METRICS.decode(data, METRICS.headers())
    assert back == ev
    assert back.trained[1].group_id == "r/t2@0/e0"
    assert back.trained[1].model_version == 3
    # ledger rows are compact arrays, not maps
    assert msgspec.msgpack.decode(data)["trained"] == [["r/t1@0/e0", 2], ["r/t2@0/e0", 3]]
    assert (
        METRICS.decode(
            METRICS.encode(
                MetricsEvent(run="r", component="explorer-0", step=1, version=0, values={})
            )
        ).trained
        == []
    )


def test_dead_letter_round_trip():
    dl = DeadLetter(
        source_topic="streamrft.r.experiences",
        partition=2,
        offset=99,
        key=None,
        value=b"\xc1\x00garbage",
        reason="not msgpack",
        error_type="SchemaError",
        component="trainer",
        created_at=3.0,
    )
    back = DEAD_LETTER.decode(DEAD_LETTER.encode(dl), DEAD_LETTER.headers())
    assert back == dl
    assert back.key is None
    assert back.value == b"\xc1\x00garbage"


def test_manifest_round_trip_is_readable_json():
    manifest = WeightManifest(
        version=4,
        step=4,
        run="r",
        shards=[
            ShardInfo(
                name="model-00001.safetensors",
                sha256="0f" * 32,
                bytes=1024,
                tensors=["a.weight", "b.weight"],
            ),
            ShardInfo(name="model-00002.safetensors", sha256="e1" * 32, bytes=10),
        ],
        total_bytes=1034,
        created_at=2.5,
    )
    data = encode_manifest(manifest)
    as_json = json.loads(data)
    assert as_json["shards"][1]["name"] == "model-00002.safetensors"
    assert as_json["format"] == "safetensors"
    assert decode_manifest(data) == manifest
    with pytest.raises(SchemaError, match="manifest"):
        decode_manifest(b"{not json")
    with pytest.raises(SchemaError, match="manifest"):
        decode_manifest(b'{"version": "four", "step": 4, "run": "r"}')


def test_codec_by_kind_covers_every_topic_kind():
    assert set(CODEC_BY_KIND) == set(TOPIC_KINDS)
    assert CODEC_BY_KIND["experiences"] is EXPERIENCE_GROUP
    assert CODEC_BY_KIND["control"] is CONTROL


# -- schema evolution ------------------------------------------------------------------------


class ThingV1(msgspec.Struct, kw_only=True):
    id: str
    score: float


class ThingV2(msgspec.Struct, kw_only=True):
    id: str
    score: float
    tags: list[str] = []


class ThingV2Required(msgspec.Struct, kw_only=True):
    id: str
    score: float
    tags: list[str]


def test_evolution_with_msgspec_directly():
    new_bytes = msgspec.msgpack.encode(ThingV2(id="a", score=0.5, tags=["x"]))
    old_bytes = msgspec.msgpack.encode(ThingV1(id="a", score=0.5))
    assert msgspec.msgpack.decode(new_bytes, type=ThingV1) == ThingV1(id="a", score=0.5)
    assert msgspec.msgpack.decode(old_bytes, type=ThingV2) == ThingV2(id="a", score=0.5, tags=[])


def test_evolution_through_codec():
    old, new = Codec(ThingV1, "thing"), Codec(ThingV2, "thing")
    assert old.decode(new.encode(ThingV2(id="b", score=2.0, tags=["y"])), new.headers()) == ThingV1(
        id="b", score=2.0
    )
    assert new.decode(old.encode(ThingV1(id="b", score=2.0)), old.headers()) == ThingV2(
        id="b", score=2.0, tags=[]
    )
    # why the rule says "with a default": a required new field cannot read old messages
    with pytest.raises(SchemaError, match="tags"):
        Codec(ThingV2Required, "thing").decode(old.encode(ThingV1(id="b", score=2.0)))


class FutureTask(msgspec.Struct, kw_only=True):
    """Task as a later release might write it: one more trailing field."""

    id: str
    prompt: str
    answer: str = ""
    workflow: str = "math"
    epoch: int = 0
    metadata: dict[str, str] = {}
    priority: int = 0


class OldTask(msgspec.Struct, kw_only=True):
    """Task as an earlier release wrote it: no epoch, no metadata."""

    id: str
    prompt: str
    answer: str = ""
    workflow: str = "math"


class FutureTrainedGroup(msgspec.Struct, array_like=True):
    group_id: str
    model_version: int
    weight: float = 1.0


def test_real_types_evolve_both_ways():
    future = FutureTask(id="t", prompt="1+2=", answer="3", epoch=1, priority=9)
    assert TASK.decode(msgspec.msgpack.encode(future)) == Task(
        id="t", prompt="1+2=", answer="3", epoch=1
    )
    old = OldTask(id="t", prompt="1+2=", answer="3")
    assert TASK.decode(msgspec.msgpack.encode(old)) == Task(
        id="t", prompt="1+2=", answer="3", epoch=0, metadata={}
    )
    # array-like ledger rows evolve too: extra trailing items are ignored
    row = msgspec.msgpack.encode(FutureTrainedGroup("g", 5, 0.5))
    assert msgspec.msgpack.decode(row, type=TrainedGroup) == TrainedGroup("g", 5)


# -- invariants ------------------------------------------------------------------------------


def test_valid_group_passes_validation():
    group = two_experiences()
    assert validate_group(group) is group


def _seg(start: int, version: int) -> Segment:
    return Segment(start=start, version=version)


def test_a_partial_rollout_passes_and_counts_by_its_oldest_segment():
    """An experience sampled by versions 3 then 5 (its first response token by 3, the
    second by 5) in a group of version 3 passes; so does a whole experience newer than its
    group (an episode started after a version changed mid-step)."""
    group = _with_first(segments=[_seg(0, 3), _seg(1, 5)])
    assert validate_group(EXPERIENCE_GROUP.decode(EXPERIENCE_GROUP.encode(group))) == group
    newer = _with_first(model_version=4)
    assert validate_group(newer).experiences[0].model_version == 4


def _with_first(**changes) -> ExperienceGroup:
    group = two_experiences()
    first = msgspec.structs.replace(group.experiences[0], **changes)
    return msgspec.structs.replace(group, experiences=[first, *group.experiences[1:]])


@pytest.mark.parametrize(
    ("group_factory", "message"),
    [
        (lambda: _with_first(tokens=pack_i32([1, 5, 6, 7, 8, 2]) + b"\x00"), "multiple of 4"),
        (lambda: _with_first(logprobs=pack_f32([-0.5])), "logprobs is 4 bytes, expected 8"),
        (lambda: _with_first(logprobs=pack_f32([-0.5, -1.0, -2.0])), "logprobs"),
        (lambda: _with_first(action_mask=pack_u8([1])), "action_mask is 1 bytes, expected 2"),
        (lambda: _with_first(action_mask=pack_u8([1, 1, 1])), "action_mask"),
        (lambda: _with_first(prompt_length=0), "prompt_length 0 outside"),
        (lambda: _with_first(prompt_length=6), "prompt_length 6 outside"),  # no response
        (lambda: _with_first(prompt_length=9), "prompt_length 9 outside"),
        (lambda: _with_first(prompt_length=-1), "prompt_length -1 outside"),
        (lambda: _with_first(reward=math.nan), "not finite"),
        (lambda: _with_first(reward=math.inf), "not finite"),
        (lambda: _with_first(reward=-math.inf), "not finite"),
        (lambda: _with_first(model_version=2), "model_version 2 below the group's 3"),
        (lambda: make_group("run", "t1", 3, 0), "no experiences"),
        (lambda: two_experiences(version=-1), "model_version -1 < 0"),
        (lambda: _with_first(segments=[Segment(start=1, version=3)]), "starts at 1 with"),
        (lambda: _with_first(segments=[Segment(start=0, version=4)]), "not at 0 with model"),
        (lambda: _with_first(segments=[_seg(0, 3), _seg(2, 4)]), r"not within \(0, 2\)"),
        (lambda: _with_first(segments=[_seg(0, 3), _seg(0, 4)]), r"not within \(0, 2\)"),
        (lambda: _with_first(segments=[_seg(0, 3), _seg(1, 3)]), "not newer than 3"),
        (lambda: _with_first(segments=[_seg(0, 3)] * 1025), "1025 segments, over 1024"),
    ],
    ids=[
        "tokens-bytes",
        "logprobs-short",
        "logprobs-long",
        "mask-short",
        "mask-long",
        "prompt-zero",
        "prompt-all",
        "prompt-beyond",
        "prompt-negative",
        "reward-nan",
        "reward-inf",
        "reward-neg-inf",
        "version-mismatch",
        "empty",
        "negative-version",
        "segment-not-at-0",
        "segment-version-not-the-experiences",
        "segment-past-the-response",
        "segment-not-after-the-one-before",
        "segment-not-newer",
        "segments-too-many",
    ],
)
def test_validate_group_rejects(group_factory, message):
    group = group_factory()
    with pytest.raises(SchemaError, match=message):
        validate_group(group)
    # the experiences codec validates on decode too
    with pytest.raises(SchemaError, match=message):
        EXPERIENCE_GROUP.decode(EXPERIENCE_GROUP.encode(group))


def test_validation_error_names_the_experience():
    group = _with_first(reward=math.nan)
    with pytest.raises(SchemaError, match=r"experience 'run/t1@0#0'"):
        validate_group(group)


# -- decode failures -------------------------------------------------------------------------


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x93\x01\x02", b"not msgpack at all"])
def test_decode_garbage_raises_schema_error(garbage):
    with pytest.raises(SchemaError, match=r"^task: "):
        TASK.decode(garbage)


def test_decode_wrong_field_type_raises_schema_error():
    with pytest.raises(SchemaError, match="prompt"):
        TASK.decode(msgspec.msgpack.encode({"id": "t", "prompt": 42}))


def test_decode_none_value_raises_schema_error():
    with pytest.raises(SchemaError, match="null value"):
        CONTROL.decode(None)


def test_decode_checks_headers():
    data = TASK.encode(Task(id="t", prompt="p"))
    assert TASK.headers() == [
        ("streamrft-schema", str(SCHEMA_VERSION).encode()),
        ("streamrft-type", b"task"),
    ]
    with pytest.raises(SchemaError, match="message is of type 'control'"):
        TASK.decode(data, CONTROL.headers())
    newer = [("streamrft-schema", str(SCHEMA_VERSION + 1).encode()), ("streamrft-type", b"task")]
    with pytest.raises(SchemaError, match="newer"):
        TASK.decode(data, newer)
    with pytest.raises(SchemaError, match="bad schema header"):
        TASK.decode(data, [("streamrft-schema", b"one")])
    # same or older version, unrelated headers, or no headers at all are fine
    assert TASK.decode(data, [("streamrft-schema", b"0"), ("trace-id", b"xyz")]).id == "t"
    assert TASK.decode(data, []).id == "t"
    assert TASK.decode(data).id == "t"


def test_headers_are_a_copy():
    headers = TASK.headers()
    headers.append(("x", b"y"))
    assert len(TASK.headers()) == 2


# -- topic names -----------------------------------------------------------------------------


def test_topic_names():
    names = TopicNames("streamrft", "arith-20260101_1")
    assert names.tasks == "streamrft.arith-20260101_1.tasks"
    assert names.experiences == "streamrft.arith-20260101_1.experiences"
    assert names.control == "streamrft.arith-20260101_1.control"
    assert names.status == "streamrft.arith-20260101_1.status"
    assert names.metrics == "streamrft.arith-20260101_1.metrics"
    assert names.dead_letters == "streamrft.arith-20260101_1.dead_letters"
    assert names.all() == {k: f"streamrft.arith-20260101_1.{k}" for k in TOPIC_KINDS}
    assert names.samples == "streamrft.arith-20260101_1.samples"
    assert len(set(names.all().values())) == 7
    assert TopicNames.kind_of(names.control) == "control"
    assert TopicNames.kind_of("some.other.topic") is None
    with pytest.raises(ConfigError, match="unknown topic kind 'bogus'"):
        names.of("bogus")


@pytest.mark.parametrize(
    ("prefix", "run", "field"),
    [
        ("stream.rft", "r", "kafka.topic_prefix"),
        ("", "r", "kafka.topic_prefix"),
        ("p", "my run", "run.id"),
        ("p", "a/b", "run.id"),
        ("p", "", "run.id"),
    ],
)
def test_bad_topic_names_raise_config_error(prefix, run, field):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        TopicNames(prefix, run)


# -- nothing heavy ---------------------------------------------------------------------------


HEAVY = ("torch", "aiokafka", "numpy", "minio")


def test_import_schemas_loads_nothing_heavy():
    loaded = modules_after_import("streamrft.schemas")
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []
    assert "msgspec" in loaded  # the probe does see imported modules
