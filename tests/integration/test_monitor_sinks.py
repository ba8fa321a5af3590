"""The run monitor's sinks (``metrics.jsonl``, exporters): a failing or slow one never
stops the monitor, loses no other sink's events, and never holds up the event loop; the
samples it reads kept in the run folder's ``samples.jsonl``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamrft.app.watch.metric_sinks import SinkWorker
from streamrft.app.watch.metrics_log import MetricsLog, metrics_path, read_metrics
from streamrft.app.watch.monitor import RunMonitor
from streamrft.app.watch.samples_log import SamplesLog, read_samples, samples_path
from streamrft.infra import admin
from streamrft.infra.bus import EventSender
from streamrft.schemas.codec import METRICS, SAMPLE
from streamrft.schemas.events import MetricsEvent
from streamrft.schemas.samples import Sample, SamplePart

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


def test_the_monitor_keeps_the_newest_samples_of_each_explorer_in_the_run_folder(make_config):
    """The samples topic read by the run's monitor: ``samples.jsonl`` holds the newest
    ``keep`` of each explorer, in order, after the run (its broker gone or not)."""
    cfg = make_config()
    topics = cfg.topics()
    keep, steps = 5, 15

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        async with EventSender(cfg, "explorer-0", "explorer") as sender:
            for step in range(steps):
                for explorer in ("explorer-0", "explorer-1"):
                    sample = Sample(
                        experience_id=f"{explorer}-{step}#0",
                        task_id=f"add-{step}",
                        explorer=explorer,
                        explorer_step=step,
                        workflow="math",
                        model_version=step,
                        reward=step / steps,
                        parts=[SamplePart(role="prompt", text=f"{step}+1=")],
                        created_at=time.time(),
                    )
                    await sender.send(topics.samples, SAMPLE, sample, key=sample.task_id)
        samples = SinkWorker(SamplesLog(samples_path(cfg.run_dir), keep=keep), "samples file")
        monitor = RunMonitor(cfg, samples=samples)
        stop = asyncio.Event()
        stop.set()  # read what is there, then end once quiet
        await monitor.follow(stop)
        samples.close()

    asyncio.run(scenario())
    kept = read_samples(samples_path(cfg.run_dir))
    for explorer in ("explorer-0", "explorer-1"):
        mine = [s for s in kept if s.explorer == explorer]
        assert [s.explorer_step for s in mine] == list(range(steps - keep, steps)), explorer
    assert kept[-1].parts[0].text == f"{steps - 1}+1="
