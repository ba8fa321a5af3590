"""A replay's intake on the real broker: it reads a recorded experiences topic to the end
it found when it started (multi-record batches included, whose end the embedded broker's
"latest" offset gets wrong), never past it, in batch order, and then finishes; it commits
no offsets; an offsets file starts it where it says."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.intake import ExperienceIntake
from streamrft.consumers.replay import ReplayCursor, read_bounds
from streamrft.infra import admin, kafka
from streamrft.infra.bus import Counters, EventSender
from streamrft.schemas.codec import EXPERIENCE_GROUP
from streamrft.schemas.errors import ConfigError, ServiceError
from tests.harness.fuzz import FuzzMessage, inject
from tests.helpers.groups import make_group

pytestmark = pytest.mark.integration

N = 4
"""Groups per batch (the step's ``trainer.batch_size`` here)."""


def _records(groups) -> list[FuzzMessage]:
    return [
        FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers(), g.task_id.encode())
        for g in groups
    ]


def _batch(run: str, b: int, count: int = N) -> list:
    return [make_group(run, f"b{b}-t{i}", 0, batch=b) for i in range(count)]


async def _replay(cfg, cursor: ReplayCursor) -> tuple[list[list], Counters, ExperienceBuffer]:
    """Every batch the intake hands out until it finishes."""
    counters, buffer = Counters(), ExperienceBuffer(max_staleness=100)
    events = EventSender(cfg, "trainer", "trainer", counters)
    intake = ExperienceIntake(cfg, buffer, events, counters, vocab_size=64, replay=cursor)

    async def nothing() -> None:
        pass

    await events.start()
    await intake.start({})
    batches = []
    try:
        while True:
            got = await asyncio.wait_for(intake.collect(N, lambda: 0, asyncio.Event(), nothing), 60)
            if got is None:
                break
            batches.append(got)
        await intake.commit()  # a replay commits nothing: no group
    finally:
        await intake.stop()
        await events.stop()
    return batches, counters, buffer


def test_a_replay_reads_to_the_end_it_found_and_no_further(make_config):
    cfg = make_config(trainer={"batch_size": N})
    topics = cfg.topics()
    run = topics.run
    # batches 2, 0, 1 out of order, a copy of one group, a record that does not decode,
    # and two groups of batch 3 (fewer than a step): sent together, in multi-record batches
    recorded = _batch(run, 2) + _batch(run, 0) + _batch(run, 1) + _batch(run, 3, 2)
    copy = make_group(run, "b1-t0", 0, batch=1)
    messages = [*_records([*recorded, copy]), FuzzMessage(b"\xc1 junk", key=b"junk")]
    later = _batch(run, 4)

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        await inject(cfg, topics.experiences, messages)
        bounds = await read_bounds(cfg.kafka, topics.experiences, None)
        await inject(cfg, topics.experiences, _records(later))  # after the replay started
        return bounds, *(await _replay(cfg, ReplayCursor(bounds)))

    bounds, batches, counters, buffer = asyncio.run(scenario())
    assert bounds.records == len(messages)  # the end of each partition, not Tansu's "latest"
    assert [sorted({g.batch for g in b}) for b in batches] == [[0], [1], [2]]
    assert sorted(g.task_id for b in batches for g in b) == sorted(
        g.task_id for g in recorded if g.batch < 3
    )
    # consumed: every recorded group once (the copy is a duplicate), nothing published later
    assert counters["groups_consumed"] == len(recorded)
    assert counters["experiences_consumed"] == 4 * len(recorded)
    assert buffer.duplicates_dropped == 1 and counters["dead_letters"] == 1
    assert sorted(i.group.task_id for i in buffer.queue) == ["b3-t0", "b3-t1"]  # left over


def test_an_offsets_file_starts_the_replay_where_it_says(make_config):
    cfg = make_config(trainer={"batch_size": N})
    topics = cfg.topics()
    groups = _batch(topics.run, 0) + _batch(topics.run, 1)

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        placed = await inject(cfg, topics.experiences, _records(groups))
        # skip what batch 0 put on each partition: start after its last record there
        start = dict.fromkeys(range(cfg.kafka.partitions), 0)
        for (p, offset), g in zip(placed, groups, strict=True):
            if g.batch == 0:
                start[p] = max(start[p], offset + 1)
        bounds = await read_bounds(cfg.kafka, topics.experiences, start)
        with pytest.raises(ConfigError, match="no partition 9"):
            await read_bounds(cfg.kafka, topics.experiences, {**start, 9: 0})
        with pytest.raises(ConfigError, match="missing 0"):
            await read_bounds(cfg.kafka, topics.experiences, {1: 0, 2: 0, 3: 0})
        with pytest.raises(ConfigError, match="outside the records"):
            await read_bounds(cfg.kafka, topics.experiences, {**start, 0: 10_000})
        with pytest.raises(ServiceError, match="does not exist"):
            await read_bounds(cfg.kafka, topics.experiences + "-nope", None)
        return await _replay(cfg, ReplayCursor(bounds)), placed

    (batches, counters, _), placed = asyncio.run(scenario())
    # batch 1's groups that sit after batch 0's on their partition (key hashing decides)
    last0 = {}
    for (p, offset), g in zip(placed, groups, strict=True):
        if g.batch == 0:
            last0[p] = max(last0.get(p, -1), offset)
    after = [g for (p, o), g in zip(placed, groups, strict=True) if o > last0.get(p, -1)]
    assert all(g.batch == 1 for g in after)
    assert counters["groups_consumed"] == len(after)
    trained = sorted(g.task_id for b in batches for g in b)
    assert trained == (sorted(g.task_id for g in after) if len(after) == N else [])


def test_a_replay_leaves_the_runs_committed_offsets_alone(make_config):
    """The run's own trainer group has committed offsets; a replay of its stream reads
    every record and leaves them as they were."""
    cfg = make_config(trainer={"batch_size": N})
    topics = cfg.topics()
    group = f"{topics.prefix}.{topics.run}.trainer"

    async def committed() -> dict[int, int | None]:
        reader = kafka.experience_consumer(cfg.kafka, topics.experiences, group, "t-look")
        await kafka.start_client(reader, "look")
        try:
            tps = [TopicPartition(topics.experiences, p) for p in range(cfg.kafka.partitions)]
            return {tp.partition: await reader.committed(tp) for tp in tps}
        finally:
            await reader.stop()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        await inject(cfg, topics.experiences, _records(_batch(topics.run, 0)))
        live = kafka.experience_consumer(cfg.kafka, topics.experiences, group, "t-live")
        await kafka.start_client(live, "live")
        try:
            while len(live.assignment()) < cfg.kafka.partitions:  # joined the group
                await live.getmany(timeout_ms=200, max_records=1)
            await live.commit(dict.fromkeys(live.assignment(), 1))
        finally:
            await live.stop()
        before = await committed()
        bounds = await read_bounds(cfg.kafka, topics.experiences, None)
        batches, _, _ = await _replay(cfg, ReplayCursor(bounds))
        return before, batches, await committed()

    before, batches, after = asyncio.run(scenario())
    assert before == dict.fromkeys(range(4), 1)
    assert len(batches) == 1 and len(batches[0]) == N  # read from offset 0, not from 1
    assert after == before
