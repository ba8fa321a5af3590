"""Hostile input: random and mutated messages for any topic kind, and a way to publish them.

Used by the codec fuzz test, the bad-input integration test and the reliability benchmark.
:func:`fuzz_messages` mixes (seeded, so a failure can be replayed):

- ``random_bytes``: noise, including the empty message;
- ``truncate``, ``bit_flip``, ``byte_edit``, ``splice``: damaged real messages;
- ``field_edit``: a real message with one field replaced (wrong type, None, NaN, huge or
  negative number, long string), removed, or an unknown field added;
- ``wrong_schema``: valid msgpack of some random shape;
- ``deep_nesting``: a real message with an unknown field nested thousands of levels deep;
- ``other_topic``: a valid message of another topic's type, with that type's header;
- ``bad_header``: a real message with a foreign type header or a bad / future schema version;
- ``oversized``: a real message padded past the codec's size limit (but under the broker's,
  so it is accepted and the reader has to refuse it);
- ``null``: no value at all;
- ``valid``: a real message unchanged.

Many ``bit_flip`` / ``field_edit`` results still decode (a flipped bit in a reward or a
name): they are then legitimate messages, as if from another application, and a consumer
acts on them. :func:`expected_valid` says, by calling the codec, which ones a consumer
accepts, so a harness knows exactly which offsets must end in a dead letter.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrft.infra import kafka
from streamrft.infra.config import Config
from streamrft.schemas.codec import CODEC_BY_KIND, HEADER_SCHEMA, HEADER_TYPE, SCHEMA_VERSION
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.events import (
    DeadLetter,
    MetricsEvent,
    ModelVersionReady,
    RunState,
    StatusEvent,
    SyncRequest,
    TrainedGroup,
    VersionsRetired,
)
from streamrft.schemas.experience import (
    ChatMessage,
    ExperienceGroup,
    Segment,
    Task,
    check_token_ids,
)
from streamrft.schemas.samples import Sample, SamplePart
from streamrft.schemas.topics import TOPIC_KINDS, TopicNames
from tests.helpers.groups import make_group

BROKER_MAX_BYTES = 16 << 20
"""The broker's default largest message (``kafka.max_request_bytes``)."""
RECORD_MARGIN_BYTES = 64 << 10
"""Room left for the key, headers and record framing when sizing oversized values."""
SAMPLE_VOCAB = 12
"""Token ids of the built-in experience samples lie below this (any tiny model has them)."""

MUTATIONS: dict[str, float] = {
    "random_bytes": 10,
    "truncate": 12,
    "bit_flip": 20,
    "byte_edit": 8,
    "splice": 6,
    "field_edit": 16,
    "wrong_schema": 8,
    "deep_nesting": 2,
    "other_topic": 7,
    "bad_header": 5,
    "oversized": 1,
    "null": 3,
    "valid": 4,
}
"""Kinds of message :func:`fuzz_messages` makes, with their relative weights."""


@dataclass(frozen=True)
class FuzzMessage:
    """One message to publish: what Kafka carries, and how it was made."""

    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    key: bytes | None = None
    mutation: str = "valid"


def sample_messages(kind: str) -> list[bytes]:
    """A few valid encoded messages of topic ``kind``: the default seeds for mutation.

    Control samples hold no :class:`Shutdown`: a valid one would (rightly) stop the run.
    """
    codec = CODEC_BY_KIND[kind]
    return [codec.encode(obj) for obj in _SAMPLES[kind]()]


def _experience_samples() -> list[ExperienceGroup]:
    """Groups of 2, 4 and 3 experiences whose responses are 3, 2 and 5 tokens long; the
    last group's first experience a partial rollout (versions 0 then 1 from its third
    response token)."""
    groups = []
    for g, (n, width) in enumerate([(2, 3), (4, 2), (3, 5)]):
        groups.append(
            make_group(
                "fuzz",
                f"task-{g}",
                0,
                n,
                explorer="explorer-fuzz",
                tokens=[
                    [1, 3 + i % 4, 4, *[(5 + i + j) % SAMPLE_VOCAB for j in range(width)]]
                    for i in range(n)
                ],
                prompt_length=3,
                logprobs=[[-0.5 - 0.25 * j for j in range(width)]] * n,
                masks=[[1] * (width - 1) + [i % 2] for i in range(n)],
                response_text="7",
                infos=[{"correct": float(i % 2)} for i in range(n)],
                created_at=1.7e9,
            )
        )
    last = groups[-1]
    partial = msgspec.structs.replace(
        last.experiences[0], segments=[Segment(start=0, version=0), Segment(start=2, version=1)]
    )
    groups[-1] = msgspec.structs.replace(last, experiences=[partial, *last.experiences[1:]])
    return groups


