"""An explorer's task intake hands out one batch at a time, on the real broker.

The feeder stamps 100 tasks into batches of 8 over 4 partitions; an intake holding every
partition takes them batch by batch, in order, never mixing two; what it read past the
batch waits in its backlog and is not committed, so an explorer that takes over reads it
again from the committed offsets.
"""

from __future__ import annotations

import asyncio

import pytest

from streamrft.infra import admin
from streamrft.infra.bus import Counters, EventSender
from streamrft.producers.feeder import Feeder
from streamrft.producers.task_intake import TaskIntake

pytestmark = pytest.mark.integration

PER_BATCH = 8


async def _intake(cfg, name: str) -> tuple[TaskIntake, EventSender]:
    counters = Counters()
    events = EventSender(cfg, name, "explorer", counters)
    await events.start()
    intake = TaskIntake(cfg, name, events, counters)
    await intake.start()
    return intake, events


async def _take(intake: TaskIntake, n: int):
    return await asyncio.wait_for(intake.take(n, lambda: False, lambda: False), 60)


def test_batches_are_taken_whole_in_order_and_committed_up_to_the_backlog(make_config):
    cfg = make_config(kafka={"partitions": 4}, trainer={"batch_size": PER_BATCH})
    feeder = Feeder(cfg)
    ids = [task.id for task in feeder.epoch_tasks(0)]
    expected = [ids[b * PER_BATCH : (b + 1) * PER_BATCH] for b in range(len(ids) // PER_BATCH)]

    async def scenario():
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        assert await feeder.run() == 100
        intake, events = await _intake(cfg, "explorer-0")
        try:
            for b in range(3):  # whole batches, each exactly the feeder's 8 tasks
                taken = await _take(intake, PER_BATCH)
                assert taken.batch == b and all(t.batch == b for t in taken.tasks)
                assert sorted(t.id for t in taken.tasks) == sorted(expected[b])
                await intake.commit()
            # a step smaller than a share: batch 3 in 3 + 3 + 2, never mixed with batch 4
            sizes = []
            while len(sizes) < 3:
                taken = await _take(intake, 3)
                assert taken.batch == 3, (taken.batch, sizes)
                sizes.append(len(taken.tasks))
            assert sizes == [3, 3, 2]
            await intake.commit()  # batch 3 published
            assert intake.backlog  # batch 4 and later, read ahead: not committed
            committed = intake.commit_offsets()
            for p in intake.backlog:
                assert committed[p.tp.partition] <= p.offset
            # taken but not explored when this explorer stops: the next one gets it again
            unexplored = await _take(intake, PER_BATCH)
            assert unexplored.batch == 4
        finally:
            await intake.stop()
            await events.stop()
        heir, heir_events = await _intake(cfg, "explorer-1")
        try:
            again = await _take(heir, PER_BATCH)
        finally:
            await heir.stop()
            await heir_events.stop()
        return unexplored, again

    unexplored, again = asyncio.run(scenario())
    assert again.batch == 4
    assert sorted(t.id for t in again.tasks) == sorted(t.id for t in unexplored.tasks)


def test_an_explorer_keeps_its_partitions_through_waits_not_through_stuck_rollouts(make_config):
    """Longer than ``kafka.max_poll_interval_ms`` outside rollouts (a wait for a version,
    takes served from the backlog): the intake's keep-alive polls keep the explorer in
    the group, and the takes after it go on batch by batch, whole. Without them the member
    leaves the group once the interval has gone by (and rejoins at its next read; on
    Apache Kafka its commit would fail too). Rollouts that long count as stuck: no
    keep-alive then, and the member is put out, so its partitions can move."""
    interval_ms = 10_000  # the least the config takes
    long_s = 2.5 * interval_ms / 1000
    cfg = make_config(
        kafka={"partitions": 4, "max_poll_interval_ms": interval_ms},
        trainer={"batch_size": PER_BATCH},
    )
    feeder = Feeder(cfg)

    async def scenario():
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        assert await feeder.run() == 100
        intake, events = await _intake(cfg, "explorer-0")
        try:
            taken = await _take(intake, PER_BATCH)
            batches = [(taken.batch, len(taken.tasks))]
            await asyncio.sleep(long_s)  # waiting at the sync point: the loop is free
            in_after_wait = intake.consumer.in_group
            await intake.commit()
            for _ in range(3):  # the next batches, each read from the topic
                taken = await _take(intake, PER_BATCH)
                batches.append((taken.batch, len(taken.tasks)))
                await intake.commit()
            assignments = intake.assignments
            async with intake.rolling_out():
                await asyncio.sleep(long_s)  # rollouts that never end
                in_after_rollouts = intake.consumer.in_group
            return (in_after_wait, in_after_rollouts, batches, assignments, intake.counters)
        finally:
            await intake.stop()
            await events.stop()

    in_after_wait, in_after_rollouts, batches, assignments, counters = asyncio.run(scenario())
    counts = counters.snapshot()
    assert in_after_wait, counts  # still in the group after the long wait
    assert assignments == 1, counts  # never put out and rejoined
    assert counts.get("commit_failures", 0) == 0, counts
    assert counts["tasks_keepalives"] >= 2, counts  # about every quarter interval
    assert batches == [(b, PER_BATCH) for b in range(4)]  # whole, in order: nothing skipped
    assert not in_after_rollouts, counts  # stuck rollouts: out of the group
