"""``streamrft tail TOPIC`` or ``streamrft tail --run-id ID KIND``: print a topic's messages,
decoded, one JSON object per line; ``--where field=value`` keeps only the matching ones."""

from __future__ import annotations

import msgspec

from streamrft.infra import kafka
from streamrft.infra.config import KafkaConfig
from streamrft.infra.consume import Record, assign_from_beginning, consume
from streamrft.schemas.codec import CODEC_BY_KIND, readable
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.topics import TopicNames


def view(rec: Record, raw: bool) -> dict:
    """One message as a JSON-able object: where it lies, its key, and its value decoded (or
    why it could not be, or only its size for a topic streamrft does not know)."""
    head = {
        "partition": rec.partition,
        "offset": rec.offset,
        "key": rec.key.decode(errors="replace") if rec.key else None,
    }
    if rec.error is not None:
        body: dict[str, object] = {"undecodable": str(rec.error)}
    elif raw:
        body = {"raw_bytes": len(rec.value or b"")}
    else:
        body = readable(rec.obj)
    return {**head, "value": body}


def parse_where(items: list[str]) -> list[tuple[list[str], str]]:
    """``field=value`` filters: a field is a dotted path in the printed object's ``value``
    (``component``, ``state``, ``values.train/loss``) or ``key`` / ``partition``."""
    out = []
    for item in items:
        name, sep, want = item.partition("=")
        if not sep or not name:
            raise StreamRFTError(f"--where {item!r}: expected FIELD=VALUE, e.g. component=trainer")
        path = name.split(".")
        out.append((path if path[0] in ("key", "partition", "offset") else ["value", *path], want))
    return out


def _equal(have: object, want: str) -> bool:
    if isinstance(have, (int, float)) and not isinstance(have, bool):
        try:
            return float(have) == float(want)
        except ValueError:
            return False
    return str(have).lower() == want.lower() if isinstance(have, bool) else str(have) == want


def matches(obj: dict, where: list[tuple[list[str], str]]) -> bool:
    """Every filter holds (a missing field: no match)."""
    for path, want in where:
        node: object = obj
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        if not _equal(node, want):
            return False
    return True


async def tail(
    kafka_cfg: KafkaConfig,
    topic: str,
    limit: int,
    follow: bool,
    where: list[tuple[list[str], str]] | None = None,
) -> int:
    """Print ``topic`` from its beginning: ``limit`` matching messages (0: all), then,
    with ``follow``, every new one until interrupted. Returns how many were printed."""
    codec = CODEC_BY_KIND.get(TopicNames.kind_of(topic) or "")
    reader = kafka.topic_reader(kafka_cfg, "streamrft-tail")
    await kafka.start_client(reader, "tail")
    printed = 0

    def show(rec: Record) -> bool:
        nonlocal printed
        obj = view(rec, raw=codec is None)
        if where and not matches(obj, where):
            return True
        print(msgspec.json.encode(obj).decode(), flush=True)
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
