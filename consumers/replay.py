"""Replay: train from a recorded experience stream, with no explorers.

``streamrft train CONFIG --run-id ID --from-beginning | --from-offsets FILE | --from-run
OTHER`` (``app/replay_source.py`` turns the flags into :class:`ReplayBounds`). This module
holds what the trainer's intake needs for it: the bounds of a replay (one experiences
topic, and per partition the first offset read and the end), reading them from the broker
when the command starts, and the :class:`ReplayCursor` the intake reads with.

- **Where it reads.** With a reader of no consumer group: every partition assigned and
  sought here, no offset ever committed. So a replay moves no group's committed offsets
  (the run's own ``<prefix>.<run>.trainer`` group stays as the run left it, and a live
  trainer resumed later is not affected), and the same command reads exactly the same
  records every time. A fresh consumer group would leave offsets behind in the broker for
  nothing; the run's group reset would lose the run's own offsets.
- **Where it stops.** The end of every partition is read once, when the command starts
  (:func:`read_bounds`): the replay reads up to there and never past it (records published
  since are not part of it; their partition is paused once it reaches its end). Once
  every partition is read to its end, the trainer trains what is buffered in full batches
  (``trainer.batch_size``; the batch order then waits for nothing more: the batches are
  forced, as after ``trainer.batch_wait_s``) and finishes, saying how much it consumed and
  trained. Fewer groups than a batch left at the end are consumed and not trained.
  ``trainer.max_steps`` may stop it sooner. Nothing waits for an explorer.
- **The end is a fetch's high-water mark**, not the broker's "latest" offset, which the
  embedded Tansu broker gets wrong after a multi-record batch (it answers one past the
  first record of the last batch): each partition is fetched from one before "latest",
  and the end is the larger of "latest" and the high-water mark of that fetch (on Apache
  Kafka the two agree).
- **Offsets file** (``--from-offsets``): a JSON object from partition number to the first
  offset read, ``{"0": 120, "1": 0, "2": 37, "3": 0}``; every partition of the topic must
  be given (0 reads a partition from its first record; its end offset reads nothing of
  it). :func:`parse_offsets` checks the form, :func:`check_start` the numbers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from streamrft.infra import kafka
from streamrft.infra.config import KafkaConfig
from streamrft.infra.consume import Record
from streamrft.schemas.errors import ConfigError, ServiceError

END_READ_S = 30.0
"""Longest wait for the fetches that find each partition's end (:func:`read_ends`)."""


@dataclass(frozen=True)
class ReplayBounds:
    """What a replay reads: ``topic``, each partition from ``start`` up to ``end``."""

    topic: str
    start: dict[int, int]
    """Partition -> first offset read."""
    end: dict[int, int]
    """Partition -> end offset when the replay started (the first offset not read)."""

    @property
    def records(self) -> int:
        """Records between the bounds (good, bad and duplicates alike)."""
        return sum(max(0, self.end[p] - self.start[p]) for p in self.end)

    def describe(self) -> str:
        spans = ", ".join(f"{p}: {self.start[p]}-{self.end[p]}" for p in sorted(self.end))
        return f"{self.topic} offsets {{{spans}}} ({self.records} records)"


# -- the offsets file ---------------------------------------------------------------------
def parse_offsets(text: str, source: str = "--from-offsets") -> dict[int, int]:
    """``{"<partition>": offset, ...}`` as ``{partition: offset}``; :class:`ConfigError`
    naming ``source`` when the text is not such an object of non-negative integers."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not data:
        raise ConfigError(
            f'{source}: expected a JSON object of partition to offset, e.g. {{"0": 120, "1": 0}}'
        )
    offsets = {}
    for key, value in data.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ConfigError(f"{source}: partition {key!r} is not a partition number")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: partition {key}: offset {value!r} is not an integer")
        if value < 0:
            raise ConfigError(f"{source}: partition {key}: offset {value} is negative")
        offsets[int(key)] = value
    return offsets


def read_offsets_file(path: str | Path) -> dict[int, int]:
    """The offsets file of ``--from-offsets`` (:func:`parse_offsets`)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--from-offsets {path}: cannot read: {exc}") from exc
    return parse_offsets(text, f"--from-offsets {path}")


def check_start(
    topic: str, offsets: Mapping[int, int], first: Mapping[int, int], end: Mapping[int, int]
) -> None:
    """Offsets given for ``topic`` against its partitions: every partition given, none
    unknown, each offset between the partition's ``first`` (earliest kept) and ``end``."""
    unknown = sorted(set(offsets) - set(end))
    missing = sorted(set(end) - set(offsets))
    where = f"--from-offsets: {topic} has partitions 0-{len(end) - 1}"
    if unknown:
        raise ConfigError(f"{where}; no partition {', '.join(map(str, unknown))}")
    if missing:
        raise ConfigError(
            f"{where}; give every one (0: from its beginning): missing "
            f"{', '.join(map(str, missing))}"
        )
    for p, offset in sorted(offsets.items()):
        if not first[p] <= offset <= end[p]:
            raise ConfigError(
                f"--from-offsets: partition {p}: offset {offset} is outside the records "
                f"{topic} holds there ({first[p]} to its end {end[p]})"
            )