_SAMPLES: dict[str, Any] = {
    "tasks": lambda: [
        Task(id="arith-00001", prompt="3+5=", answer="8"),
        Task(id="arith-00002", prompt="12+30=", answer="42", epoch=1, metadata={"src": "fuzz"}),
        Task(
            id="chat-00003",
            answer="12",
            messages=[
                ChatMessage(role="system", content="Answer in <answer></answer> tags."),
                ChatMessage(role="user", content="Tom has 7 apples and buys 5 more. How many?"),
            ],
        ),
    ],
    "experiences": _experience_samples,
    "control": lambda: [
        ModelVersionReady(
            version=3,
            method="object_store",
            uri="s3://bucket/fuzz/v000003/manifest.json",
            manifest_sha256="ab" * 32,
            bytes=123456,
            step=3,
            created_at=1.7e9,
        ),
        ModelVersionReady(
            version=4,
            method="filesystem",
            uri="file:///runs/fuzz/v000004/manifest.json",
            manifest_sha256="ab" * 32,
            bytes=4096,
            step=4,
            created_at=1.7e9,
            delta_base=3,
            state_sha256="cd" * 32,
        ),
        SyncRequest(explorer="explorer-fuzz", min_version=2, created_at=1.7e9),
        VersionsRetired(versions=[0, 1, 2], created_at=1.7e9),
    ],
    "status": lambda: [
        StatusEvent(
            component="explorer-fuzz",
            role="explorer",
            state=RunState.RUNNING,
            step=4,
            version=2,
            created_at=1.7e9,
            counters={"groups_published": 12.0},
        )
    ],
    "metrics": lambda: [
        MetricsEvent(
            run="fuzz",
            component="trainer-fuzz",
            step=2,
            version=1,
            values={"train/loss": 0.25, "train/reward_mean": 0.5},
            created_at=1.7e9,
            trained=[TrainedGroup("fuzz/task-0@0", 1), TrainedGroup("fuzz/task-1@0", 0)],
        )
    ],
    "dead_letters": lambda: [
        DeadLetter(
            source_topic="streamrft.fuzz.experiences",
            partition=0,
            offset=7,
            key=b"task-0",
            value=b"\xc1garbage",
            reason="experience_group: bad",
            error_type="SchemaError",
            component="trainer-fuzz",
            created_at=1.7e9,
        )
    ],
    "samples": lambda: [
        Sample(
            experience_id="fuzz/task-0@0#1",
            task_id="task-0",
            explorer="explorer-fuzz",
            explorer_step=3,
            workflow="tool_calling",
            model_version=2,
            reward=0.5,
            parts=[
                SamplePart(role="prompt", text="3+4="),
                SamplePart(role="policy", text="<tool>calculator(3+4)</tool>"),
                SamplePart(role="inserted", text="\n\n7\n\n"),
                SamplePart(role="policy", text="7"),
            ],
            versions=[2, 3],
            info={"turns": 2.0},
            created_at=1.7e9,
        )
    ],
}


# -- generation ------------------------------------------------------------------------------


def _random_scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            rng.randint(-(2**63), 2**64 - 1),
            rng.randint(-3, 300),
            rng.uniform(-1e6, 1e6),
            math.nan,
            math.inf,
            -math.inf,
            "",
            "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 24))),
            rng.randbytes(rng.randint(0, 24)),
        ]
    )


