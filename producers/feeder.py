"""The task feeder: publishes a JSONL taskset to ``<ns>.tasks`` for ``total_epochs`` passes."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import msgspec

from streamrft.infra import kafka
from streamrft.infra.bus import Counters, EventSender, Position
from streamrft.infra.config import Config
from streamrft.infra.consume import read_history
from streamrft.infra.produce import OutRecord, send_all
from streamrft.infra.taskset import read_taskset
from streamrft.producers.workflows import check_workflow
from streamrft.schemas.codec import STATUS, TASK
from streamrft.schemas.events import RunState

log = logging.getLogger(__name__)


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 7919 + epoch).shuffle(order)
    return order


async def epochs_already_published(cfg: Config) -> int:
    """Epochs a previous feeder of this run published completely (0 for a fresh run).

    Read back from the feeder's own status events, so a restarted ``streamrft run
    --run-id ID`` does not publish the taskset a second time.
    """
    history = await read_history(cfg.kafka, cfg.topics().status, STATUS, "feeder-resume")
    return max((ev.step for ev in history if ev.component == "feeder"), default=0)


class Feeder:
    """Publishes every task of every epoch; its status step counts the epochs published.

    Tasks are spread round-robin over the partitions by their position in the run's task
    stream (not by a hash of the task id): every partition then carries a uniform sample
    of the taskset and an equal share of every batch, so N explorers holding the
    partitions share each batch's tasks evenly.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.topics = cfg.topics()
        self.tasks = read_taskset(cfg.taskset.path, cfg.taskset)
        for t in self.tasks:
            check_workflow(t.workflow)
        self.epochs_done = 0
        self.counters = Counters()
        self.events = EventSender(
            cfg, "feeder", "feeder", self.counters, lambda: Position(step=self.epochs_done)
        )
        self.producer: Any = None  # made in run(), inside the event loop

    async def run(self) -> int:
        """Publish what is left to publish; returns how many tasks were acknowledged."""
        cfg = self.cfg
        await self.events.start()
        sent = 0
        self.producer = kafka.data_producer(cfg.kafka, "feeder")
        try:
            await kafka.start_client(self.producer, "feeder producer")
            total = cfg.taskset.total_epochs
            await self.events.status(RunState.RUNNING, f"{len(self.tasks)} tasks x {total} epochs")
            partitions = sorted(await self.producer.partitions_for(self.topics.tasks))
            self.epochs_done = await epochs_already_published(cfg)
            if self.epochs_done:
                log.info("feeder: %d epochs already published; resuming", self.epochs_done)
            for epoch in range(self.epochs_done, total):
                sent += await self.publish_epoch(epoch, partitions)
                self.counters.set("tasks_published", (epoch + 1) * len(self.tasks))
                self.epochs_done = epoch + 1
                await self.events.status(detail=f"epoch {epoch + 1}/{total} published")
            await self.events.status(
                RunState.STOPPED, f"done: {sent} tasks published by this feeder"
            )
            log.info("feeder: %d tasks published", sent)
            return sent
        finally:
            await self.producer.stop()
            await self.events.stop()

    async def publish_epoch(self, epoch: int, partitions: list[int]) -> int:
        """One epoch, acks=all, each task stamped with its global batch index
        (:attr:`Task.batch`). After a broker outage the whole epoch is sent again, with the
        same stamps: explorers then see some tasks twice, and the trainer keeps one group
        per (task, epoch)."""
        order = epoch_order(len(self.tasks), epoch, self.cfg.run.seed, self.cfg.taskset.shuffle)
        first = epoch * len(self.tasks)  # position in the run's task stream
        per_batch = self.cfg.trainer.batch_size
        tasks = [
            msgspec.structs.replace(self.tasks[i], epoch=epoch, batch=(first + n) // per_batch)
            for n, i in enumerate(order)
        ]
        records = [
            OutRecord(
                self.topics.tasks,
                TASK.encode(task),
                task.id.encode(),
                TASK.headers(),
                partitions[(first + n) % len(partitions)],
            )
            for n, task in enumerate(tasks)
        ]
        return await send_all(
            self.producer,
            records,
            f"feeder: publishing epoch {epoch}",
            self.cfg.run.outage_timeout_s,
            lambda _exc: self.counters.add("publish_retries"),
        )


async def feed(cfg: Config) -> int:
    """Publish the run's taskset; returns how many tasks were acknowledged."""
    return await Feeder(cfg).run()


def main(cfg: Config) -> None:
    asyncio.run(feed(cfg))
