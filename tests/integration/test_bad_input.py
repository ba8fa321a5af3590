"""The bad-input drill: 1,000+ random and mutated messages into ``control`` and ``experiences``.

A live component reads them; afterwards every invalid message has exactly one dead letter
(same topic, partition and offset, with a reason), no valid message has one, and the
component still does its job with valid messages sent after the fuzz.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from streamrft.infra import kafka
from streamrft.infra.bus import EventBus
from streamrft.schemas import (
    DEAD_LETTER,
    EXPERIENCE_GROUP,
    DeadLetter,
    ModelVersionReady,
)
from tests.harness.fuzz import FuzzMessage, expected_valid, fuzz_messages, inject
from tests.integration.test_experience_flow import make_group

pytestmark = pytest.mark.integration

N_FUZZ = 1100


async def _wait(ready, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ready():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


async def _read_dead_letters(cfg, want: int, timeout: float = 30.0) -> list[DeadLetter]:
    topic = cfg.topics().dead_letters
    reader = kafka.event_reader(cfg.kafka, [topic], "dead-letter-reader")
    await kafka.start_client(reader, "dead-letter reader")
    letters: list[DeadLetter] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while len(letters) < want and loop.time() < deadline:
            for records in (await reader.getmany(timeout_ms=200)).values():
                letters.extend(DEAD_LETTER.decode(r.value, r.headers) for r in records)
        # nothing beyond what was expected arrives
        for records in (await reader.getmany(timeout_ms=500)).values():
            letters.extend(DEAD_LETTER.decode(r.value, r.headers) for r in records)
    finally:
        await reader.stop()
    return letters


def _check_accounting(
    topic: str,
    messages: list[FuzzMessage],
    offsets: list[tuple[int, int]],
    valid: list[bool],
    letters: list[DeadLetter],
    component: str,
) -> None:
    """Exactly one dead letter per invalid message, none for a valid one, each explained."""
    assert len(set(offsets)) == len(offsets)
    by_offset: dict[tuple[int, int], list[DeadLetter]] = {}
    for dl in letters:
        assert dl.source_topic == topic, dl.source_topic
        by_offset.setdefault((dl.partition, dl.offset), []).append(dl)
    invalid = {at for at, ok in zip(offsets, valid, strict=True) if not ok}
    assert set(by_offset) == invalid
    assert all(len(v) == 1 for v in by_offset.values())
    for msg, at in zip(messages, offsets, strict=True):
        if at not in invalid:
            continue
        dl = by_offset[at][0]
        assert dl.reason and dl.error_type == "SchemaError", (msg.mutation, dl.reason)
        assert dl.component == component
        assert dl.value == msg.value and dl.key == msg.key  # kept whole, replayable
    mutations = {m.mutation for m, ok in zip(messages, valid, strict=True) if not ok}
    assert {"random_bytes", "truncate", "bit_flip", "other_topic", "null"} <= mutations


def test_control_fuzz_every_bad_message_is_dead_lettered(make_config):
    cfg = make_config()
    topics = cfg.topics()
    messages = fuzz_messages("control", N_FUZZ, seed=41)
    valid = [expected_valid("control", m) for m in messages]
    assert 0 < sum(valid) < len(valid) - 500
    after = ModelVersionReady(
        version=123_456,
        method="object_store",
        uri="s3://bucket/after-the-fuzz/manifest.json",
        manifest_sha256="cd" * 32,
        bytes=10,
        step=1,
        created_at=time.time(),
    )

    async def scenario():
        await kafka.ensure_topics(cfg.kafka, topics)
        bus = EventBus(cfg, "fuzz-target", "explorer")
        sender = EventBus(cfg, "fuzz-sender", "trainer")
        await bus.start(listen_control=True)
        await sender.start()
        try:
            offsets = await inject(cfg, topics.control, messages)
            await sender.control(after)
            # the reader lived through the fuzz: the valid event sent after it arrives
            await _wait(lambda: bus.versions.get(after.version) == after, 60, "the version")
            want = valid.count(False)
            await _wait(lambda: bus.counters.get("dead_letters", 0) >= want, 60, "dead letters")
            assert bus._control_task is not None and not bus._control_task.done()
        finally:
            await sender.stop()
            await bus.stop()
        return offsets, await _read_dead_letters(cfg, want), bus.counters["dead_letters"]

    offsets, letters, counted = asyncio.run(scenario())
    assert counted == valid.count(False)
    _check_accounting(topics.control, messages, offsets, valid, letters, "fuzz-target")


def test_experience_fuzz_trainer_dead_letters_and_keeps_training(make_config):
    from streamrft.consumers.grpo import grpo_step
    from streamrft.consumers.trainer import Trainer
    from streamrft.producers.evaluation import GreedyEvaluator

    cfg = make_config(trainer={"batch_size": 1, "max_staleness": 5, "idle_timeout_s": 30.0})
    topics = cfg.topics()
    trainer = Trainer(cfg, GreedyEvaluator(cfg))
    trainer._prepare_model()
    trainer.version = 0
    vocab = trainer.model.get_input_embeddings().num_embeddings
    # many distinct seeds, so that most mutated groups that still decode carry new ids and
    # are trained on rather than dropped as duplicates
    samples = [EXPERIENCE_GROUP.encode(make_group(topics.run, f"fuzz-{i}", 0)) for i in range(400)]
    messages = fuzz_messages("experiences", N_FUZZ, seed=42, samples=samples)
    valid = [expected_valid("experiences", m, vocab_size=vocab) for m in messages]
    assert 0 < sum(valid) < len(valid) - 500
    after = [make_group(topics.run, f"after-{i}", 0) for i in range(2)]
    after_msgs = [
        FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers(), g.task_id.encode())
        for g in after
    ]

    async def scenario():
        await kafka.ensure_topics(cfg.kafka, topics)
        await trainer.bus.start()
        consumer = kafka.experience_consumer(
            cfg.kafka, topics.experiences, f"g-{topics.run}", "trainer"
        )
        await kafka.start_client(consumer, "trainer consumer")
        losses, trained = [], set()
        try:
            offsets = await inject(cfg, topics.experiences, messages)
            await inject(cfg, topics.experiences, after_msgs)
            want = valid.count(False)
            while not (
                {"after-0", "after-1"} <= trained
                and trainer.bus.counters.get("dead_letters", 0) >= want
                and len(trainer.buffer) == 0
            ):
                groups = await asyncio.wait_for(trainer.collect(consumer), 60)
                assert groups is not None, "the trainer went idle before the end"
                values = await asyncio.to_thread(
                    grpo_step,
                    trainer.model,
                    trainer.optimizer,
                    groups,
                    cfg.trainer,
                    trainer.tokenizer.pad_token_id,
                    1.0,
                )
                losses.append(values["train/loss"])
                trained.update(g.task_id for g in groups)
        finally:
            await consumer.stop()
            await trainer.bus.stop()
        return offsets, losses, await _read_dead_letters(cfg, want)

    offsets, losses, letters = asyncio.run(scenario())
    assert trainer.bus.counters["dead_letters"] == valid.count(False)
    _check_accounting(topics.experiences, messages, offsets, valid, letters, "trainer")
    # the mutated groups that were valid trained without a NaN; the model is still sound
    assert len(losses) > 80
    assert all(math.isfinite(x) for x in losses), losses
    assert all(bool(p.isfinite().all()) for p in trainer.model.parameters())
    # the consumer read past every fuzzed record
    ends: dict[int, int] = {}
    for p, o in offsets:
        ends[p] = max(ends.get(p, -1), o + 1)
    for p, end in ends.items():
        assert trainer.buffer.next_offsets[(topics.experiences, p)] >= end
