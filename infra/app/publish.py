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
from streamrft.infra.app.endpoints import resolve
from streamrft.infra.config import Config, load_config, with_endpoints, with_run_id
from streamrft.infra.produce import OutRecord, send_all
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


def target_config(config: str | None, run_id: str, bootstrap: str | None) -> Config:
    """The run's config with its broker: ``--bootstrap`` when given, else the config's, else
    found as ``streamrft explore --run-id`` finds it (the run's own services or resolved
    config, then ``streamrft infra up``'s; :mod:`~streamrft.infra.app.endpoints`)."""
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


def record_of(kind: str, line: bytes, topics: TopicNames) -> OutRecord:
    """The record one line becomes; :class:`SchemaError` says why it cannot be published."""
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
    return OutRecord(topics.of(kind), codec.encode(obj), key.encode(), codec.headers())


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of every line of ``path`` (1-based), as bytes."""
    with path.open("rb") as f:
        yield from enumerate(f, start=1)


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
            size = 0
            for number, line in numbered_lines(path):
                self.bar.update(len(line))
                if not line.strip():
                    continue
                try:
                    chunk.append(record_of(self.kind, line, self.topics))
                except SchemaError as exc:
                    self.reject(path, number, str(exc))
                    continue
                size += len(chunk[-1].value)
                if len(chunk) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
                    await self.send(chunk)
                    chunk, size = [], 0
            await self.send(chunk)
        finally:
            await self.producer.stop()
        return self.outcome

    def reject(self, path: Path, number: int, reason: str) -> None:
        self.outcome.rejected.append((number, reason))
        self.bar.write(f"{path}:{number}: {reason}", file=sys.stderr)

    async def send(self, chunk: list[OutRecord]) -> None:
        if chunk:
            what = f"publish: {len(chunk)} records to {chunk[0].topic}"
            timeout_s = self.cfg.run.outage_timeout_s
            self.outcome.published += await send_all(self.producer, chunk, what, timeout_s)


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
    with bar:
        outcome = asyncio.run(Publisher(cfg, kind, bar).run(path))
    print(
        f"published {outcome.published}, rejected {len(outcome.rejected)} "
        f"({cfg.topics().of(kind)} on {cfg.kafka.bootstrap_servers})"
    )
    return 1 if outcome.rejected else 0
