"""Bad input: size limits, hardened validators, and 10,000+ hostile messages at every codec.

Whatever a message holds, ``decode`` returns a valid object or raises SchemaError; nothing
else (no UnicodeDecodeError, RecursionError, OverflowError...) may escape to a consumer.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest

from streamrft.schemas import (
    CODEC_BY_KIND,
    CONTROL,
    EXPERIENCE_GROUP,
    METRICS,
    STATUS,
    TASK,
    TOPIC_KINDS,
    ExperienceGroup,
    MetricsEvent,
    ModelVersionReady,
    SchemaError,
    Shutdown,
    StatusEvent,
    SyncRequest,
    Task,
    TrainedGroup,
    VersionsRetired,
    check_token_ids,
    dead_letter_of,
    limits,
)
from streamrft.schemas.codec import DEAD_LETTER_REASON_CHARS
from tests.harness.fuzz import (
    MUTATIONS,
    FuzzMessage,
    can_oversize,
    expected_valid,
    fuzz_messages,
    sample_messages,
)
from tests.helpers.groups import make_group

pytestmark = pytest.mark.unit

TYPES = {
    "tasks": Task,
    "experiences": ExperienceGroup,
    "control": (ModelVersionReady, Shutdown, SyncRequest, VersionsRetired),
    "status": StatusEvent,
    "metrics": MetricsEvent,
}


def _decode_or_schema_error(kind: str, value: bytes | None, headers) -> bool:
    """True when accepted (and then the object is of the topic's type and re-encodes)."""
    codec = CODEC_BY_KIND[kind]
    try:
        obj = codec.decode(value, headers)
    except SchemaError as exc:
        assert str(exc), "a SchemaError must say what was wrong"
        return False
    if kind in TYPES:
        assert isinstance(obj, TYPES[kind])
    # what was accepted is valid through and through (bytes compared: NaN != NaN)
    data = codec.encode(obj)
    assert codec.encode(codec.decode(data)) == data
    return True


# -- the fuzz --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TOPIC_KINDS)
def test_codec_survives_fuzz(kind):
    """1,800 generated messages per kind (10,800 in all) plus each seed with null headers."""
    messages = fuzz_messages(kind, 1800, seed=20260101 + TOPIC_KINDS.index(kind))
    outcome: Counter[tuple[str, bool]] = Counter()
    for msg in messages:
        ok = _decode_or_schema_error(kind, msg.value, msg.headers)
        outcome[(msg.mutation, ok)] += 1
        # headers are optional: another application may send none
        _decode_or_schema_error(kind, msg.value, None)
    made = {m for m, _ in outcome}
    expected = set(MUTATIONS) - (set() if can_oversize(kind) else {"oversized"})
    assert made == expected
    # never accepted, whatever the kind
    for mutation in ("random_bytes", "null", "other_topic", "bad_header", "oversized"):
        assert outcome[(mutation, True)] == 0, mutation
    assert outcome[("valid", False)] == 0
    # the mix exercises both outcomes: damaged messages that still decode are legitimate
    assert sum(n for (_, ok), n in outcome.items() if ok) > 100
    assert sum(n for (_, ok), n in outcome.items() if not ok) > 1000


def test_fuzz_of_foreign_samples_and_random_blobs():
    """Every codec fed every other kind's mutations, and hand-made hostile msgpack."""
    hostile = [
        b"\x91" * 200_000 + b"\xc0",  # nesting far deeper than any limit
        b"\x81\xa1x" * 100_000 + b"\xc0",
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 billion items
        b"\xdf\xff\xff\xff\xff",
        b"\xdb\xff\xff\xff\xff",  # a 4 GiB string header
        b"\xc6\xff\xff\xff\xff",
        b"\xd4\x01\x00",  # an extension type
        b"\xd6\xff\x00\x00\x00\x00",  # a timestamp
        b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
        b"\x81\xa8metadata\xdf\xff\xff\xff\xff",
        b"\xa4\xed\xa0\x80x",  # a surrogate in UTF-8
    ]
    n = 0
    for kind in TOPIC_KINDS:
        foreign = [s for k in TOPIC_KINDS if k != kind for s in sample_messages(k)]
        for msg in fuzz_messages(kind, 300, seed=7, samples=foreign):
            _decode_or_schema_error(kind, msg.value, msg.headers)
            n += 1
        for blob in hostile:
            assert not _decode_or_schema_error(kind, blob, None)
            n += 1
    assert n > 1800


def test_fuzz_is_deterministic_and_expected_valid_matches_the_codec():
    a = fuzz_messages("control", 300, seed=3)
    b = fuzz_messages("control", 300, seed=3)
    assert a == b
    assert a != fuzz_messages("control", 300, seed=4)
    for msg in a:
        try:
            CONTROL.decode(msg.value, msg.headers)
            accepted = True
        except SchemaError:
            accepted = False
        assert expected_valid("control", msg) is accepted


def test_oversized_messages_pass_the_broker_but_not_the_codec():
    msgs = [m for m in fuzz_messages("control", 2000, seed=5) if m.mutation == "oversized"]
    assert msgs
    for m in msgs:
        assert CONTROL.max_bytes < len(m.value) < (16 << 20) - (64 << 10)
        with pytest.raises(SchemaError, match="over the limit"):
            CONTROL.decode(m.value, m.headers)
    # experience groups may be as large as the broker allows: none are made for them
    assert not can_oversize("experiences")
    assert all(m.mutation != "oversized" for m in fuzz_messages("experiences", 2000, seed=5))
    with pytest.raises(ValueError, match="unknown topic kind"):
        fuzz_messages("bogus", 1, seed=0)


def test_expected_valid_with_a_vocabulary():
    msg = FuzzMessage(
        value=EXPERIENCE_GROUP.encode(_group(tokens=(1, 2, 40, 3), prompt_length=2)),
        headers=EXPERIENCE_GROUP.headers(),
    )
    assert expected_valid("experiences", msg)
    assert expected_valid("experiences", msg, vocab_size=41)
    assert not expected_valid("experiences", msg, vocab_size=40)


# -- size limits -----------------------------------------------------------------------------


def test_every_codec_has_a_size_limit_checked_before_decoding():
    assert TASK.max_bytes == limits.TASK_MAX_BYTES == 1 << 20
    assert CONTROL.max_bytes == STATUS.max_bytes == 1 << 20
    assert METRICS.max_bytes == 4 << 20
    assert EXPERIENCE_GROUP.max_bytes == CODEC_BY_KIND["dead_letters"].max_bytes == 16 << 20
    for kind, codec in CODEC_BY_KIND.items():
        sample = msgspec.msgpack.decode(sample_messages(kind)[0])
        at_limit = msgspec.msgpack.encode({**sample, "pad": ""})
        at_limit = msgspec.msgpack.encode(
            {**sample, "pad": "p" * (codec.max_bytes - len(at_limit) - 4)}
        )
        assert len(at_limit) == codec.max_bytes
        codec.decode(at_limit)  # a message of exactly the limit is fine
        over = b"\xc1" * (codec.max_bytes + 1)  # not even msgpack: refused for its size alone
        with pytest.raises(
            SchemaError, match=rf"message of {codec.max_bytes + 1} bytes is over the limit"
        ):
            codec.decode(over)


def test_metrics_limit_holds_a_large_ledger():
    """A step of 10,000 groups with long ids is a fraction of the metrics limit."""
    ev = MetricsEvent(
        run="r" * 64,
        component="trainer",
        step=1,
        version=0,
        values={f"train/m{i}": float(i) for i in range(100)},
        trained=[TrainedGroup(f"{'r' * 64}/{'t' * 40}-{i:06d}@12", 10**6) for i in range(10_000)],
    )
    data = METRICS.encode(ev)
    assert len(data) < METRICS.max_bytes / 3
    assert METRICS.decode(data) == ev


# -- validators ------------------------------------------------------------------------------


def _group(
    n: int = 2,
    tokens: tuple[int, ...] = (1, 5, 6, 7, 8, 2),
    prompt_length: int = 4,
    logprobs: tuple[float, ...] = (-0.5, -1.25),
    mask: tuple[int, ...] = (1, 1),
    reward: float = 1.0,
    task: str = "t1",
    group_id: str = "run/t1@0",
    explorer: str = "explorer-0",
    **group_fields,
) -> ExperienceGroup:
    """``n`` copies of one experience (each value given once), in a group of version 3."""
    return make_group(
        "run",
        task,
        3,
        n,
        [reward] * n,
        group_id=group_id,
        explorer=explorer,
        tokens=[tokens] * n,
        prompt_length=prompt_length,
        logprobs=[logprobs] * n,
        masks=[mask] * n,
        **group_fields,
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: _group(logprobs=(-0.5, math.nan)), "log-prob nan outside"),
        (lambda: _group(logprobs=(-math.inf, -1.0)), "log-prob -inf outside"),
        (lambda: _group(logprobs=(0.5, -1.0)), "log-prob 0.5 outside"),
        (lambda: _group(logprobs=(-1e30, -1.0)), "outside"),
        (lambda: _group(logprobs=(-81.0, -1.0)), "log-prob -81.0 outside"),
        (lambda: _group(mask=(1, 2)), "action_mask holds bytes other than 0 and 1"),
        (lambda: _group(tokens=(1, 5, -6, 7, 8, 2)), "negative token id"),
        (lambda: _group(reward=1e7), "reward 10000000.0 beyond"),
        (lambda: _group(reward=-1e300), "beyond"),
        (lambda: _group(n=limits.MAX_EXPERIENCES_PER_GROUP + 1), "1025 experiences, over 1024"),
        (lambda: _group(group_id=""), "group id is empty"),
        (lambda: _group(group_id="g" * 2000), "group id is 2000 characters, over 1024"),
        (lambda: _group(task=""), "task_id is empty"),
        (lambda: _group(explorer="e" * 5000), "explorer is 5000 characters"),
        (lambda: _group(workflow=""), "workflow is empty"),
        (
            lambda: _group(
                tokens=(1,) * (limits.MAX_TOKENS_PER_EXPERIENCE + 1),
                prompt_length=1,
                logprobs=(),
                mask=(),
            ),
            "262145 tokens, over 262144",
        ),
    ],
    ids=[
        "logprob-nan",
        "logprob-neg-inf",
        "logprob-positive",
        "logprob-huge",
        "logprob-below-floor",
        "mask-value",
        "negative-token",
        "reward-large",
        "reward-huge",
        "too-many-experiences",
        "empty-group-id",
        "long-group-id",
        "empty-task-id",
        "long-explorer",
        "empty-workflow",
        "too-many-tokens",
    ],
)
def test_validate_group_rejects_what_would_break_training(make, message):
    group = make()
    with pytest.raises(SchemaError, match=message):
        EXPERIENCE_GROUP.decode(EXPERIENCE_GROUP.encode(group))


