"""Experience groups and dead letters through the real broker."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrft.infra import kafka
from streamrft.schemas import (
    DEAD_LETTER,
    EXPERIENCE_GROUP,
    Experience,
    ExperienceGroup,
    pack_f32,
    pack_i32,
    pack_u8,
)

pytestmark = pytest.mark.integration


def make_group(run: str, task: str, version: int, n: int = 4, rewards=None) -> ExperienceGroup:
    gid = f"{run}/{task}@0"
    rewards = rewards or [float(i % 2) for i in range(n)]
    exps = [
        Experience(
            id=f"{gid}#{i}",
            tokens=pack_i32([1, 5, 6, 7, 8 + i, 2]),
            prompt_length=4,
            logprobs=pack_f32([-0.5, -0.25]),
            action_mask=pack_u8([1, 1]),
            reward=rewards[i],
            model_version=version,
        )
        for i in range(n)
    ]
    return ExperienceGroup(
        id=gid,
        run=run,
        task_id=task,
        explorer="explorer-x",
        model_version=version,
        experiences=exps,
    )


async def _drain(consumer, want: int, timeout: float = 30.0):
    got = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < want and loop.time() < deadline:
        for _tp, records in (await consumer.getmany(timeout_ms=200)).items():
            got.extend(records)
    return got


def test_groups_publish_and_consume_whole(make_config):
    cfg = make_config()
    topics = cfg.topics()

    async def scenario():
        await kafka.ensure_topics(cfg.kafka, topics)
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
            records = await _drain(consumer, len(sent))
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
        await kafka.ensure_topics(cfg.kafka, topics)
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
        trainer._prepare_model()
        trainer.version = 0
        await trainer.bus.start()
        consumer = kafka.experience_consumer(
            cfg.kafka, topics.experiences, f"g-{topics.run}", "trainer"
        )
        await kafka.start_client(consumer, "consumer")
        try:
            groups = await asyncio.wait_for(trainer.collect(consumer), 60)
            values = await asyncio.to_thread(
                __import__("streamrft.consumers.grpo", fromlist=["grpo_step"]).grpo_step,
                trainer.model,
                trainer.optimizer,
                groups,
                cfg.trainer,
                trainer.tokenizer.pad_token_id,
                1.0,
            )
        finally:
            await consumer.stop()
            await trainer.bus.stop()
        reader = kafka.event_reader(cfg.kafka, [topics.dead_letters], "dl-reader")
        await kafka.start_client(reader, "dl reader")
        try:
            letters = await _drain(reader, 2)
        finally:
            await reader.stop()
        return groups, values, trainer, letters

    groups, values, trainer, letters = asyncio.run(scenario())
    assert sorted(g.task_id for g in groups) == ["ok-0", "ok-1"]
    assert torch.isfinite(torch.tensor(values["train/loss"]))
    assert trainer.bus.counters["dead_letters"] == 2
    decoded = [DEAD_LETTER.decode(r.value, r.headers) for r in letters]
    assert len(decoded) == 2
    junk = next(d for d in decoded if d.key == b"junk")
    assert junk.value == b"\xc1 not msgpack"  # kept whole
    assert junk.source_topic == cfg.topics().experiences and junk.offset == 0
    invalid = next(d for d in decoded if d.key != b"junk")
    assert "logprobs" in invalid.reason and invalid.offset == 1
    # the buffer moved past both bad records: a restart would not read them again
    assert trainer.buffer.resume_offsets()[(cfg.topics().experiences, 0)] == 4
