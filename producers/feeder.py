"""The task feeder: publishes a JSONL taskset to ``<ns>.tasks`` for ``total_epochs`` passes."""

from __future__ import annotations

import asyncio
import logging
import random

import msgspec

from streamrft.infra import kafka
from streamrft.infra.bus import EventBus, read_history
from streamrft.infra.config import Config
from streamrft.infra.retry import retrying
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
    history = await read_history(cfg, cfg.topics().status, STATUS, "feeder-resume")
    return max((ev.step for ev in history if ev.component == "feeder"), default=0)


async def feed(cfg: Config) -> int:
    """Publish every task of every epoch; returns how many were acknowledged.

    Tasks are spread round-robin over the partitions in each epoch's shuffled order (not
    by a hash of the task id): every partition then carries a uniform sample of the
    taskset, so an explorer that happens to read one partition ahead of the others still
    sees every kind of task, not the same quarter of them for many steps.
    """
    tasks = read_taskset(cfg.taskset.path, cfg.taskset)
    for t in tasks:
        check_workflow(t.workflow)
    topics = cfg.topics()
    bus = EventBus(cfg, "feeder", "feeder")
    producer = kafka.data_producer(cfg.kafka, "feeder")
    await bus.start()
    sent = 0
    try:
        await kafka.start_client(producer, "feeder producer")
        await bus.status(
            RunState.RUNNING, f"{len(tasks)} tasks x {cfg.taskset.total_epochs} epochs"
        )
        partitions = sorted(await producer.partitions_for(topics.tasks))
        first = await epochs_already_published(cfg)
        if first:
            log.info(
                "feeder: %d epochs were already published for this run; resuming after them", first
            )
        bus.step = first
        for epoch in range(first, cfg.taskset.total_epochs):
            order = epoch_order(len(tasks), epoch, cfg.run.seed, cfg.taskset.shuffle)

            async def publish_epoch(epoch=epoch, order=order, offset=sent) -> int:
                futures = []
                for n, i in enumerate(order):
                    task = msgspec.structs.replace(tasks[i], epoch=epoch)
                    futures.append(
                        await producer.send(
                            topics.tasks,
                            TASK.encode(task),
                            key=task.id.encode(),
                            headers=TASK.headers(),
                            partition=partitions[(offset + n) % len(partitions)],
                        )
                    )
                await asyncio.gather(*futures)
                return len(futures)

            # after a broker outage the whole epoch is sent again: explorers then see some
            # tasks twice, and the trainer keeps one group per (task, epoch)
            count = await retrying(
                f"feeder: publishing epoch {epoch}",
                publish_epoch,
                cfg.run.outage_timeout_s,
                lambda _exc: bus.count("publish_retries"),
            )
            sent += count
            bus.counters["tasks_published"] = (epoch + 1) * len(tasks)
            bus.step = epoch + 1
            await bus.status(detail=f"epoch {epoch + 1}/{cfg.taskset.total_epochs} published")
        await bus.status(RunState.STOPPED, f"done: {sent} tasks published by this feeder")
        log.info("feeder: %d tasks published", sent)
        return sent
    finally:
        await producer.stop()
        await bus.stop()


def main(cfg: Config) -> None:
    asyncio.run(feed(cfg))
