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

from streamrft.infra import admin
from streamrft.infra.bus import ControlView, EventSender
from streamrft.infra.consume import read_history
from streamrft.schemas import (
    DEAD_LETTER,
    EXPERIENCE_GROUP,
    DeadLetter,
    ModelVersionReady,
)
from tests.harness.fuzz import FuzzMessage, expected_valid, fuzz_messages, inject
from tests.helpers.groups import make_group
from tests.helpers.waits import until

pytestmark = pytest.mark.integration

N_FUZZ = 1100


async def _read_dead_letters(cfg) -> list[DeadLetter]:
    """Every dead letter of the run (the senders were stopped: all of them are there)."""
    return await read_history(cfg.kafka, cfg.topics().dead_letters, DEAD_LETTER, "dl-reader")


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
        await admin.ensure_topics(cfg.kafka, topics)
        target = EventSender(cfg, "fuzz-target", "explorer")
        view = ControlView(cfg, "fuzz-target", target.dead_letter)
        sender = EventSender(cfg, "fuzz-sender", "trainer")
        await target.start()
        await view.start()
        await sender.start()
        try:
            offsets = await inject(cfg, topics.control, messages)
            await sender.control(after)
            # the reader lived through the fuzz: the valid event sent after it arrives
            await until(lambda: view.versions.get(after.version) == after, 60, "the version")
            want = valid.count(False)
            await until(lambda: target.counters.get("dead_letters") >= want, 60, "dead letters")
            view.check()  # raises if the reader failed
            assert view._task is not None and not view._task.done()
        finally:
            await sender.stop()
            await view.stop()
            await target.stop()
        return offsets, await _read_dead_letters(cfg), target.counters["dead_letters"]

    offsets, letters, counted = asyncio.run(scenario())
    assert counted == valid.count(False)
    _check_accounting(topics.control, messages, offsets, valid, letters, "fuzz-target")


async def _nothing() -> None:
    pass


def test_experience_fuzz_trainer_dead_letters_and_keeps_training(make_config):
    from streamrft.consumers.trainer import Trainer
    from streamrft.producers.evaluation import GreedyEvaluator

    cfg = make_config(trainer={"batch_size": 1, "max_staleness": 5, "idle_timeout_s": 30.0})
    topics = cfg.topics()
    trainer = Trainer(cfg, GreedyEvaluator(cfg))
    trainer.engine.prepare()
    vocab = trainer.engine.vocab_size
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
        await admin.ensure_topics(cfg.kafka, topics)
        await trainer.events.start()
        await trainer.intake.start({})
        losses, trained = [], set()
        try:
            offsets = await inject(cfg, topics.experiences, messages)
            await inject(cfg, topics.experiences, after_msgs)
            want = valid.count(False)
            while not (
                {"after-0", "after-1"} <= trained
                and trainer.counters.get("dead_letters") >= want
                and len(trainer.buffer) == 0
            ):
                collect = trainer.intake.collect(1, lambda: 0, trainer.stop, _nothing)
                groups = await asyncio.wait_for(collect, 60)
                assert groups is not None, "the trainer went idle before the end"
                values = await asyncio.to_thread(trainer.engine.train_step, groups, trainer.version)
                losses.append(values["train/loss"])
                trained.update(g.task_id for g in groups)
        finally:
            await trainer.intake.stop()
            await trainer.events.stop()
        return offsets, losses, await _read_dead_letters(cfg)

    offsets, losses, letters = asyncio.run(scenario())
    assert trainer.counters["dead_letters"] == valid.count(False)
    _check_accounting(topics.experiences, messages, offsets, valid, letters, "trainer")
    # the mutated groups that were valid trained without a NaN; the model is still sound
    assert len(losses) > 80
    assert all(math.isfinite(x) for x in losses), losses
    assert all(bool(p.isfinite().all()) for p in trainer.engine.model.parameters())
    # the consumer read past every fuzzed record
    ends: dict[int, int] = {}
    for p, o in offsets:
        ends[p] = max(ends.get(p, -1), o + 1)
    for p, end in ends.items():
        assert trainer.buffer.next_offsets[(topics.experiences, p)] >= end