def test_validate_group_accepts_edges():
    for group in (
        _group(logprobs=(0.0, -80.0), mask=(0, 0), reward=-1e6),
        _group(n=limits.MAX_EXPERIENCES_PER_GROUP),
        _group(
            group_id="g" * (limits.MAX_ID_CHARS - 8),  # "#<i>" follows in experience ids
            tokens=(0, 2**31 - 1, 3),
            prompt_length=2,
            logprobs=(-1.0,),
            mask=(1,),
        ),
    ):
        assert EXPERIENCE_GROUP.decode(EXPERIENCE_GROUP.encode(group)) == group


def test_check_token_ids_against_the_vocabulary():
    group = _group(tokens=(1, 5, 6, 7, 49, 2))
    assert check_token_ids(group, 50) is group
    with pytest.raises(SchemaError, match="token id 49 outside the model's vocabulary of 49"):
        check_token_ids(group, 49)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (Task(id="", prompt="1+1="), "task id is empty"),
        (Task(id="t" * 1025, prompt="1+1="), "task id is 1025 characters"),
        (Task(id="t", prompt="1+1=", workflow=""), "workflow is empty"),
        (Task(id="t", prompt="1+1=", epoch=-1), "epoch -1 < 0"),
        (
            ModelVersionReady(
                version=-1,
                method="object_store",
                uri="s3://b/k",
                manifest_sha256="",
                bytes=1,
                step=0,
            ),
            "version < 0",
        ),
        (
            ModelVersionReady(
                version=1, method="object_store", uri="", manifest_sha256="", bytes=1, step=0
            ),
            "uri of 0 characters",
        ),
        (
            ModelVersionReady(
                version=1, method="", uri="s3://b/k", manifest_sha256="", bytes=1, step=0
            ),
            "method is empty",
        ),
        (
            ModelVersionReady(
                version=1, method="m", uri="s3://b/k", manifest_sha256="", bytes=-5, step=0
            ),
            "bytes -5",
        ),
        (
            ModelVersionReady(
                version=1,
                method="m",
                uri="s3://b/k",
                manifest_sha256="",
                bytes=5,
                step=0,
                created_at=math.nan,
            ),
            "created_at nan is not finite",
        ),
        (Shutdown(reason="x", created_at=math.inf), "shutdown: created_at inf"),
        (SyncRequest(explorer="", min_version=1), "explorer is empty"),
        (SyncRequest(explorer="e", min_version=-2), "min_version -2 < 0"),
        (
            StatusEvent(component="", role="explorer", state="RUNNING", step=0, version=0),
            "component is empty",
        ),
        (
            MetricsEvent(run="r", component="c", step=0, version=0, values={}, created_at=math.nan),
            "not finite",
        ),
        (
            MetricsEvent(
                run="r", component="c", step=0, version=0, values={}, trained=[TrainedGroup("", 1)]
            ),
            "ledger group id is empty",
        ),
    ],
)
def test_event_and_task_validators(obj, message):
    codec = {
        Task: TASK,
        StatusEvent: STATUS,
        MetricsEvent: METRICS,
    }.get(type(obj), CONTROL)
    with pytest.raises(SchemaError, match=message):
        codec.decode(codec.encode(obj))


