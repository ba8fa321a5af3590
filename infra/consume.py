"""The one consume path: read a topic, decode, hand the good on, the bad aside, stop when told.

Every reader of a streamrft topic goes through :func:`poll` (one fetch, every record decoded
or carrying its :class:`SchemaError`) and most through :func:`consume` (poll in a loop until
the handler, a stop event or a quiet stream ends it). What happens to a record that does not
decode is the caller's choice, passed in as ``on_bad``: the live consumers dead-letter it,
tools print it, audits count it. Errors other than a bad record (the broker, a failed
dead-letter send) are never swallowed here: they propagate to the caller.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from streamrft.infra import kafka
from streamrft.infra.config import KafkaConfig
from streamrft.schemas.codec import Codec
from streamrft.schemas.errors import SchemaError, ServiceError, StreamRFTError

Codecs = Codec | Mapping[str, Codec | None] | None
"""How to decode: one codec for every topic read, one per topic, or None (raw records)."""


@dataclass(frozen=True, slots=True)
class Record:
    """One Kafka record as read, with what decoding made of it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]
    obj: Any = None
    """The decoded message (None when ``error`` is set, or when read raw)."""
    error: StreamRFTError | None = None
    """Why the record could not be decoded (a :class:`SchemaError`) or used; such a record
    is "bad"."""


Handler = Callable[[Record], "bool | Awaitable[bool | None] | None"]
"""Called with each good record; return False to stop consuming."""
OnBad = Callable[[Record], "bool | Awaitable[bool | None] | None"]
"""Called with each bad record (dead-letter it, count it, print it); False stops too."""


def _codec_for(codecs: Codecs, topic: str) -> Codec | None:
    if codecs is None or isinstance(codecs, Codec):
        return codecs
    return codecs.get(topic)


def decode(codecs: Codecs, topic: str, partition: int, rec: Any) -> Record:
    """A fetched aiokafka record as a :class:`Record`, decoded by its topic's codec."""
    codec = _codec_for(codecs, topic)
    obj, error = None, None
    if codec is not None:
        try:
            obj = codec.decode(rec.value, rec.headers)
        except SchemaError as exc:
            error = exc
    return Record(topic, partition, rec.offset, rec.key, rec.value, rec.headers, obj, error)


async def poll(
    reader: Any, codecs: Codecs, timeout_ms: int = 200, max_records: int | None = None
) -> list[Record]:
    """One fetch from ``reader`` (any client with aiokafka's ``getmany``), decoded, in order."""
    batches = await reader.getmany(timeout_ms=timeout_ms, max_records=max_records)
    return [
        decode(codecs, tp.topic, tp.partition, rec)
        for tp, records in batches.items()
        for rec in records
    ]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def consume(
    reader: Any,
    codecs: Codecs,
    handle: Handler,
    *,
    on_bad: OnBad | None = None,
    stop: Any = None,
    until_quiet: int | None = None,
    poll_ms: int = 200,
    after_poll: Callable[[list[Record]], Any] | None = None,
) -> int:
    """Read and decode until told to stop; returns how many good records were handled.

    - ``handle(record)`` gets every good record in order; returning False stops at once.
      The rest of that poll is not handled, yet the reader's position is past it: stop
      this way only a reader whose position nobody commits (tools, audits), or re-seek.
    - ``on_bad(record)`` gets every record that did not decode (default: skipped);
      returning False stops the same way.
    - ``stop`` (an ``asyncio.Event``): consuming ends once it is set; with ``until_quiet`` too,
      only once the stream has also been quiet that many polls (a drain).
    - ``until_quiet`` alone: ends after that many polls in a row came back empty (the embedded
      broker's "latest" offset cannot be trusted to say where a topic ends).
    - ``after_poll(records)`` runs after each poll's records were handled.
    Neither: consume until the task is cancelled.
    """
    handled, quiet = 0, 0
    while True:
        records = await poll(reader, codecs, poll_ms)
        quiet = 0 if records else quiet + 1
        for rec in records:
            if rec.error is None:
                handled += 1
                if await _maybe_await(handle(rec)) is False:
                    return handled
            elif on_bad is not None and await _maybe_await(on_bad(rec)) is False:
                return handled
        if after_poll is not None:
            await _maybe_await(after_poll(records))
        stopping = stop is None or stop.is_set()
        if until_quiet is not None and stopping and quiet >= until_quiet:
            return handled
        if until_quiet is None and stop is not None and stop.is_set():
            return handled


