"""``streamrft publish``: tasks or experience groups from a JSONL file onto a run's topic.

Each line is one JSON object in the JSON form of its topic (``schemas/json/``, written by
``tools/schemagen.py``), decoded and validated exactly as a consumer decodes a JSON record
(the topic's codec with the JSON headers); an experience group must also belong to the run.
A bad line is reported on stderr with its number and the reason, and left out; the good
ones are published as msgpack with the codec's headers, keyed by the task id, acks=all
(:func:`~streamrft.infra.produce.send_all`). A line is one record, so no line is ever
half-published. Blank lines are skipped.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrft.infra import admin, kafka
from streamrft.infra.config import Config, load_config, with_endpoints, with_run_id
from streamrft.infra.endpoints import resolve
from streamrft.infra.produce import OutRecord, largest_value, send_all
from streamrft.schemas.codec import CODEC_BY_KIND
from streamrft.schemas.errors import SchemaError, StreamRFTError
from streamrft.schemas.topics import TopicNames

KINDS = ("tasks", "experiences")
"""The topics an app publishes to (the two with a JSON form)."""
CHUNK_RECORDS = 500
"""Records sent and acknowledged together (all again after a broker outage)."""
CHUNK_BYTES = 8 << 20
"""... or fewer, once their values reach this many bytes."""


@dataclass
class Outcome:
    """What a publish did: records acknowledged, and the lines left out with the reason."""

    published: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)
    through_line: int = 0
    """Every good line up to this one is acknowledged by the broker."""


def target_config(config: str | None, run_id: str, bootstrap: str | None) -> Config:
    """The run's config with its broker: ``--bootstrap`` when given, else the config's, else
    found as ``streamrft explore --run-id`` finds it (the run's own services or resolved
    config, then ``streamrft infra up``'s; :mod:`~streamrft.infra.endpoints`)."""
    cfg = with_run_id(load_config(config) if config else Config(), run_id)
    if bootstrap:  # nothing to look up: publishing needs only the broker
        return with_endpoints(cfg, bootstrap, None)
    cfg, _found = resolve(cfg, joining=True)
    if not cfg.kafka.bootstrap_servers:
        raise StreamRFTError(
            f"no broker for run {run_id!r}: pass --bootstrap HOST:PORT or a --config naming "
            "one (kafka.bootstrap_servers), or run it under `streamrft run` / `streamrft infra up`"
        )
    return cfg


def largest_line(kind: str) -> int:
    """The longest line a ``kind`` file may hold: its codec's limit on a JSON record."""
    return CODEC_BY_KIND[kind].max_bytes


def record_of(kind: str, line: bytes, topics: TopicNames, max_request_bytes: int) -> OutRecord:
    """The record one line becomes; :class:`SchemaError` says why it cannot be published
    (it does not decode or validate, or its record would not fit a produce request of
    ``max_request_bytes``, the broker's limit: the run's ``kafka.max_request_bytes``)."""
    codec = CODEC_BY_KIND[kind]
    obj = codec.decode(line, codec.json_headers())
    if kind == "experiences":
        if obj.run != topics.run:
            raise SchemaError(
                f"group {obj.id!r}: run {obj.run[:200]!r} is not the run published to "
                f"({topics.run!r})"
            )
        key = obj.task_id
    else:
        key = obj.id
    value = codec.encode(obj)
    room = largest_value(max_request_bytes, codec)
    if len(value) > room:
        raise SchemaError(
            f"its record is {len(value)} bytes, over the {room} a produce request of "
            f"kafka.max_request_bytes ({max_request_bytes}) holds"
        )
    return OutRecord(topics.of(kind), value, key.encode(), codec.headers())


@dataclass(frozen=True)
class LongLine:
    """A line over the length limit, skipped without being held: its size in bytes."""

    size: int


def numbered_lines(path: Path, limit: int) -> Iterator[tuple[int, bytes | LongLine]]:
    """``(line number, line)`` of every line of ``path`` (1-based), as bytes; a line longer
    than ``limit`` bytes is read through in pieces of ``limit`` and given as a
    :class:`LongLine` (a 10 GB line costs no more memory than ``limit``)."""
    with path.open("rb") as f:
        number = 0
        while piece := f.readline(limit + 1):
            number += 1
            if len(piece) <= limit or piece.endswith(b"\n"):
                yield number, piece
                continue
            size = len(piece)
            while (piece := f.readline(limit)) and not piece.endswith(b"\n"):
                size += len(piece)
            yield number, LongLine(size + len(piece))


class Publisher:
    """Sends a file's good lines in chunks through one data producer."""

    def __init__(self, cfg: Config, kind: str, bar: Any) -> None:
        self.cfg = cfg
        self.kind = kind
        self.topics = cfg.topics()
        self.bar = bar
        self.producer: Any = None
        self.outcome = Outcome()

    async def run(self, path: Path) -> Outcome:
        topic = self.topics.of(self.kind)
        if topic not in await admin.list_topics(self.cfg.kafka):
            raise StreamRFTError(
                f"topic {topic!r} does not exist on {self.cfg.kafka.bootstrap_servers}: is "
                f"run {self.topics.run!r} started there (`streamrft run` creates its topics)?"
            )
        self.producer = kafka.data_producer(self.cfg.kafka, "streamrft-publish")
        await kafka.start_client(self.producer, "publish producer")
        try:
            chunk: list[OutRecord] = []
            size, number = 0, 0  # number: the last line read (none in an empty file)
            limit = largest_line(self.kind)
            for number, line in numbered_lines(path, limit):
                if isinstance(line, LongLine):
                    self.bar.update(line.size)
                    self.reject(path, number, f"line of {line.size} bytes, over {limit}")
                    continue
                self.bar.update(len(line))
                if not line.strip():
                    continue
                try:
                    chunk.append(
                        record_of(self.kind, line, self.topics, self.cfg.kafka.max_request_bytes)
                    )
                except SchemaError as exc:
                    self.reject(path, number, str(exc))
                    continue
                size += len(chunk[-1].value)
                if len(chunk) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
                    await self.send(chunk, number)
                    chunk, size = [], 0
            await self.send(chunk, number)
        finally:
            await self.producer.stop()
        return self.outcome

    def reject(self, path: Path, number: int, reason: str) -> None:
        self.outcome.rejected.append((number, reason))
        self.bar.write(f"{path}:{number}: {reason}", file=sys.stderr)

    async def send(self, chunk: list[OutRecord], through_line: int) -> None:
        if chunk:
            what = f"publish: {len(chunk)} records to {chunk[0].topic}"
            timeout_s = self.cfg.run.outage_timeout_s
            self.outcome.published += await send_all(self.producer, chunk, what, timeout_s)
        self.outcome.through_line = through_line


def publish(
    kind: str, path: Path, run_id: str, config: str | None = None, bootstrap: str | None = None
) -> int:
    """Publish the good lines of ``path`` to run ``run_id``'s ``kind`` topic; print a summary.
    Returns the exit code: 0 when every line was good, 1 when some were left out."""
    from tqdm import tqdm

    if kind not in KINDS:
        raise StreamRFTError(f"publish: {kind!r} is not one of {', '.join(KINDS)}")
    if not path.is_file():
        raise StreamRFTError(f"{path}: no such file")
    cfg = target_config(config, run_id, bootstrap)
    bar = tqdm(
        total=path.stat().st_size,
        unit="B",
        unit_scale=True,
        desc=f"publish {kind}",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )
    publisher = Publisher(cfg, kind, bar)
    try:
        with bar:
            outcome = asyncio.run(publisher.run(path))
    except StreamRFTError as exc:
        done = publisher.outcome
        raise StreamRFTError(
            f"{exc}; published {done.published} records before (every good line through line "
            f"{done.through_line}); the lines after it may be published in part: publishing "
            "the file again is safe for experiences (the trainer drops a group id it has seen "
            "within trainer.dedup_window)"
        ) from exc
    print(
        f"published {outcome.published}, rejected {len(outcome.rejected)} "
        f"({cfg.topics().of(kind)} on {cfg.kafka.bootstrap_servers})"
    )
    return 1 if outcome.rejected else 0