def test_metrics_values_may_be_nan():
    """A diverged loss is worth seeing on a dashboard: values are not range-checked."""
    ev = MetricsEvent(run="r", component="c", step=0, version=0, values={"train/loss": math.nan})
    assert math.isnan(METRICS.decode(METRICS.encode(ev)).values["train/loss"])


# -- dead letters ----------------------------------------------------------------------------


def test_dead_letter_keeps_the_message_whole_when_it_fits():
    exc = SchemaError("experience_group: bad")
    dl = dead_letter_of("t.r.experiences", 2, 9, b"k", b"\xc1" * 1000, exc, "trainer")
    assert (dl.source_topic, dl.partition, dl.offset) == ("t.r.experiences", 2, 9)
    assert dl.key == b"k" and dl.value == b"\xc1" * 1000
    assert dl.reason == "experience_group: bad" and dl.error_type == "SchemaError"
    assert dl.component == "trainer" and dl.created_at > 0
    assert CODEC_BY_KIND["dead_letters"].decode(CODEC_BY_KIND["dead_letters"].encode(dl)) == dl


def test_dead_letter_fits_whatever_it_records():
    long_reason = SchemaError("x" * 1_000_000)
    big = b"v" * (16 << 20)
    dl = dead_letter_of("t.r.control", 0, 1, b"k" * (9 << 20), big, long_reason, "bus", 16 << 20)
    assert dl.value is None and dl.key is None
    assert len(dl.reason) < DEAD_LETTER_REASON_CHARS + 300
    assert "(1000000 characters)" in dl.reason
    assert f"value of {16 << 20} bytes not kept" in dl.reason
    assert f"key of {9 << 20} bytes not kept" in dl.reason
    assert len(CODEC_BY_KIND["dead_letters"].encode(dl)) < 16 << 10
    # a smaller broker limit is respected too; the key is kept when it fits
    dl = dead_letter_of("t", 0, 1, b"key", b"v" * (2 << 20), SchemaError("big"), "bus", 1 << 20)
    assert dl.value is None and dl.key == b"key"
    dl = dead_letter_of("t", 0, 1, None, None, ValueError(), "bus")
    assert dl.reason == "ValueError" and dl.error_type == "ValueError"
