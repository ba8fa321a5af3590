"""An explorer's share of the tasks topic: take one batch's tasks, commit them once published.

Explorers of one run share the tasks through one consumer group (``<prefix>.<run>.explorers``),
so a partition feeds one explorer at a time and a dead explorer's partitions move to the
others. A task's offset is committed only after its experience group was acknowledged by
the broker (at-least-once): an explorer that dies mid-step loses nothing, its tasks are
explored again, and the trainer deduplicates.

**One batch per take.** Every task carries its global batch index (:attr:`Task.batch`,
stamped by the feeder), and the tasks of a batch are spread over every partition. A take
hands out the tasks of the *lowest* batch this explorer has read, once its share of that
batch is complete: every partition it holds has shown a task of a later batch (or the
topic went quiet, or the step is full). What was read past the batch waits in a backlog
for the next take, and the partitions already past it are not fetched meanwhile. So N
explorers produce each batch once between them, each its share, in batch order.

**Membership between takes.** A group member that does not poll for
``kafka.max_poll_interval_ms`` is put out of the group (its partitions move, the tasks it
holds uncommitted are sampled again). An explorer reads nothing while it waits at its
sync point for a version, nor while its takes are served from the backlog, however long
that lasts. So outside a step's rollouts the intake polls with every partition paused
once a quarter of that interval went by (:meth:`TaskIntake.keep_membership`): nothing is
read or skipped, and the explorer keeps its partitions. During the rollouts
(:meth:`TaskIntake.rolling_out`) it does not: a step whose rollouts run longer than the
interval counts as stuck, as Kafka means it, and its partitions go to another explorer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
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

log = logging.getLogger(__name__)

IDLE_RETURN_S = 1.0
"""A take that has some tasks returns them after the topic stayed idle this long, once no
partition it holds may still have unread records (a fresh assignment is still fetching)."""
UNREAD_GRACE_S = 10.0
"""... or after this long idle, whatever the partitions say."""


KEEPALIVE_FRACTION = 4
"""Outside rollouts, poll with every partition paused once this fraction of
``kafka.max_poll_interval_ms`` went by without a poll."""
KEEPALIVE_RETRY_S = 5.0
"""After a keep-alive poll failed or met a rebalance, try again this much later (or
sooner: at most the fraction above)."""


UNSTAMPED = -1
"""Batch index of a task the feeder did not stamp (an application's own): handed out
first, in the order read, a step's worth at a time."""


@dataclass
class Pending:
    """A task read and not yet handed out."""

    tp: TopicPartition
    offset: int
    task: Task


@dataclass
class Taken:
    """What one take handed out: tasks of one batch (:data:`UNSTAMPED` for tasks without
    one), in the order read."""

    batch: int = UNSTAMPED
    items: list[Pending] = field(default_factory=list)

    @property
    def tasks(self) -> list[Task]:
        return [p.task for p in self.items]


def batch_of(task: Task) -> int:
    return task.batch if task.batch >= 0 else UNSTAMPED


class TaskIntake:
    """Takes tasks for one explorer a batch at a time; dead-letters tasks that do not
    decode or name an unknown workflow; reports the partitions it holds after every
    rebalance."""

    def __init__(self, cfg: Config, name: str, events: EventSender, counters: Counters) -> None:
        self.name = name
        self.events = events
        self.counters = counters
        self.cfg = cfg
        self._consumer: kafka.TaskConsumer | None = None  # made in start(), inside the loop
        self.partitions: tuple[int, ...] = ()
        """Tasks partitions this explorer holds (from the newest rebalance)."""
        self.assignments = 0
        """Rebalances seen so far (a take's tasks are stale for waiting once it changed)."""
        self.backlog: list[Pending] = []
        """Read past the batch handed out; waits for a later take."""
        self.read_to: dict[int, int] = {}
        """Per partition held: the offset after the last record read."""
        self.passed: dict[int, int] = {}
        """Per partition held: the highest batch index read from it."""
        self._to_report = False
        self._taking = asyncio.Lock()
        """Held by a take or a keep-alive poll: one poll of the group at a time."""
        self._keeper: asyncio.Task[None] | None = None
        self._rolling_out = False

    @property
    def consumer(self) -> kafka.TaskConsumer:
        """The tasks group's consumer (started by :meth:`start`)."""
        if self._consumer is None:
            raise RuntimeError("TaskIntake.start() was not called")
        return self._consumer

    async def start(self) -> None:
        topics = self.cfg.topics()
        self._consumer = kafka.task_consumer(
            self.cfg.kafka, topics.tasks, topics.explorers_group, self.name, self._on_assign
        )
        await self._consumer.start()
        self._keeper = asyncio.create_task(self.keep_membership(), name=f"{self.name}-keepalive")
        self._keeper.add_done_callback(self._keeper_ended)

    async def stop(self) -> None:
        """Leave the group; safe to call twice, and before start."""
        keeper, self._keeper = self._keeper, None
        try:
            if keeper is not None:
                keeper.cancel()
                await asyncio.wait({keeper})
        finally:
            if self._consumer is not None:
                await self._consumer.stop()

    def _keeper_ended(self, keeper: asyncio.Task[None]) -> None:
        if not keeper.cancelled() and keeper.exception() is not None:
            log.error(
                "%s: the tasks group's keep-alive stopped: %r; a step longer than "
                "kafka.max_poll_interval_ms puts this explorer out of the group",
                self.name,
                keeper.exception(),
            )

    @contextlib.asynccontextmanager
    async def rolling_out(self) -> AsyncIterator[None]:
        """Around a step's rollouts: one keep-alive poll as they start, none while they
        run, so rollouts longer than ``kafka.max_poll_interval_ms`` put this explorer
        out of the group (see module)."""
        async with self._taking:
            await self._poll_to_stay()
        self._rolling_out = True
        try:
            yield
        finally:
            self._rolling_out = False

    async def keep_membership(self) -> None:
        """Run until cancelled: outside takes and rollouts, poll with every partition
        paused once a :data:`KEEPALIVE_FRACTION` of ``max_poll_interval_ms`` went by
        without a poll (see module). A failed poll is logged and tried again."""
        every = self.cfg.kafka.max_poll_interval_ms / 1000 / KEEPALIVE_FRACTION
        while True:
            await asyncio.sleep(max(every - self.consumer.idle_s(), 0.1))
            if self._taking.locked() or self._rolling_out or self.consumer.idle_s() < every:
                continue
            async with self._taking:
                ok = await self._poll_to_stay()
            if not ok:
                await asyncio.sleep(min(every, KEEPALIVE_RETRY_S))

    async def _poll_to_stay(self) -> bool:
        """One keep-alive poll (the caller holds ``_taking``; it does not wait); False if
        it failed or a rebalance is under way."""
        try:
            polled = await self.consumer.keep_membership()
        except KafkaError as exc:
            self.counters.add("tasks_keepalive_failures")
            log.warning("%s: keep-alive poll of the tasks group failed: %s", self.name, exc)
            return False
        if polled:
            self.counters.add("tasks_keepalives")
        return polled

    def _on_assign(self, partitions: tuple[int, ...]) -> None:
        """A rebalance gave this explorer ``partitions``: what was read from partitions it
        no longer holds is forgotten (their new holder reads them from the committed
        offset); counted now, reported on status at the next take (counters
        ``tasks_partitions`` and ``rebalances``)."""
        held = set(partitions)
        self.backlog = [p for p in self.backlog if p.tp.partition in held]
        self.read_to = {p: o for p, o in self.read_to.items() if p in held}
        self.passed = {p: b for p, b in self.passed.items() if p in held}
        self.partitions = partitions
        self.assignments += 1
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

    # -- taking ----------------------------------------------------------------------------
    def lowest(self) -> int | None:
        """The lowest batch in the backlog (None: empty)."""
        return min((batch_of(p.task) for p in self.backlog), default=None)

    def share_complete(self, batch: int, n: int) -> bool:
        """This explorer holds all of ``batch`` it will get (every partition it holds has
        shown a later batch), or ``n`` of its tasks (a full step)."""
        have = sum(1 for p in self.backlog if batch_of(p.task) == batch)
        return have >= n or all(self.passed.get(p, UNSTAMPED) > batch for p in self.partitions)

    async def take(
        self, n: int, give_up: Callable[[], bool], empty_ok: Callable[[], bool]
    ) -> Taken:
        """Up to ``n`` tasks of the lowest batch read, once this explorer's share of it is
        complete (see module). Returns early with what it has when the topic stays idle
        for :data:`IDLE_RETURN_S`, with nothing when ``empty_ok()`` and nothing was read
        (something else wants this explorer, e.g. a broadcast group), and at once when
        ``give_up()`` (stop)."""
        async with self._taking:
            return await self._take(n, give_up, empty_ok)

    async def _take(
        self, n: int, give_up: Callable[[], bool], empty_ok: Callable[[], bool]
    ) -> Taken:
        idle_since = time.monotonic()
        while not give_up():
            await self._report_assignment()
            low = self.lowest()
            if low is not None and self.share_complete(low, n):
                break
            if low is None and empty_ok():
                break
            # partitions already past the batch wait: what they hold is for later takes
            self.consumer.hold_back(
                {p for p, b in self.passed.items() if low is not None and b > low}
            )
            records = await poll(self.consumer, TASK, 200, max_records=n)
            for rec in records:
                await self._read(rec)
            if records:
                idle_since = time.monotonic()
            elif low is not None and self._idle_enough(time.monotonic() - idle_since):
                break
        return self._hand_out(n)

    def _idle_enough(self, idle_s: float) -> bool:
        """Hand out a partial share: the topic was idle :data:`IDLE_RETURN_S` and nothing
        held may still hold unread tasks (a partition just assigned may hold an older
        batch), or it was idle :data:`UNREAD_GRACE_S`."""
        if idle_s > UNREAD_GRACE_S:
            return True
        return idle_s > IDLE_RETURN_S and not self.consumer.unread()

    def _hand_out(self, n: int) -> Taken:
        low = self.lowest()
        if low is None:
            return Taken()
        taken = Taken(batch=low)
        keep: list[Pending] = []
        for p in self.backlog:
            if batch_of(p.task) == low and len(taken.items) < n:
                taken.items.append(p)
            else:
                keep.append(p)
        self.backlog = keep
        return taken

    def give_back(self, taken: Taken) -> None:
        """Return tasks handed out but not explored (the partitions moved while this
        explorer waited); those of partitions it no longer holds are dropped (their new
        holder has them)."""
        held = set(self.partitions)
        items = {(p.tp.partition, p.offset): p for p in taken.items if p.tp.partition in held}
        items.update({(p.tp.partition, p.offset): p for p in self.backlog})  # read again
        self.backlog = [items[key] for key in sorted(items)]
        for part, offset in items:
            self.read_to[part] = max(self.read_to.get(part, 0), offset + 1)

    async def _read(self, rec: Record) -> None:
        part = rec.partition
        if rec.offset < self.read_to.get(part, 0) or part not in self.partitions:
            return  # read already (a rebalance reset the position), or no longer held
        self.read_to[part] = rec.offset + 1
        error = rec.error
        if error is None:
            try:
                check_workflow(rec.obj.workflow)
            except StreamRFTError as exc:
                error = exc
        if error is not None:
            await self.events.dead_letter(dataclasses.replace(rec, obj=None, error=error))
            return
        self.passed[part] = max(self.passed.get(part, UNSTAMPED), batch_of(rec.obj))
        self.backlog.append(Pending(TopicPartition(rec.topic, part), rec.offset, rec.obj))

    # -- committing ------------------------------------------------------------------------
    def commit_offsets(self) -> dict[int, int]:
        """Per partition held and read from: the first offset not yet explored (the
        oldest task still in the backlog, else the offset after the last read)."""
        offsets = dict(self.read_to)
        for p in self.backlog:
            part = p.tp.partition
            offsets[part] = min(offsets.get(part, p.offset), p.offset)
        return offsets

    async def commit(self) -> None:
        """Commit up to the first task not yet explored, in every partition held; call it
        once the tasks handed out were published. After a rebalance moved a partition the
        commit fails: another explorer redoes those tasks, the trainer deduplicates,
        nothing is lost."""
        offsets = self.commit_offsets()
        if not offsets:
            return
        topic = self.consumer.topic
        log.debug("%s: committing %s", self.name, offsets)
        try:
            await self.consumer.commit(
                {TopicPartition(topic, p): OffsetAndMetadata(o, "") for p, o in offsets.items()}
            )
        except (CommitFailedError, KafkaError) as exc:
            self.counters.add("commit_failures")
            log.warning(
                "%s: commit failed after rebalance (%s); tasks may be explored twice",
                self.name,
                exc,
            )