async def assign_from_beginning(reader: AIOKafkaConsumer, topic: str) -> None:
    """Give a group-less reader every partition of ``topic``, at its first offset.

    Raises :class:`ServiceError` when the topic does not exist.
    """
    parts = reader.partitions_for_topic(topic) or set()
    if not parts:  # a new reader knows no topic before its first metadata request
        await reader._client.force_metadata_update()
        parts = reader.partitions_for_topic(topic) or set()
    if not parts:
        raise ServiceError(f"topic {topic!r} does not exist")
    reader.assign([TopicPartition(topic, p) for p in sorted(parts)])
    await reader.seek_to_beginning()


async def read_topic(
    cfg: KafkaConfig,
    topic: str,
    codecs: Codecs,
    client_id: str,
    until_quiet: int = 4,
    poll_ms: int = 300,
) -> list[Record]:
    """Every record of ``topic`` (all partitions) from the beginning, good and bad, until the
    topic has been quiet ``until_quiet`` polls: for histories, audits and tests."""
    reader = kafka.topic_reader(cfg, client_id)
    await kafka.start_client(reader, f"{client_id} reader")
    out: list[Record] = []
    try:
        await assign_from_beginning(reader, topic)
        await consume(
            reader, codecs, out.append, on_bad=out.append, until_quiet=until_quiet, poll_ms=poll_ms
        )
    finally:
        await reader.stop()
    return out


async def read_to_end(
    cfg: KafkaConfig,
    topic: str,
    codecs: Codecs,
    client_id: str,
    timeout_s: float,
    poll_ms: int = 200,
) -> list[Record]:
    """Every record of ``topic`` (all partitions) from the beginning up to its end as it
    was when the read began (each partition's end offset then), good and bad, however long
    a slow broker keeps the stream quiet meanwhile; a :class:`ServiceError` when that takes
    more than ``timeout_s``. Only for topics whose every record was sent as a batch of its
    own (the control topic): the embedded broker's end offset is too low after a
    multi-record batch, and records past it would be missed."""
    reader = kafka.topic_reader(cfg, client_id)
    await kafka.start_client(reader, f"{client_id} reader")
    out: list[Record] = []
    try:
        deadline = time.monotonic() + timeout_s
        await assign_from_beginning(reader, topic)
        ends = await reader.end_offsets(list(reader.assignment()))
        left = {tp: end for tp, end in ends.items() if end > 0}
        while left:
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"{topic}: not read to its end within {timeout_s:.0f}s (the broker is "
                    f"slow or unreachable); {len(out)} record(s) read"
                )
            out += [
                r
                for r in await poll(reader, codecs, poll_ms)
                if r.offset < ends[TopicPartition(r.topic, r.partition)]
            ]
            for tp in list(left):
                if await reader.position(tp) >= left[tp]:
                    del left[tp]
    finally:
        await reader.stop()
    return out


async def ever_held_records(cfg: KafkaConfig, topic: str, client_id: str) -> bool:
    """Whether ``topic`` ever held a record: an end offset above 0 (retention deletes
    records but never lowers an end offset; the embedded broker's end offset is too low
    after a multi-record batch, never 0). False for a topic created anew: a new broker, or
    an embedded one on ``memory`` storage."""
    reader = kafka.topic_reader(cfg, client_id)
    await kafka.start_client(reader, f"{client_id} reader")
    try:
        await assign_from_beginning(reader, topic)
        ends = await reader.end_offsets(list(reader.assignment()))
    finally:
        await reader.stop()
    return any(end > 0 for end in ends.values())


async def read_history(
    cfg: KafkaConfig, topic: str, codec: Codec, client_id: str, until_quiet: int = 3
) -> list[Any]:
    """Every decodable message of an event topic, from the beginning, in order.

    Undecodable messages are skipped here: whoever consumes the topic live dead-letters them.
    """
    records = await read_topic(cfg, topic, codec, client_id, until_quiet, poll_ms=200)
    return [r.obj for r in records if r.error is None]