# -- reading the bounds --------------------------------------------------------------------
async def read_bounds(
    cfg: KafkaConfig, topic: str, offsets: Mapping[int, int] | None
) -> ReplayBounds:
    """The bounds of a replay of ``topic``, from ``offsets`` (None: every partition's
    beginning) to the ends now. Raises :class:`ServiceError` when the topic does not
    exist and :class:`ConfigError` for offsets :func:`check_start` refuses."""
    reader = kafka.replay_consumer(cfg, "streamrft-replay-bounds")
    await kafka.start_client(reader, "replay bounds reader")
    try:
        tps = await _partitions(reader, topic)
        first = {tp.partition: o for tp, o in (await reader.beginning_offsets(tps)).items()}
        end = await read_ends(reader, tps)
    finally:
        await reader.stop()
    if offsets is not None:
        check_start(topic, offsets, first, end)
    return ReplayBounds(topic, dict(offsets) if offsets is not None else first, end)


async def _partitions(reader: Any, topic: str) -> list[TopicPartition]:
    parts = reader.partitions_for_topic(topic) or set()
    if not parts:  # a new reader knows no topic before its first metadata request
        await reader._client.force_metadata_update()
        parts = reader.partitions_for_topic(topic) or set()
    if not parts:
        raise ServiceError(f"topic {topic!r} does not exist on the broker")
    return [TopicPartition(topic, p) for p in sorted(parts)]


async def read_ends(reader: Any, tps: list[TopicPartition]) -> dict[int, int]:
    """Each partition's end offset: the larger of the broker's "latest" and the
    high-water mark of a fetch from one before it (see the module docstring)."""
    latest = {tp: o for tp, o in (await reader.end_offsets(tps)).items()}
    todo = [tp for tp in tps if latest[tp] > 0]
    reader.assign(todo)
    for tp in todo:
        reader.seek(tp, latest[tp] - 1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + END_READ_S
    while any(reader.highwater(tp) is None for tp in todo):
        if loop.time() > deadline:
            raise ServiceError(f"replay: no fetch answer for the ends of {todo} in {END_READ_S}s")
        await reader.getmany(timeout_ms=200)
    seen = {tp: reader.highwater(tp) or 0 for tp in todo}
    return {tp.partition: max(latest[tp], seen.get(tp, 0)) for tp in tps}


# -- the cursor the intake reads with ------------------------------------------------------
@dataclass
class ReplayCursor:
    """A replay's reader and where it stands: opened by the trainer's intake in place of
    its group membership, asked after every poll which records belong to the replay."""

    bounds: ReplayBounds
    position: dict[int, int] = field(default_factory=dict)
    """Partition -> next offset to read."""

    def first_offsets(self, resume: Mapping[tuple[str, int], int]) -> dict[int, int]:
        """Where each partition starts: a checkpoint's offsets (``resume``: a replay into
        this run id was interrupted and goes on), else the bounds' start. A checkpoint
        that read another topic is refused: it is not a replay of this stream."""
        other = sorted({t for t, _ in resume if t != self.bounds.topic})
        if other:
            raise ConfigError(
                f"trainer.resume: this run's checkpoint was trained from {', '.join(other)}, "
                f"not {self.bounds.topic}: replay into a fresh --run-id"
            )
        own = {p: o for (_, p), o in resume.items()}
        return {p: own.get(p, start) for p, start in self.bounds.start.items()}

    async def open(self, cfg: KafkaConfig, resume: Mapping[tuple[str, int], int]) -> Any:
        """The replay's reader, every partition assigned at its first offset; those with
        nothing to read are paused at once."""
        self.position = self.first_offsets(resume)
        reader = kafka.replay_consumer(cfg, "trainer-replay")
        await kafka.start_client(reader, "trainer replay reader")
        tps = [TopicPartition(self.bounds.topic, p) for p in sorted(self.position)]
        reader.assign(tps)
        for tp in tps:
            reader.seek(tp, self.position[tp.partition])
        self._pause_done(reader)
        return reader

    async def bound(self, reader: Any, records: list[Record]) -> list[Record]:
        """``records`` (one poll) without those past the end; pauses the partitions read
        to their end."""
        kept = [r for r in records if r.offset < self.bounds.end[r.partition]]
        for p in {r.partition for r in records}:
            self.position[p] = await reader.position(TopicPartition(self.bounds.topic, p))
        self._pause_done(reader)
        return kept

    @property
    def done(self) -> bool:
        """Every partition read to its end."""
        return all(self.position[p] >= end for p, end in self.bounds.end.items())

    def _pause_done(self, reader: Any) -> None:
        reader.pause(
            *(
                TopicPartition(self.bounds.topic, p)
                for p, end in self.bounds.end.items()
                if self.position[p] >= end
            )
        )

    def summary(
        self, steps: int, counters: Mapping[str, float], drops: Mapping[str, int], left: int
    ) -> str:
        """The line a finished replay logs: what it read, consumed and trained."""
        c = {k: int(v) for k, v in counters.items()}
        return (
            f"trainer: replay done: read {self.bounds.describe()}; consumed "
            f"{c.get('groups_consumed', 0)} groups ({c.get('experiences_consumed', 0)} "
            f"experiences); trained {steps} steps, {c.get('groups_trained', 0)} groups "
            f"({c.get('experiences_trained', 0)} experiences); dropped "
            + ", ".join(f"{n} {why}" for why, n in drops.items())
            + f"; {left} left untrained (fewer than trainer.batch_size)"
        )
