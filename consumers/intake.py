"""The trainer's experience intake: consume, decode, dead-letter, deduplicate, drop stale
(and, with ``algorithm.dynamic_sampling``, groups without signal), hand out batches, and
say when it starves.

Offsets are the intake's business too: after a restore it seeks each partition to the
offset the checkpoint holds, once (the first assignment of that partition), and it commits
the buffer's resume offsets when the trainer has checkpointed.

A replay (``streamrft train --from-*``, :mod:`.replay`) reads through a
:class:`~.replay.ReplayCursor` instead of the group: one recorded experiences topic between
the bounds read when it started, no offsets committed; once it is read to its end the
intake hands out what is left in full batches (forced: nothing more will come) and then
finishes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from streamrft.consumers.algorithms import resolve_algorithm
from streamrft.consumers.algorithms.dpo import check_group_kind
from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.poison import GroupLimits
from streamrft.consumers.replay import ReplayCursor
from streamrft.infra import kafka
from streamrft.infra.bus import HEARTBEAT_S, Counters, EventSender
from streamrft.infra.config import Config
from streamrft.infra.consume import Record, poll
from streamrft.schemas.codec import EXPERIENCE_GROUP
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import ExperienceGroup, check_token_ids

log = logging.getLogger(__name__)

STARVED_AFTER_S = 2 * HEARTBEAT_S
"""No experience at all for this long, with no batch to train, marks the trainer starved
on its status (see StatusEvent)."""

ZERO_VARIANCE_LOG_S = 10.0
"""Groups dropped for rewards all equal (``algorithm.dynamic_sampling``) are logged as one
sum at most this often."""


def _check_token_ids(group: ExperienceGroup, vocab_size: int) -> None:
    """:func:`check_token_ids` at numpy speed: the same rule, and on a violation the same
    error (the schemas' check, which names the experience and the id, is run then)."""
    for exp in group.experiences:
        if np.frombuffer(exp.tokens, "<i4").max() >= vocab_size:
            check_token_ids(group, vocab_size)


@dataclasses.dataclass
class StreamActivity:
    """When the stream last brought a record (no record for a while: starved), and a record
    that is not a group dropped for rewards all equal (none for ``trainer.idle_timeout_s``:
    idle, the run finishes; so a stream of nothing but solved tasks ends it too)."""

    last_record: float
    last_signal: float
    dropped_since_signal: int = 0
    """Groups dropped for zero reward variance since :attr:`last_signal`."""

    def saw(self, records: int, zero_variance: int, now: float) -> None:
        """One poll brought ``records``, of which ``zero_variance`` were dropped so."""
        if records:
            self.last_record = now
        if records > zero_variance:
            self.last_signal, self.dropped_since_signal = now, 0
        else:
            self.dropped_since_signal += zero_variance

    def idle(self, now: float, timeout_s: float) -> bool:
        return now - self.last_signal > timeout_s


class SeekOnFirstAssign(ConsumerRebalanceListener):
    """Seeks each partition to its restored offset the first time it is assigned, and
    never again: a later assignment (a rejoin after a session timeout, a rebalance) goes on
    from the group's position instead of re-reading (and re-dead-lettering) old records."""

    def __init__(self, consumer, offsets: dict[tuple[str, int], int]) -> None:
        self.consumer = consumer
        self.pending = dict(offsets)
        """Restored offsets not applied yet."""

    async def on_partitions_revoked(self, revoked) -> None:
        pass

    async def on_partitions_assigned(self, assigned) -> None:
        for tp in assigned:
            offset = self.pending.pop((tp.topic, tp.partition), None)
            if offset is not None:
                self.consumer.seek(tp, offset)


class ExperienceIntake:
    """Batches of fresh experience groups for the trainer, from the experiences topic."""

    def __init__(
        self,
        cfg: Config,
        buffer: ExperienceBuffer,
        events: EventSender,
        counters: Counters,
        vocab_size: int,
        replay: ReplayCursor | None = None,
        limits: GroupLimits | None = None,
    ) -> None:
        self.cfg = cfg
        self.limits = limits or GroupLimits(cfg.trainer.max_group_rows)
        """The largest group the trainer takes (larger ones are dead-lettered)."""
        self.poisoned: set[str] = set()
        """Ids of groups the trainers died on (:class:`~.poison.InFlight`): dead-lettered."""
        self.replay = replay
        """Set: a replay of a recorded stream (no group, stops at its end)."""
        self.buffer = buffer
        self.events = events
        self.counters = counters
        self.vocab_size = vocab_size
        self.pairs = resolve_algorithm(cfg).spec.pairs
        """DPO: only preference pairs are trained (anything else is dead-lettered), and
        pairs only by DPO."""
        topics = cfg.topics()
        self.topic = replay.bounds.topic if replay is not None else topics.experiences
        self.group = topics.group("trainer")
        self.consumer: Any = None  # made in start(), inside the event loop
        self.starved = False
        self.ended_idle = False
        """:meth:`collect` ended because the stream stayed idle with nothing working (and
        not because the groups that came were all dropped for rewards all equal)."""
        """The trainer has had no experience for :data:`STARVED_AFTER_S` (on its status)."""
        self._progress: tuple[int | None, int, float] = (None, 0, 0.0)
        """(oldest batch buffered, groups of it arrived, when that last changed)."""
        self._unlogged_drops = (0, -math.inf)
        """(groups dropped for zero variance not logged yet, when the last log was)."""

    async def start(self, resume_offsets: dict[tuple[str, int], int]) -> None:
        """Join the trainer's group; partitions restored from a checkpoint start at its
        offsets. A replay reads its topic from the checkpoint's offsets, or its start."""
        if self.replay is not None:
            self.consumer = await self.replay.open(self.cfg.kafka, resume_offsets)
            return
        self.consumer = kafka.experience_consumer(self.cfg.kafka, self.topic, self.group, "trainer")
        self.consumer.subscribe(
            [self.topic], listener=SeekOnFirstAssign(self.consumer, resume_offsets)
        )
        await kafka.start_client(self.consumer, "trainer experience consumer")

    async def stop(self) -> None:
        """Leave the group; safe to call twice, and before start."""
        if self.consumer is not None:
            await self.consumer.stop()

    async def collect(
        self,
        n: int,
        version: Callable[[], int],
        stop: asyncio.Event,
        while_waiting: Callable[[], Awaitable[object]],
        working: Callable[[], bool] = lambda: False,
    ) -> list[ExperienceGroup] | None:
        """``n`` fresh groups for the trainer's ``version()`` (read on every pass:
        ``while_waiting`` may publish a newer one, and groups it makes too stale are
        dropped); None on stop, when the stream stays idle ``trainer.idle_timeout_s``, or
        when a replay is read to its end and fewer than ``n`` groups are left.
        ``while_waiting()`` runs on every poll that has no batch yet (the trainer answers
        sync requests there). Groups dropped for rewards all equal do not count as
        experience for the idle timeout (see :class:`StreamActivity`); while ``working()``
        (an explorer says it is in the middle of a step) the stream is not idle either."""
        loop = asyncio.get_running_loop()
        activity = StreamActivity(loop.time(), loop.time())
        while not stop.is_set():
            now = version()
            dropped = self.buffer.drop_stale(now)
            if dropped:
                log.info("trainer: dropped %d stale groups (version %d)", len(dropped), now)
            groups = self._take(n, loop.time())
            if groups is not None:
                return groups
            if self.replay is not None and self.replay.done:
                return self._take_last(n)
            if not self.starved and loop.time() - activity.last_record > STARVED_AFTER_S:
                await self._set_starved(True)  # explorers waiting on a version go on
            await while_waiting()
            records = await poll(self.consumer, EXPERIENCE_GROUP, 200)
            if self.replay is not None:
                records = await self.replay.bound(self.consumer, records)
            flat = self.buffer.zero_variance_dropped
            for rec in records:
                await self._offer(rec)
            flat = self.buffer.zero_variance_dropped - flat  # dropped: rewards all equal
            activity.saw(len(records), flat, loop.time())
            if working() and not activity.dropped_since_signal:
                # a step under way, however long: the stream is not idle (a stream of
                # solved tasks only, dropped for rewards all equal, still is)
                activity.last_signal = loop.time()
            self._log_zero_variance(flat, loop.time())
            if records and self.starved:
                await self._set_starved(False)
            if activity.idle(loop.time(), self.cfg.trainer.idle_timeout_s):
                self._log_idle(activity)
                self.ended_idle = not activity.dropped_since_signal
                return None
        return None

    def _take_last(self, n: int) -> list[ExperienceGroup] | None:
        """A replay read to its end: what is left, in full batches (forced: nothing more
        will come); None once fewer than ``n`` groups are left (the trainer finishes)."""
        groups = self.buffer.take(n, force=True)
        if groups is None:
            log.info(
                "trainer: replay read to its end offsets; %d groups left (fewer than %d)",
                len(self.buffer),
                n,
            )
        return groups

    def _log_zero_variance(self, dropped: int, now: float) -> None:
        """Say, as one sum at most every :data:`ZERO_VARIANCE_LOG_S`, that groups are being
        dropped for rewards all equal (a stream of nothing else trains nothing)."""
        unlogged, logged_at = self._unlogged_drops
        unlogged += dropped
        if unlogged and now - logged_at >= ZERO_VARIANCE_LOG_S:
            log.info(
                "trainer: dropped %d groups whose rewards are all equal (no signal; "
                "algorithm.dynamic_sampling), %d in all",
                unlogged,
                self.buffer.zero_variance_dropped,
            )
            unlogged, logged_at = 0, now
        self._unlogged_drops = (unlogged, logged_at)

    def _log_idle(self, activity: StreamActivity) -> None:
        timeout_s = self.cfg.trainer.idle_timeout_s
        if activity.dropped_since_signal:
            log.warning(
                "trainer: no experience with signal for %.0fs (%d groups in that time had "
                "rewards all equal and were dropped: algorithm.dynamic_sampling); finishing",
                timeout_s,
                activity.dropped_since_signal,
            )
        else:
            log.warning("trainer: no experiences for %.0fs; finishing", timeout_s)

    def _take(self, n: int, now: float) -> list[ExperienceGroup] | None:
        """A batch in batch order; when no group of the oldest batch arrived for
        ``trainer.batch_wait_s``, the oldest groups buffered even though that batch is
        incomplete (counter ``batches_forced``: a task was lost or dead-lettered, or an
        explorer is slower than the wait)."""
        groups = self.buffer.take(n)
        oldest = self.buffer.waiting_for()
        progress = (oldest, self.buffer.arrived.get(oldest, 0) if oldest is not None else 0)
        if progress != self._progress[:2]:
            self._progress = (*progress, now)
        stuck_s = now - self._progress[2]
        if groups is None and oldest is not None and stuck_s > self.cfg.trainer.batch_wait_s:
            groups = self.buffer.take(n, force=True)
            if groups is not None:
                self.counters.add("batches_forced")
                log.warning(
                    "trainer: batch %d has had %d of %d groups for %.0fs; training the "
                    "oldest groups buffered",
                    oldest,
                    progress[1],
                    n,
                    stuck_s,
                )
        return groups

    async def _offer(self, rec: Record) -> None:
        error = rec.error
        if error is None:
            try:
                _check_token_ids(rec.obj, self.vocab_size)
                check_group_kind(rec.obj, self.pairs)
                self.limits.check(rec.obj)
            except SchemaError as exc:
                error = exc
            if rec.obj.id in self.poisoned:
                error = SchemaError(
                    f"group {rec.obj.id}: trainers died training {self.cfg.trainer.max_step_crashes}"
                    " batches that held it (trainer.max_step_crashes)"
                )
                self.counters.add("groups_set_aside")
        if error is not None:
            await self.events.dead_letter(dataclasses.replace(rec, obj=None, error=error))
            self.buffer.skip((rec.topic, rec.partition), rec.offset)
            return
        if self.buffer.offer(rec.obj, (rec.topic, rec.partition), rec.offset):
            self.counters.add("groups_consumed")
            self.counters.add("experiences_consumed", len(rec.obj.experiences))

    async def _set_starved(self, starved: bool) -> None:
        self.starved = starved
        await self.events.status(detail="waiting for experiences" if starved else "")

    async def commit(self, resume: dict[tuple[str, int], int] | None = None) -> None:
        """Commit ``resume`` offsets (a checkpoint's, once it is durable; None: the
        buffer's now); a replay commits nothing (it has no group; the checkpoint holds
        them)."""
        if self.replay is not None:
            return
        chosen = self.buffer.resume_offsets() if resume is None else resume
        offsets = {TopicPartition(t, p): OffsetAndMetadata(o, "") for (t, p), o in chosen.items()}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:  # the checkpoint holds the offsets; resume seeks to them
            log.warning("trainer: offset commit failed (%s); the checkpoint has them", exc)
