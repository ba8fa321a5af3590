"""``streamrft tail TOPIC``: print a topic's messages, decoded, one JSON object per line."""

from __future__ import annotations

import msgspec

from streamrft.infra import kafka
from streamrft.infra.config import KafkaConfig
from streamrft.infra.consume import Record, assign_from_beginning, consume
from streamrft.schemas.codec import CODEC_BY_KIND, readable
from streamrft.schemas.topics import TopicNames


def line(rec: Record, raw: bool) -> str:
    """One message as a JSON line: where it lies, its key, and its value decoded (or why
    it could not be, or only its size for a topic streamrft does not know)."""
    head = {
        "partition": rec.partition,
        "offset": rec.offset,
        "key": rec.key.decode(errors="replace") if rec.key else None,
    }
    if rec.error is not None:
        body = {"undecodable": str(rec.error)}
    elif raw:
        body = {"raw_bytes": len(rec.value or b"")}
    else:
        body = readable(rec.obj)
    return msgspec.json.encode({**head, "value": body}).decode()


async def tail(kafka_cfg: KafkaConfig, topic: str, limit: int, follow: bool) -> int:
    """Print ``topic`` from its beginning: ``limit`` messages (0: all), then, with
    ``follow``, every new one until interrupted. Returns how many were printed."""
    codec = CODEC_BY_KIND.get(TopicNames.kind_of(topic) or "")
    reader = kafka.topic_reader(kafka_cfg, "streamrft-tail")
    await kafka.start_client(reader, "tail")
    printed = 0

    def show(rec: Record) -> bool:
        nonlocal printed
        print(line(rec, raw=codec is None), flush=True)
        printed += 1
        return not (limit and printed >= limit)

    try:
        await assign_from_beginning(reader, topic)
        await consume(
            reader,
            codec,
            show,
            on_bad=show,
            until_quiet=None if follow else 4,
            poll_ms=500,
        )
    finally:
        await reader.stop()
    return printed
