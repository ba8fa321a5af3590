"""DAPO dynamic sampling through the trainer's experience intake on the real broker: groups
whose rewards are all equal are counted and never trained, batches are filled from the
stream, a restart does not read the dropped groups again, and a stream of nothing but
such groups still ends the run after ``trainer.idle_timeout_s``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.intake import ExperienceIntake
from streamrft.infra import admin
from streamrft.infra.bus import Counters, EventSender
from streamrft.schemas.codec import EXPERIENCE_GROUP
from tests.harness.fuzz import FuzzMessage, inject
from tests.helpers.groups import make_group

pytestmark = pytest.mark.integration

BATCHES = [  # s: rewards differ, f: all equal; 4 tasks a batch, in this order on one partition
    ["s0", "f0", "s1", "f1"],
    ["f2", "s2", "s3", "s4"],
    ["f3", "f4", "f5", "s5"],
    ["s6", "f6", "s7", "s8"],
]


def records(run: str, named: list[tuple[str, int]]) -> list[FuzzMessage]:
    groups = [
        make_group(run, name, 0, rewards=[1.0] * 4 if name[0] == "f" else None, batch=batch)
        for name, batch in named
    ]
    return [
        FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers(), g.task_id.encode())
        for g in groups
    ]


async def nothing() -> None:
    pass


def test_flat_groups_are_counted_never_trained_and_not_read_again_after_a_restart(make_config):
    cfg = make_config(kafka={"partitions": 1}, trainer={"max_staleness": 5})
    topics = cfg.topics()
    named = [(name, b) for b, names in enumerate(BATCHES) for name in names]

    async def run_intake(buffer: ExperienceBuffer, resume: dict, steps: list[int]):
        counters = Counters()
        events = EventSender(cfg, "trainer", "trainer", counters)
        intake = ExperienceIntake(cfg, buffer, events, counters, vocab_size=64)
        await events.start()
        await intake.start(resume)
        try:
            trained = []
            for n in steps:
                batch = await asyncio.wait_for(
                    intake.collect(n, lambda: 0, asyncio.Event(), nothing), 60
                )
                trained.append([g.task_id for g in batch])
            await intake.commit()  # as after the checkpoint
            return trained
        finally:
            await intake.stop()
            await events.stop()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        offsets = await inject(cfg, topics.experiences, records(topics.run, named))
        buffer = ExperienceBuffer(max_staleness=5, dynamic_sampling=True)
        trained = await run_intake(buffer, {}, [4, 4])
        state = buffer.state(step=2, version=2, counters={})
        # the restart: a new buffer from the checkpoint, reading from its offsets
        resumed = ExperienceBuffer(max_staleness=5, dynamic_sampling=True)
        resumed.restore(state)
        again = await run_intake(resumed, state.resume_offsets(), [1])
        return offsets, trained, state, resumed, again

    offsets, trained, state, resumed, again = asyncio.run(scenario())
    # each batch full of groups with signal: batch 0's two, filled from batch 1, and so on
    assert trained == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"]]
    assert state.zero_variance_dropped == 7  # f0..f6 consumed, counted, not trained
    assert state.duplicates_dropped == 0 and state.stale_dropped == 0
    # the restart resumes at s8, the one group not trained: the dropped ones are done
    (s8,) = [offset for (name, _), (_, offset) in zip(named, offsets, strict=True) if name == "s8"]
    assert state.resume_offsets() == {(topics.experiences, 0): s8}
    assert again == [["s8"]]
    assert resumed.duplicates_dropped == 0  # nothing before s8 was read again
    assert resumed.zero_variance_dropped == 7


def test_a_stream_of_nothing_but_flat_groups_ends_after_the_idle_timeout(make_config, caplog):
    """Explorers keep publishing (the model solved every task): records arrive all the
    time, but none can be trained; the intake says so and gives up after
    ``trainer.idle_timeout_s`` instead of waiting forever."""
    cfg = make_config(trainer={"max_staleness": 5, "idle_timeout_s": 2.0})
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        buffer = ExperienceBuffer(max_staleness=5, dynamic_sampling=True)
        counters = Counters()
        events = EventSender(cfg, "trainer", "trainer", counters)
        intake = ExperienceIntake(cfg, buffer, events, counters, vocab_size=64)
        sent = iter(range(10**6))

        async def explorers_publish() -> None:
            i = next(sent)
            await inject(cfg, topics.experiences, records(topics.run, [(f"f{i}", i // 4)]))

        await events.start()
        await intake.start({})
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            collect = intake.collect(2, lambda: 0, asyncio.Event(), explorers_publish)
            batch = await asyncio.wait_for(collect, 30)  # before: no end while records came
        finally:
            await intake.stop()
            await events.stop()
        return batch, buffer, loop.time() - t0

    with caplog.at_level(logging.INFO, logger="streamrft.consumers.intake"):
        batch, buffer, took = asyncio.run(scenario())
    assert batch is None
    assert buffer.zero_variance_dropped >= 3 and len(buffer) == 0
    assert 2.0 < took < 20
    assert "rewards are all equal" in caplog.text  # said while it happens
    assert "no experience with signal for 2s" in caplog.text
