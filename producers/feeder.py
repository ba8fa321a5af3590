"""The task feeder: publishes a JSONL taskset to ``<ns>.tasks`` for ``total_epochs`` passes.

Its progress is kept durably in ``<run dir>/feeder/progress.json`` (the epoch, and how many
of its tasks were acknowledged), written after every chunk of :data:`FEED_CHUNK` tasks, so
that a restarted feeder goes on from there: never publishing an epoch again, whatever the
retention of the status topic (its statuses are read too, for a feeder on a new folder).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path
from typing import Any

import msgspec

from streamrft.infra import kafka
from streamrft.infra.bus import Counters, EventSender, Position
from streamrft.infra.config import Config
from streamrft.infra.consume import ever_held_records, read_history
from streamrft.infra.durable import replace_durably
from streamrft.infra.produce import OutRecord, send_all
from streamrft.infra.taskset import read_taskset
from streamrft.producers.workflows import check_workflow
from streamrft.schemas.codec import STATUS, TASK
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.events import RunState

log = logging.getLogger(__name__)

FEED_CHUNK = 1000
"""Tasks sent (and acknowledged) at once: what is held in memory as records, what is sent
again after an outage, and how often the progress file is written."""


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 7919 + epoch).shuffle(order)
    return order


async def epochs_already_published(cfg: Config) -> int:
    """Epochs a previous feeder of this run reported published completely in its status
    events (0 for a fresh run, or once they have expired under the topic's retention)."""
    history = await read_history(cfg.kafka, cfg.topics().status, STATUS, "feeder-resume")
    return max((ev.step for ev in history if ev.component == "feeder"), default=0)


def progress_path(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "feeder" / "progress.json"


def load_progress(path: Path, tasks: int) -> tuple[int, int]:
    """``(epoch, tasks of it acknowledged)`` from the progress file; (0, 0) when there is
    none. A file that cannot be read is a :class:`ConfigError` (publishing again from the
    start would train every task twice)."""
    try:
        data = json.loads(path.read_text())
        epoch, sent, size = int(data["epoch"]), int(data["sent"]), int(data["tasks"])
    except FileNotFoundError:
        return 0, 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path}: the feeder's progress cannot be read ({exc}); remove the file to "
            "publish the whole taskset again"
        ) from exc
    if size != tasks or not 0 <= sent < max(tasks, 1) or epoch < 0:
        raise ConfigError(
            f"{path}: progress for a taskset of {size} tasks (epoch {epoch}, {sent} sent); "
            f"this one has {tasks}: a resumed run must keep its taskset"
        )
    return epoch, sent


def save_progress(path: Path, epoch: int, sent: int, tasks: int) -> None:
    """Write the progress file atomically and durably."""
    replace_durably(path, json.dumps({"epoch": epoch, "sent": sent, "tasks": tasks}).encode())


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
            epoch, start = await self.resume_at()
            self.epochs_done = epoch
            for epoch in range(self.epochs_done, total):
                sent += await self.publish_epoch(epoch, partitions, start)
                start = 0
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

    async def resume_at(self) -> tuple[int, int]:
        """Where a previous feeder of this run stopped: its progress file, or its statuses
        (whole epochs only), whichever is further."""
        n = len(self.tasks)
        kept = load_progress(progress_path(self.cfg), n)
        if kept != (0, 0) and not await ever_held_records(
            self.cfg.kafka, self.topics.tasks, "feeder"
        ):
            log.warning(
                "feeder: %s says epoch %d, task %d, but the tasks topic never held a record "
                "(a new broker: an embedded one on memory storage starts empty); "
                "publishing from the start",
                progress_path(self.cfg),
                *kept,
            )
            kept = (0, 0)
        at = max(kept, (await epochs_already_published(self.cfg), 0))
        if at != (0, 0):
            log.info("feeder: resuming at epoch %d, task %d of %d", at[0], at[1], n)
            self.counters.set("tasks_published", at[0] * n + at[1])
        return at

    async def publish_epoch(self, epoch: int, partitions: list[int], start: int = 0) -> int:
        """One epoch from its ``start``-th task, acks=all, in chunks of :data:`FEED_CHUNK`
        (the progress file written after each), each task stamped with its global batch
        index (:attr:`Task.batch`). After a broker outage the chunk is sent again, with the
        same stamps: explorers then see some tasks twice, and the trainer keeps one group
        per (task, epoch)."""
        n = len(self.tasks)
        order = epoch_order(n, epoch, self.cfg.run.seed, self.cfg.taskset.shuffle)
        first = epoch * n  # position in the run's task stream
        per_batch = self.cfg.trainer.batch_size
        sent = 0
        for lo in range(start, n, FEED_CHUNK):
            records = []
            for k in range(lo, min(lo + FEED_CHUNK, n)):
                task = msgspec.structs.replace(
                    self.tasks[order[k]], epoch=epoch, batch=(first + k) // per_batch
                )
                part = partitions[(first + k) % len(partitions)]
                records.append(
                    OutRecord(
                        self.topics.tasks, TASK.encode(task), task.id.encode(), TASK.headers(), part
                    )
                )
            sent += await send_all(
                self.producer,
                records,
                f"feeder: publishing epoch {epoch}, tasks {lo}-{lo + len(records) - 1}",
                self.cfg.run.outage_timeout_s,
                lambda _exc: self.counters.add("publish_retries"),
            )
            done = lo + len(records)
            at = (epoch + 1, 0) if done == n else (epoch, done)
            await asyncio.to_thread(save_progress, progress_path(self.cfg), *at, n)
            self.counters.set("tasks_published", first + done)
        return sent


async def feed(cfg: Config) -> int:
    """Publish the run's taskset; returns how many tasks were acknowledged."""
    return await Feeder(cfg).run()


def main(cfg: Config) -> None:
    asyncio.run(feed(cfg))
