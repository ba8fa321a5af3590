"""Experience groups and dead letters through the real broker."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrft.infra import admin, kafka
from streamrft.infra.consume import Record, consume, read_topic
from streamrft.schemas import DEAD_LETTER, EXPERIENCE_GROUP
from tests.helpers.groups import make_group

pytestmark = pytest.mark.integration


async def _take(consumer, want: int) -> list[Record]:
    """``want`` raw records through the one consume path (or fewer, once the topic has been
    quiet for 20 s: a group's first join alone takes a few seconds)."""
    got: list[Record] = []
    await consume(consumer, None, lambda r: (got.append(r), len(got) < want)[1], until_quiet=100)
    return got


def test_groups_publish_and_consume_whole(make_config):
    cfg = make_config()
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        sent = [make_group(topics.run, f"task-{i}", version=i % 3) for i in range(20)]
        producer = kafka.data_producer(cfg.kafka, "test-producer")
        await kafka.start_client(producer, "producer")
        try:
            futs = [
                await producer.send(
                    topics.experiences,
                    EXPERIENCE_GROUP.encode(g),
                    key=g.task_id.encode(),
                    headers=EXPERIENCE_GROUP.headers(),
                )
                for g in sent
            ]
            await asyncio.gather(*futs)
        finally:
            await producer.stop()
        consumer = kafka.experience_consumer(
            cfg.kafka, topics.experiences, f"g-{topics.run}", "test-consumer"
        )
        await kafka.start_client(consumer, "consumer")
        try:
            records = await _take(consumer, len(sent))
        finally:
            await consumer.stop()
        return sent, records

    sent, records = asyncio.run(scenario())
    assert len(records) == len(sent)
    decoded = {g.id: g for g in (EXPERIENCE_GROUP.decode(r.value, r.headers) for r in records)}
    assert decoded == {g.id: g for g in sent}
    # the key keeps a task's group on one partition
    for r in records:
        assert r.key.decode() == EXPERIENCE_GROUP.decode(r.value).task_id


def test_trainer_dead_letters_malformed_and_keeps_going(make_config):
    """A malformed message and an invalid group go to dead letters; valid groups train."""
    from streamrft.consumers.trainer import Trainer
    from streamrft.producers.evaluation import GreedyEvaluator

    cfg = make_config(trainer={"batch_size": 2, "max_staleness": 5})
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        producer = kafka.data_producer(cfg.kafka, "test-producer")
        await kafka.start_client(producer, "producer")
        bad_group = make_group(topics.run, "bad", 0)
        bad_group.experiences[0].logprobs = b"\x00\x01\x02"  # wrong length
        try:
            await producer.send_and_wait(
                topics.experiences, b"\xc1 not msgpack", key=b"junk", partition=0
            )
            await producer.send_and_wait(
                topics.experiences, EXPERIENCE_GROUP.encode(bad_group), partition=0
            )
            for i in range(2):
                g = make_group(topics.run, f"ok-{i}", 0)
                await producer.send_and_wait(
                    topics.experiences,
                    EXPERIENCE_GROUP.encode(g),
                    headers=EXPERIENCE_GROUP.headers(),
                    partition=0,
                )
        finally:
            await producer.stop()
        trainer = Trainer(cfg, GreedyEvaluator(cfg))
        trainer.engine.prepare()
        await trainer.events.start()
        await trainer.intake.start({})

        async def nothing() -> None:
            pass

        try:
            collect = trainer.intake.collect(
                cfg.trainer.batch_size, lambda: 0, trainer.stop, nothing
            )
            groups = await asyncio.wait_for(collect, 60)
            values = await asyncio.to_thread(trainer.engine.train_step, groups, trainer.version)
        finally:
            await trainer.intake.stop()
            await trainer.events.stop()
        letters = await read_topic(cfg.kafka, topics.dead_letters, None, "dl-reader")
        return groups, values, trainer, letters

    groups, values, trainer, letters = asyncio.run(scenario())
    assert sorted(g.task_id for g in groups) == ["ok-0", "ok-1"]
    assert torch.isfinite(torch.tensor(values["train/loss"]))
    assert trainer.counters["dead_letters"] == 2
    decoded = [DEAD_LETTER.decode(r.value, r.headers) for r in letters]
    assert len(decoded) == 2
    junk = next(d for d in decoded if d.key == b"junk")
    assert junk.value == b"\xc1 not msgpack"  # kept whole
    assert junk.source_topic == cfg.topics().experiences and junk.offset == 0
    invalid = next(d for d in decoded if d.key != b"junk")
    assert "logprobs" in invalid.reason and invalid.offset == 1
    # the buffer moved past both bad records: a restart would not read them again
    assert trainer.buffer.resume_offsets()[(cfg.topics().experiences, 0)] == 4
