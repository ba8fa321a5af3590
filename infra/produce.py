"""The one produce path for data records: a batch sent acks=all, all of it again after an
outage, until every record is acknowledged (at-least-once; consumers deduplicate).

``producer`` is a data producer of :func:`streamrft.infra.kafka.data_producer`: aiokafka's
or librdkafka's (``kafka.producer``), the same interface and guarantees.

One record per experience group, never several groups in one record: the trainer keys its
work on records (a record that fails to decode or validate is dead-lettered whole, and its
offset is the unit of resume and commit, :mod:`streamrft.consumers.buffer`), and the key
(the task id) places a group on its partition. Kafka already packs many records into one
batch and one produce request, so the per-record framing (tens of bytes against a group's
tens of KiB) is not what costs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from streamrft.infra.retry import retrying
from streamrft.schemas.codec import EXPERIENCE_GROUP, Codec
from streamrft.schemas.experience import ExperienceGroup
from streamrft.schemas.limits import RECORD_MARGIN_BYTES


@dataclass(frozen=True, slots=True)
class OutRecord:
    """One record to send."""

    topic: str
    value: bytes
    key: bytes | None = None
    headers: Sequence[tuple[str, bytes]] = ()
    partition: int | None = None
    """None: the producer's partitioner (by key)."""


async def send_all(
    producer: Any,
    records: Sequence[OutRecord],
    what: str,
    outage_timeout_s: float,
    on_retry: Callable[[BaseException], None] | None = None,
) -> int:
    """Send ``records`` and wait until the broker acknowledged each; a failed attempt (the
    broker away) sends all of them again, with backoff, for up to ``outage_timeout_s``.
    Returns how many were sent."""

    async def attempt() -> int:
        futures = [
            await producer.send(
                r.topic, r.value, key=r.key, headers=list(r.headers), partition=r.partition
            )
            for r in records
        ]
        producer.flush_lingering()  # all queued and waited for next: no batch need linger
        await asyncio.gather(*futures)
        return len(futures)

    return await retrying(what, attempt, outage_timeout_s, on_retry)


def group_records(topic: str, groups: Sequence[ExperienceGroup]) -> list[OutRecord]:
    """Experience groups as records of ``topic`` (msgpack). Key: the task id, so a group
    stays whole on one partition and a task's groups keep their order."""
    headers = EXPERIENCE_GROUP.headers()
    return [
        OutRecord(topic, EXPERIENCE_GROUP.encode(g), g.task_id.encode(), headers) for g in groups
    ]


def largest_value(max_request_bytes: int, codec: Codec) -> int:
    """The largest value the run's own producers send on a topic of ``codec``: what fits a
    produce request of ``max_request_bytes`` and the codec's limit, less the record's
    margin (key, headers, framing: :data:`~streamrft.schemas.limits.RECORD_MARGIN_BYTES`)."""
    return min(max_request_bytes, codec.max_bytes) - RECORD_MARGIN_BYTES


def fitting_records(
    topic: str, groups: Sequence[ExperienceGroup], max_request_bytes: int
) -> tuple[list[OutRecord], dict[str, int]]:
    """:func:`group_records` of the groups whose record fits a produce request of
    ``max_request_bytes`` and the experience codec's limit, and the ids of the others with
    their encoded sizes (each group encoded once)."""
    limit = largest_value(max_request_bytes, EXPERIENCE_GROUP)
    records, too_large = [], {}
    for group, record in zip(groups, group_records(topic, groups), strict=True):
        if len(record.value) > limit:
            too_large[group.id] = len(record.value)
        else:
            records.append(record)
    return records, too_large


async def send_groups(
    producer: Any,
    topic: str,
    groups: Sequence[ExperienceGroup],
    who: str,
    outage_timeout_s: float,
    on_retry: Callable[[BaseException], None] | None = None,
) -> int:
    """:func:`send_all` of ``groups`` as :func:`group_records` of ``topic``; ``who``
    names the sender in the error of an outage that outlasts ``outage_timeout_s``."""
    return await send_all(
        producer,
        group_records(topic, groups),
        f"{who}: publishing {len(groups)} experience groups",
        outage_timeout_s,
        on_retry,
    )
