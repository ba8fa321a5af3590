"""The run monitor's sinks (``metrics.jsonl``, exporters): a failing or slow one never
stops the monitor, loses no other sink's events, and never holds up the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamrft.app.watch.metric_sinks import SinkWorker
from streamrft.app.watch.metrics_log import MetricsLog, metrics_path, read_metrics
from streamrft.app.watch.monitor import RunMonitor
from streamrft.infra import admin
from streamrft.infra.bus import EventSender
from streamrft.schemas.codec import METRICS
from streamrft.schemas.events import MetricsEvent

pytestmark = pytest.mark.integration


class Failing:
    """An exporter whose second write raises (a full disk, a server gone)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self.closed = 0

    def write(self, ev: MetricsEvent) -> None:
        if len(self.written) == 1:
            raise OSError("disk full")
        self.written.append(ev.step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


class Slow:
    """An exporter whose flush takes a while (a remote tracking server)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.release = threading.Event()
        self.flushes_done = 0

    def write(self, ev: MetricsEvent) -> None:
        self.steps.append(ev.step)

    def flush(self) -> None:
        self.release.wait(120)
        self.flushes_done += 1

    def close(self) -> None:
        pass


def test_a_failing_exporter_is_dropped_and_the_monitor_gets_everything(make_config, caplog):
    cfg = make_config()
    topics = cfg.topics()
    steps = 12

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        async with EventSender(cfg, "trainer", "trainer") as sender:
            for step in range(1, steps + 1):
                ev = MetricsEvent(
                    run=topics.run,
                    component="trainer",
                    step=step,
                    version=step,
                    values={"train/reward_mean": step / 100},
                    created_at=time.time(),
                )
                await sender.send(topics.metrics, METRICS, ev, key=topics.run)
        failing, slow = Failing(), Slow()
        sinks = [
            SinkWorker(MetricsLog(metrics_path(cfg.run_dir)), "metrics file"),
            SinkWorker(failing, "exporter failing"),
            SinkWorker(slow, "exporter slow"),
        ]
        monitor = RunMonitor(cfg, sinks=sinks)
        stop = asyncio.Event()
        stop.set()  # read what is there, then end once quiet
        await monitor.follow(stop)
        flushes_when_done = slow.flushes_done
        slow.release.set()
        for sink in sinks:
            sink.close()
        return monitor, failing, slow, sinks, flushes_when_done

    monitor, failing, slow, sinks, flushes_when_done = asyncio.run(scenario())
    # the monitor saw every step although one sink failed, and finished while the slow
    # sink was still stuck in its first flush: the loop never waited on it
    assert list(monitor.train_reward) == [s / 100 for s in range(1, steps + 1)]
    assert flushes_when_done == 0 and slow.flushes_done >= 1
    assert [e.step for e in read_metrics(metrics_path(cfg.run_dir))] == list(range(1, steps + 1))
    assert slow.steps == list(range(1, steps + 1))
    # the failing one wrote its first event, was closed once, then got nothing more
    assert failing.written == [1] and failing.closed == 1
    assert sinks[1].failed == "OSError: disk full" and sinks[0].failed is None
    assert "exporter failing failed (OSError: disk full)" in caplog.text
