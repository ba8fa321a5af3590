"""A dashboard feed lives through an outage of the run's broker (a broker of its own,
killed and restarted: the session's broker serves the other tests)."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from streamrft.app.watch.dashboard.feed import Feed
from streamrft.infra import admin, kafka
from streamrft.infra.config import Config, KafkaConfig, with_run_id
from streamrft.infra.local.services import LocalServices
from streamrft.schemas.codec import METRICS
from streamrft.schemas.events import MetricsEvent
from tests.helpers.waits import until

pytestmark = pytest.mark.integration


async def _publish(cfg: KafkaConfig, topic: str, run: str, steps: range) -> None:
    producer = kafka.event_producer(cfg, "test-dashboard-feed")
    await kafka.start_client(producer, "test-dashboard-feed")
    try:
        for step in steps:
            ev = MetricsEvent(
                run=run, component="trainer", step=step, version=step,
                values={"train/reward_mean": step / 10}, created_at=time.time(),
            )  # fmt: skip
            await producer.send_and_wait(topic, METRICS.encode(ev), headers=METRICS.headers())
    finally:
        await producer.stop()


def _steps(feed: Feed) -> list[int]:
    reward = json.loads(feed.payload())["view"]["curves"]["reward"]
    return [x for x, _ in reward.get("trainer", [])]


def test_the_feed_comes_back_after_a_broker_outage(tmp_path):
    with LocalServices(tmp_path / "services", object_store=False) as svc:
        bootstrap = svc.endpoints.bootstrap_servers
        base = Config()
        cfg = with_run_id(
            msgspec.structs.replace(
                base,
                run=msgspec.structs.replace(base.run, dir=str(tmp_path / "runs")),
                kafka=msgspec.structs.replace(base.kafka, bootstrap_servers=bootstrap),
            ),
            "outage",
        )
        topics = cfg.topics()

        async def scenario() -> None:
            await admin.ensure_topics(cfg.kafka, topics)
            await _publish(cfg.kafka, topics.metrics, "outage", range(3))
            feed = Feed(cfg, bootstrap, None)
            feed.start()
            try:
                await until(
                    lambda: _steps(feed) == [0, 1, 2] and feed.live, 60, "3 steps", every=0.1
                )
                assert feed.kind == "broker"
                await asyncio.to_thread(svc.kill, "broker")
                await until(
                    lambda: "gone" in feed.source and not feed.live, 60, "it gone", every=0.1
                )
                assert _steps(feed) == [0, 1, 2]  # what was read stays on the page
                await asyncio.to_thread(svc.restart, "broker")
                # a memory broker restarts empty: the run's producers create its topics again
                await admin.ensure_topics(cfg.kafka, topics)
                await _publish(cfg.kafka, topics.metrics, "outage", range(10, 13))
                await until(
                    lambda: 12 in _steps(feed), 90, "the steps after the restart", every=0.1
                )
                await until(lambda: feed.live, 30, "live again", every=0.1)
                assert feed.source.startswith(f"broker {bootstrap}")
                assert feed.task is not None and not feed.task.done()
            finally:
                await feed.stop()

        asyncio.run(scenario())
