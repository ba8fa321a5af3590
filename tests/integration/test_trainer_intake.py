"""The trainer's experience intake on the real broker: restored offsets apply once, so a
rebalance after a restore goes on from the offsets committed since, and does not re-read
(and re-dead-letter) what was consumed."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.intake import ExperienceIntake
from streamrft.infra import admin, kafka
from streamrft.infra.bus import Counters, EventSender
from streamrft.infra.consume import poll
from streamrft.schemas.codec import EXPERIENCE_GROUP
from tests.harness.fuzz import FuzzMessage, inject
from tests.helpers.groups import make_group
from tests.helpers.waits import until

pytestmark = pytest.mark.integration


def test_a_rebalance_after_a_restore_does_not_read_again(make_config):
    cfg = make_config(trainer={"max_staleness": 5})
    topics = cfg.topics()
    groups = [make_group(topics.run, f"task-{i}", 0) for i in range(6)]
    messages = [FuzzMessage(b"\xc1 junk", key=b"junk")] + [
        FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers(), g.task_id.encode())
        for g in groups
    ]

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        await inject(cfg, topics.experiences, messages)
        partitions = range(cfg.kafka.partitions)
        restored = {(topics.experiences, p): 0 for p in partitions}  # a checkpoint at 0
        counters, buffer = Counters(), ExperienceBuffer(max_staleness=5)
        events = EventSender(cfg, "trainer", "trainer", counters)
        intake = ExperienceIntake(cfg, buffer, events, counters, vocab_size=64)
        other = kafka.experience_consumer(cfg.kafka, topics.experiences, intake.group, "other")
        await events.start()
        await intake.start(restored)
        try:
            stop = asyncio.Event()

            async def nothing() -> None:
                pass

            first = await asyncio.wait_for(intake.collect(6, lambda: 0, stop, nothing), 60)
            await intake.commit()  # as after a checkpoint
            # another member joins (the intake's partitions are reassigned: a rebalance),
            # then leaves (they are reassigned again, all of them)
            await kafka.start_client(other, "other member")
            await until(lambda: other.assignment(), 60, "the other member's partitions")
            await other.stop()
            assigned = len(partitions)
            await until(
                lambda: len(intake.consumer.assignment()) == assigned, 60, "all partitions back"
            )
            again = []
            for _ in range(15):  # 3 s of polls: anything read again would show up
                again += await poll(intake.consumer, EXPERIENCE_GROUP, 200)
            return first, again, counters.snapshot(), buffer
        finally:
            await intake.stop()
            await events.stop()

    first, again, counters, buffer = asyncio.run(scenario())
    assert sorted(g.task_id for g in first) == [f"task-{i}" for i in range(6)]
    assert counters["dead_letters"] == 1  # the junk, once
    assert again == []  # before the fix: every record again, from offset 0
    assert buffer.duplicates_dropped == 0


def test_groups_made_too_stale_by_a_version_published_while_waiting_are_dropped(make_config):
    """The trainer publishes while it waits for a batch (answering a sync request): groups
    already buffered that this makes older than max_staleness are dropped, not trained."""
    cfg = make_config(trainer={"max_staleness": 1})
    topics = cfg.topics()

    def records(groups):
        return [
            FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers(), g.task_id.encode())
            for g in groups
        ]

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        await inject(cfg, topics.experiences, records([make_group(topics.run, "old", 5)]))
        counters, buffer = Counters(), ExperienceBuffer(max_staleness=1)
        events = EventSender(cfg, "trainer", "trainer", counters)
        intake = ExperienceIntake(cfg, buffer, events, counters, vocab_size=64)
        version = [5]

        async def publish_while_waiting() -> None:
            if len(buffer) == 1:  # "old" is buffered, the batch is not full: publish v7
                version[0] = 7
                fresh = [make_group(topics.run, f"new-{i}", 7) for i in range(2)]
                await inject(cfg, topics.experiences, records(fresh))

        await events.start()
        await intake.start({})
        try:
            collect = intake.collect(2, lambda: version[0], asyncio.Event(), publish_while_waiting)
            batch = await asyncio.wait_for(collect, 60)
        finally:
            await intake.stop()
            await events.stop()
        return batch, buffer

    batch, buffer = asyncio.run(scenario())
    assert sorted(g.task_id for g in batch) == ["new-0", "new-1"]
    assert buffer.stale_dropped == 1


def test_an_explorer_in_the_middle_of_a_long_step_keeps_the_stream_alive(make_config):
    """No experience for longer than ``trainer.idle_timeout_s`` ends the run only once no
    explorer says it is working (at 41ac149 a step slower than the timeout ended the run,
    reported as success)."""
    import time

    cfg = make_config(trainer={"idle_timeout_s": 1.0})
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        counters, buffer = Counters(), ExperienceBuffer(max_staleness=100)
        events = EventSender(cfg, "trainer", "trainer", counters)
        intake = ExperienceIntake(cfg, buffer, events, counters, vocab_size=64)

        async def nothing() -> None:
            return None

        await events.start()
        await intake.start({})
        try:
            t0 = time.monotonic()
            until = t0 + 4.0  # an explorer's step of 4 s, four times the idle timeout
            batch = await asyncio.wait_for(
                intake.collect(
                    2, lambda: 0, asyncio.Event(), nothing, lambda: time.monotonic() < until
                ),
                60,
            )
            waited = time.monotonic() - t0
            idle = await asyncio.wait_for(
                intake.collect(2, lambda: 0, asyncio.Event(), nothing), 60
            )
        finally:
            await intake.stop()
            await events.stop()
        return batch, waited, idle

    batch, waited, idle = asyncio.run(scenario())
    assert batch is None and idle is None  # both end idle in the end, with nothing to train
    assert waited > 4.0  # not while the explorer said it was working


def test_a_stream_of_solved_tasks_still_ends_while_explorers_work(make_config):
    """Explorers working on tasks that are all solved (every group's rewards equal, dropped
    by dynamic sampling) do not keep the run alive: no signal for the idle timeout ends it."""
    import time

    cfg = make_config(trainer={"idle_timeout_s": 1.0})
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        counters = Counters()
        buffer = ExperienceBuffer(max_staleness=100, dynamic_sampling=True)
        events = EventSender(cfg, "trainer", "trainer", counters)
        intake = ExperienceIntake(cfg, buffer, events, counters, vocab_size=64)
        solved = iter(range(10_000))

        async def explorers_publish_solved() -> None:  # a solved group now and then
            n = next(solved)
            if n % 5 == 0:
                group = make_group(topics.run, f"solved-{n}", 0, rewards=[1.0] * 4)
                await inject(
                    cfg,
                    topics.experiences,
                    [FuzzMessage(EXPERIENCE_GROUP.encode(group), EXPERIENCE_GROUP.headers())],
                )

        await events.start()
        await intake.start({})
        try:
            t0 = time.monotonic()
            batch = await asyncio.wait_for(
                intake.collect(
                    2, lambda: 0, asyncio.Event(), explorers_publish_solved, lambda: True
                ),
                60,
            )
        finally:
            await intake.stop()
            await events.stop()
        return batch, buffer.zero_variance_dropped, time.monotonic() - t0

    batch, dropped, _waited = asyncio.run(scenario())
    assert batch is None and dropped >= 1