def _random_obj(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 4 or roll < 0.5:
        return _random_scalar(rng)
    if roll < 0.75:
        return [_random_obj(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {
        rng.choice(["id", "type", "version", "value", "x", str(rng.randint(0, 99))]): _random_obj(
            rng, depth + 1
        )
        for _ in range(rng.randint(0, 5))
    }


def _hostile_value(rng: random.Random, old: Any) -> Any:
    """A replacement for one field: wrong type, None, an edge number or a long string."""
    return rng.choice(
        [
            lambda: None,
            lambda: _random_obj(rng),
            lambda: -1,
            lambda: 0,
            lambda: 2**63 - 1,
            lambda: -(2**63),
            lambda: math.nan,
            lambda: math.inf,
            lambda: 1e300,
            lambda: "",
            lambda: "x" * rng.choice([2000, 100_000]),
            lambda: b"",
            lambda: rng.randbytes(rng.randint(1, 64)),
            lambda: [old, old] if old is not None else [],
            lambda: {"type": "shutdown"} if rng.random() < 0.1 else {"nested": old},
        ]
    )()


def _field_edit(rng: random.Random, sample: bytes) -> bytes:
    obj = msgspec.msgpack.decode(sample)
    # walk down a random path of maps and arrays; edit the container reached
    parent: Any = obj
    for _ in range(rng.randint(0, 4)):
        children = list(parent.values()) if isinstance(parent, dict) else parent
        inner = [c for c in children if isinstance(c, dict | list) and c]
        if not inner:
            break
        parent = rng.choice(inner)
    if isinstance(parent, dict) and parent:
        name = rng.choice(list(parent))
        action = rng.random()
        if action < 0.15:
            del parent[name]
        elif action < 0.25:
            parent[f"unknown_{rng.randint(0, 9)}"] = _random_obj(rng)
        else:
            parent[name] = _hostile_value(rng, parent[name])
    elif isinstance(parent, list) and parent:
        i = rng.randrange(len(parent))
        if rng.random() < 0.2:
            del parent[i]
        else:
            parent[i] = _hostile_value(rng, parent[i])
    return msgspec.msgpack.encode(obj)


def _bit_flip(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _byte_edit(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(buf) + 1)
        op = rng.random()
        if op < 0.4 and buf:
            buf[min(i, len(buf) - 1)] = rng.choice([0x00, 0xFF, 0xC1, 0xDD, 0xDF, 0x7F, 0xCB])
        elif op < 0.7:
            buf[i:i] = rng.randbytes(rng.randint(1, 8))
        else:
            del buf[i : i + rng.randint(1, 8)]
    return bytes(buf)


def _deep_nesting(rng: random.Random, sample: bytes) -> bytes:
    """``sample`` with a first, unknown field of arrays nested ``depth`` levels deep."""
    marked = msgspec.msgpack.encode({"deep": None, **msgspec.msgpack.decode(sample)})
    depth = rng.choice([2_000, 100_000])
    return marked.replace(b"\xa4deep\xc0", b"\xa4deep" + b"\x91" * depth + b"\xc0", 1)


def _headers_for(rng: random.Random, kind: str) -> list[tuple[str, bytes]]:
    """The codec's headers mostly; none (another application) or extra ones sometimes."""
    roll = rng.random()
    if roll < 0.2:
        return []
    headers = CODEC_BY_KIND[kind].headers()
    if roll > 0.9:
        headers.append(("trace-id", rng.randbytes(8)))
    return headers


def _oversized(rng: random.Random, kind: str, sample: bytes) -> bytes:
    limit = CODEC_BY_KIND[kind].max_bytes
    size = limit + rng.randint(1, 4096)
    obj = msgspec.msgpack.decode(sample)
    obj["padding"] = "p" * (size - len(sample))  # an unknown field a decoder would skip
    return msgspec.msgpack.encode(obj)


def can_oversize(kind: str, max_message_bytes: int = BROKER_MAX_BYTES) -> bool:
    """Whether a message over ``kind``'s codec limit still fits through the broker."""
    return CODEC_BY_KIND[kind].max_bytes + 4096 + 64 < max_message_bytes - RECORD_MARGIN_BYTES


def fuzz_messages(
    kind: str,
    n: int,
    seed: int,
    samples: Sequence[bytes] | None = None,
    max_message_bytes: int = BROKER_MAX_BYTES,
) -> list[FuzzMessage]:
    """``n`` random and mutated messages for topic ``kind`` (see the module docstring).

    ``samples`` are valid encoded messages of ``kind`` to mutate (default
    :func:`sample_messages`). Oversized messages are made only when one fits in
    ``max_message_bytes`` (the broker's limit); for the 16 MiB experience groups it does not.
    """
    if kind not in TOPIC_KINDS:
        raise ValueError(f"unknown topic kind {kind!r}; known: {', '.join(TOPIC_KINDS)}")
    rng = random.Random(seed)
    samples = list(samples) if samples is not None else sample_messages(kind)
    if not samples:
        raise ValueError("fuzz_messages needs at least one sample message")
    others = [k for k in TOPIC_KINDS if k != kind]
    weights = dict(MUTATIONS)
    if not can_oversize(kind, max_message_bytes):
        weights.pop("oversized")
    names, odds = list(weights), list(weights.values())
    out = []
    for _ in range(n):
        mutation = rng.choices(names, odds)[0]
        sample = rng.choice(samples)
        headers = _headers_for(rng, kind)
        value: bytes | None
        match mutation:
            case "random_bytes":
                value = rng.randbytes(rng.choice([0, 1, 2, 7, rng.randint(8, 512)]))
            case "truncate":
                value = sample[: rng.randrange(len(sample))]
            case "bit_flip":
                value = _bit_flip(rng, sample)
            case "byte_edit":
                value = _byte_edit(rng, sample)
            case "splice":
                other = rng.choice(samples + sample_messages(rng.choice(others)))
                value = sample[: rng.randrange(len(sample))] + other[rng.randrange(len(other)) :]
            case "field_edit":
                value = _field_edit(rng, sample)
            case "wrong_schema":
                value = msgspec.msgpack.encode(_random_obj(rng))
            case "deep_nesting":
                value = _deep_nesting(rng, sample)
            case "other_topic":
                other_kind = rng.choice(others)
                value = rng.choice(sample_messages(other_kind))
                headers = CODEC_BY_KIND[other_kind].headers()
            case "bad_header":
                value = sample
                headers = rng.choice(
                    [
                        [(HEADER_TYPE, CODEC_BY_KIND[rng.choice(others)].name.encode())],
                        [(HEADER_TYPE, rng.randbytes(6))],
                        [(HEADER_SCHEMA, str(SCHEMA_VERSION + rng.randint(1, 99)).encode())],
                        [(HEADER_SCHEMA, rng.choice([b"", b"one", b"\xff\xfe", b"9" * 5000]))],
                    ]
                )
            case "oversized":
                value = _oversized(rng, kind, sample)
            case "null":
                value = None
            case _:
                value = sample
        key = rng.choice([None, b"fuzz", rng.randbytes(rng.randint(0, 16))])
        if value is None and key is None:
            key = b"tombstone"  # Kafka needs a key or a value
        out.append(FuzzMessage(value=value, headers=headers, key=key, mutation=mutation))
    return out


def expected_valid(kind: str, msg: FuzzMessage, vocab_size: int | None = None) -> bool:
    """Whether a consumer of topic ``kind`` accepts ``msg`` (else it must dead-letter it).

    Asks the codec itself; for experiences, ``vocab_size`` adds the trainer's check of the
    token ids against its model (:func:`~streamrft.schemas.experience.check_token_ids`).
    """
    try:
        obj = CODEC_BY_KIND[kind].decode(msg.value, msg.headers)
        if vocab_size is not None and kind == "experiences":
            check_token_ids(obj, vocab_size)
    except SchemaError:
        return False
    return True


# -- publishing ------------------------------------------------------------------------------


async def inject(cfg: Config, topic: str, messages: Sequence[FuzzMessage]) -> list[tuple[int, int]]:
    """Publish ``messages`` to ``topic`` in order; returns each one's (partition, offset).

    Uses the project's producer of that topic's role (tasks and experiences: the data
    producer; event topics: the event producer), so the messages travel as real ones do.
    """
    kind = TopicNames.kind_of(topic)
    make = kafka.data_producer if kind in ("tasks", "experiences") else kafka.event_producer
    producer = make(cfg.kafka, "streamrft-fuzz")
    await kafka.start_client(producer, "fuzz producer")
    try:
        pending = [
            await producer.send(topic, m.value, key=m.key, headers=list(m.headers))
            for m in messages
        ]
        sent = await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return [(meta.partition, meta.offset) for meta in sent]
