"""Explorers sharing the tasks topic through one consumer group, on the real broker.

Partitions move to a member that joins and back when it leaves. A member that stops
leaves the group explicitly, also at generation 0 (where aiokafka alone would not), so
its partitions move on before its session could have timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from streamrft.infra import admin, kafka

pytestmark = pytest.mark.integration

SESSION_MS = 10_000  # wide enough apart from the broker's join wait (half of it) to tell


async def _member(cfg, name: str) -> tuple[kafka.TaskConsumer, asyncio.Task]:
    """A started member that keeps polling, as an explorer does between steps."""
    topics = cfg.topics()
    member = kafka.task_consumer(cfg.kafka, topics.tasks, topics.explorers_group, name)
    await member.start()

    async def poll() -> None:
        while True:
            await member.getmany(timeout_ms=100)

    return member, asyncio.create_task(poll())


async def _stop(member: kafka.TaskConsumer, poller: asyncio.Task) -> None:
    poller.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await poller
    await member.stop()


async def _settled(members: list[kafka.TaskConsumer], timeout: float = 30) -> None:
    """Wait until every member holds an assignment of one and the same generation."""

    async def settle() -> None:
        while min(m.generation for m in members) < 0 or len({m.generation for m in members}) > 1:
            behind = min(members, key=lambda m: m.generation)
            behind.assigned.clear()
            await behind.assigned.wait()

    await asyncio.wait_for(settle(), timeout)


def _expired_by(stopped_at: float, cfg) -> float:
    """Earliest time the broker could evict a member that stopped at ``stopped_at`` without
    leaving: its last heartbeat plus the session timeout."""
    return stopped_at - kafka.heartbeat_ms(cfg.kafka) / 1000 + cfg.kafka.session_timeout_ms / 1000


def test_partitions_split_on_join_and_return_on_leave(make_config):
    cfg = make_config(kafka={"partitions": 4, "session_timeout_ms": SESSION_MS})

    async def scenario() -> None:
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        first, first_poll = await _member(cfg, "explorer-0")
        second = second_poll = None
        try:
            await asyncio.wait_for(first.assigned.wait(), 30)
            assert first.partitions == (0, 1, 2, 3)

            first.assigned.clear()
            second, second_poll = await _member(cfg, "explorer-1")
            await asyncio.wait_for(second.assigned.wait(), 30)
            await _settled([first, second])
            assert len(first.partitions) == len(second.partitions) == 2
            assert set(first.partitions) | set(second.partitions) == {0, 1, 2, 3}

            first.assigned.clear()
            loop = asyncio.get_running_loop()
            stopped_at = loop.time()
            await _stop(second, second_poll)
            await second.stop()  # safe twice
            second = None
            await asyncio.wait_for(first.assigned.wait(), 30)
            regained_at = loop.time()
            assert first.partitions == (0, 1, 2, 3)
            # the broker moved them because the member left, not because its session expired
            assert regained_at < _expired_by(stopped_at, cfg), regained_at - stopped_at
            assert first.rebalances == 3
        finally:
            if second is not None:
                await _stop(second, second_poll)
            await _stop(first, first_poll)

    asyncio.run(scenario())


def test_a_member_leaving_at_generation_zero_frees_its_partitions_at_once(make_config):
    """The embedded broker numbers a group's first generation 0; aiokafka sends no
    LeaveGroup then, and the next member would wait for the session to time out."""
    cfg = make_config(kafka={"partitions": 2, "session_timeout_ms": SESSION_MS})

    async def scenario() -> None:
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        first, first_poll = await _member(cfg, "explorer-0")
        await asyncio.wait_for(first.assigned.wait(), 30)
        first_generation = first.generation
        loop = asyncio.get_running_loop()
        stopped_at = loop.time()
        await _stop(first, first_poll)

        restarted, restarted_poll = await _member(cfg, "explorer-0")
        try:
            await asyncio.wait_for(restarted.assigned.wait(), 30)
            assigned_at = loop.time()
            assert restarted.partitions == (0, 1)
            assert restarted.generation > first_generation
            assert assigned_at < _expired_by(stopped_at, cfg), assigned_at - stopped_at
        finally:
            await _stop(restarted, restarted_poll)

    asyncio.run(scenario())


def test_a_member_without_a_partition_says_it_idles(make_config, caplog):
    cfg = make_config(kafka={"partitions": 1})

    async def scenario() -> tuple[tuple[int, ...], ...]:
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        members = [await _member(cfg, f"explorer-{i}") for i in range(2)]
        try:
            await _settled([m for m, _ in members])
            return tuple(sorted(m.partitions for m, _ in members))
        finally:
            for member, poller in members:
                await _stop(member, poller)

    with caplog.at_level(logging.INFO, logger="streamrft.infra.kafka"):
        assert asyncio.run(scenario()) == ((), (0,))
    assert "holds no tasks partition" in caplog.text and "it idles" in caplog.text
