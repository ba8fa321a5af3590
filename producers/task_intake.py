"""An explorer's share of the tasks topic: take a step's tasks, commit them once published.

Explorers of one run share the tasks through one consumer group (``<prefix>.<run>.explorers``),
so a partition feeds one explorer at a time and a dead explorer's partitions move to the
others. A task's offset is committed only after its experience group was acknowledged by
the broker (at-least-once): an explorer that dies mid-step loses nothing, its tasks are
explored again, and the trainer deduplicates.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from streamrft.infra import kafka
from streamrft.infra.bus import Counters, EventSender
from streamrft.infra.config import Config
from streamrft.infra.consume import Record, poll
from streamrft.producers.workflows import check_workflow
from streamrft.schemas.codec import TASK
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.experience import Task
from streamrft.schemas.topics import TopicNames

log = logging.getLogger(__name__)

IDLE_RETURN_S = 1.0
"""A take that has some tasks returns them after the topic stayed idle this long."""


def tasks_group(topics: TopicNames) -> str:
    """The consumer group the explorers of one run share (``<prefix>.<run id>.explorers``).

    One group per run: runs sharing a cluster never rebalance each other's explorers.
    """
    return f"{topics.prefix}.{topics.run}.explorers"


@dataclass
class Taken:
    """What one take got: the tasks to explore, and every offset read (bad records too:
    they are committed past, their dead letters keep them)."""

    tasks: list[Task] = field(default_factory=list)
    read: list[tuple[TopicPartition, int]] = field(default_factory=list)

    def next_offsets(self) -> dict[TopicPartition, int]:
        offsets: dict[TopicPartition, int] = {}
        for tp, offset in self.read:
            offsets[tp] = max(offsets.get(tp, -1), offset + 1)
        return offsets


class TaskIntake:
    """Takes tasks for one explorer; dead-letters tasks that do not decode or name an
    unknown workflow; reports the partitions it holds after every rebalance."""

    def __init__(self, cfg: Config, name: str, events: EventSender, counters: Counters) -> None:
        self.name = name
        self.events = events
        self.counters = counters
        self.cfg = cfg
        self.consumer: kafka.TaskConsumer | None = None  # made in start(), inside the loop
        self.partitions: tuple[int, ...] = ()
        """Tasks partitions this explorer holds (from the newest rebalance)."""
        self._to_report = False

    async def start(self) -> None:
        topics = self.cfg.topics()
        self.consumer = kafka.task_consumer(
            self.cfg.kafka, topics.tasks, tasks_group(topics), self.name, self._on_assign
        )
        await self.consumer.start()

    async def stop(self) -> None:
        """Leave the group; safe to call twice, and before start."""
        if self.consumer is not None:
            await self.consumer.stop()

    def _on_assign(self, partitions: tuple[int, ...]) -> None:
        """A rebalance gave this explorer ``partitions``: counted now, reported on status at
        the next take (counters ``tasks_partitions`` and ``rebalances``)."""
        self.partitions = partitions
        self.counters.set("tasks_partitions", len(partitions))
        self.counters.add("rebalances")
        self._to_report = True

    async def _report_assignment(self) -> None:
        if not self._to_report:
            return
        self._to_report = False
        if self.partitions:
            detail = "tasks partitions " + ",".join(map(str, self.partitions))
        else:
            detail = "no tasks partition: idle (more explorers than tasks partitions)"
        await self.events.status(detail=detail)

    async def take(
        self, n: int, give_up: Callable[[], bool], empty_ok: Callable[[], bool]
    ) -> Taken:
        """Up to ``n`` tasks. Returns early with fewer when the topic stays idle for
        :data:`IDLE_RETURN_S`, with none when ``empty_ok()`` (something else wants this
        explorer, e.g. a broadcast group), and at once when ``give_up()`` (stop)."""
        taken = Taken()
        idle_since = time.monotonic()
        while len(taken.read) < n and not give_up():
            await self._report_assignment()
            records = await poll(self.consumer, TASK, 200, max_records=n - len(taken.read))
            for rec in records:
                await self._take(rec, taken)
            if records:
                idle_since = time.monotonic()
            elif (taken.read and time.monotonic() - idle_since > IDLE_RETURN_S) or (
                not taken.read and empty_ok()
            ):
                break
        return taken

    async def _take(self, rec: Record, taken: Taken) -> None:
        error = rec.error
        if error is None:
            try:
                check_workflow(rec.obj.workflow)
            except StreamRFTError as exc:
                error = exc
        taken.read.append((TopicPartition(rec.topic, rec.partition), rec.offset))
        if error is None:
            taken.tasks.append(rec.obj)
        else:
            await self.events.dead_letter(dataclasses.replace(rec, obj=None, error=error))

    async def commit(self, taken: Taken) -> None:
        """Commit past every record taken. After a rebalance moved a partition the commit
        fails: another explorer redoes those tasks, the trainer deduplicates, nothing is lost."""
        offsets = taken.next_offsets()
        if not offsets:
            return
        log.debug("%s: committing %s", self.name, {tp.partition: o for tp, o in offsets.items()})
        try:
            await self.consumer.commit({tp: OffsetAndMetadata(o, "") for tp, o in offsets.items()})
        except (CommitFailedError, KafkaError) as exc:
            self.counters.add("commit_failures")
            log.warning(
                "%s: commit failed after rebalance (%s); tasks may be explored twice",
                self.name,
                exc,
            )
