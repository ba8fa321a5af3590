"""The task feeder: publishes the taskset to ``<ns>.tasks`` for ``total_epochs`` epochs.

When it starts it reads the taskset once into a :class:`TaskBook` (``taskset.path``, or
every one of ``taskset.sources``; every row checked, prompts longer than
``taskset.max_prompt_tokens`` left out and reported), kept in a file of its own under
``<run dir>/feeder/``, not in memory; each epoch's order
(:mod:`streamrft.producers.task_mix`) is then read from it chunk by chunk.

Its progress is kept durably in ``<run dir>/feeder/progress.json`` (the epoch, and how many
of its tasks were acknowledged), written after every chunk of :data:`FEED_CHUNK` tasks, so
that a restarted feeder goes on from there: never publishing an epoch again, whatever the
retention of the status topic (its statuses are read too, for a feeder on a new folder).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from streamrft.infra import kafka
from streamrft.infra.bus import Counters, EventSender, Position
from streamrft.infra.config import Config
from streamrft.infra.consume import ever_held_records, read_history
from streamrft.infra.durable import replace_durably
from streamrft.infra.produce import OutRecord, send_all
from streamrft.producers.task_book import TaskBook, check_shares
from streamrft.producers.task_mix import epoch_order, mixed_epoch, shares, split_item
from streamrft.schemas.codec import STATUS, TASK
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.events import RunState
from streamrft.schemas.experience import Task

log = logging.getLogger(__name__)

FEED_CHUNK = 1000
"""Tasks sent (and acknowledged) at once: what is held in memory as records, what is sent
again after an outage, and how often the progress file is written."""


async def epochs_already_published(cfg: Config) -> int:
    """Epochs a previous feeder of this run reported published completely in its status
    events (0 for a fresh run, or once they have expired under the topic's retention)."""
    history = await read_history(cfg.kafka, cfg.topics().status, STATUS, "feeder-resume")
    return max((ev.step for ev in history if ev.component == "feeder"), default=0)


def progress_path(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "feeder" / "progress.json"


def load_progress(path: Path, tasks: int, rows: list[int]) -> tuple[int, int]:
    """``(epoch, tasks of it acknowledged)`` from the progress file; (0, 0) when there is
    none. A file that cannot be read, or written for an epoch of another size or sources
    of other sizes (``rows``), is a :class:`ConfigError` (publishing again from the start
    would train every task twice)."""
    try:
        data = json.loads(path.read_text())
        epoch, sent, size = int(data["epoch"]), int(data["sent"]), int(data["tasks"])
        kept_rows = [int(n) for n in data.get("rows", rows)]  # older files have no rows
    except FileNotFoundError:
        return 0, 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path}: the feeder's progress cannot be read ({exc}); remove the file to "
            "publish the whole taskset again"
        ) from exc
    if size != tasks or kept_rows != rows or not 0 <= sent < max(tasks, 1) or epoch < 0:
        raise ConfigError(
            f"{path}: progress for a taskset of {size} tasks an epoch from sources of "
            f"{kept_rows} rows (epoch {epoch}, {sent} sent); this one has {tasks} from "
            f"{rows}: a resumed run must keep its taskset"
        )
    return epoch, sent


def save_progress(path: Path, epoch: int, sent: int, tasks: int, rows: list[int]) -> None:
    """Write the progress file atomically and durably."""
    record = {"epoch": epoch, "sent": sent, "tasks": tasks, "rows": rows}
    replace_durably(path, json.dumps(record).encode())


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
        self.book = TaskBook(cfg, Path(cfg.run_dir) / "feeder")
        self.rows = len(self.book.file)
        t = cfg.taskset
        self.epoch_size = (t.epoch_tasks or self.rows) if t.sources else self.rows
        """Tasks per epoch: every row once, or ``taskset.epoch_tasks`` of a mix."""
        if t.sources:
            try:
                check_shares(t, self.book, shares([s.weight for s in t.sources], self.epoch_size))
            except ConfigError:
                self.book.close()
                raise
        self.epochs_done = 0
        self.counters = Counters()
        self.events = EventSender(
            cfg, "feeder", "feeder", self.counters, lambda: Position(step=self.epochs_done)
        )
        self.producer: Any = None  # made in run(), inside the event loop

    async def run(self) -> int:
        """Publish what is left to publish; returns how many tasks were acknowledged."""
        cfg = self.cfg
        sent = 0
        try:
            await self.events.start()
            self.producer = kafka.data_producer(cfg.kafka, "feeder")
            await kafka.start_client(self.producer, "feeder producer")
            total = cfg.taskset.total_epochs
            self.counters.set("prompts_too_long", self.book.too_long)
            await self.events.status(RunState.RUNNING, self.describe())
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
            self.book.close()
            if self.producer is not None:
                await self.producer.stop()
            await self.events.stop()

    def describe(self) -> str:
        """What the feeder publishes, for its first status and the log."""
        total = self.cfg.taskset.total_epochs
        text = f"{self.epoch_size} tasks x {total} epochs"
        if self.cfg.taskset.sources:
            parts = ", ".join(
                f"{s.label} {n} rows weight {s.weight:g}"
                for s, n in zip(self.cfg.taskset.sources, self.book.sizes, strict=True)
            )
            text += f" mixed from {parts}"
        if self.book.too_long:
            text += (
                f"; {self.book.too_long} tasks left out with prompts over "
                f"{self.cfg.taskset.max_prompt_tokens} tokens"
            )
        log.info("feeder: %s", text)
        return text

    def epoch_tasks(self, epoch: int) -> list[Task]:
        """The tasks of epoch ``epoch`` in the order they are published."""
        plan, task_of = self._plan(epoch)
        return [task_of(int(item)) for item in plan]

    def _plan(self, epoch: int) -> tuple[Sequence[int] | np.ndarray, Callable[[int], Task]]:
        """Epoch ``epoch``'s items in order, and the task of an item."""
        t = self.cfg.taskset
        if not t.sources:
            return epoch_order(
                self.rows, epoch, self.cfg.run.seed, t.shuffle
            ), self.book.file.__getitem__
        weights = [s.weight for s in t.sources]
        plan = mixed_epoch(
            self.book.sizes, weights, self.epoch_size, epoch, self.cfg.run.seed, t.shuffle
        )
        return plan, self._mixed_task

    def _mixed_task(self, item: int) -> Task:
        row, repeat = split_item(item, self.rows)
        task = self.book.file[row]
        return msgspec.structs.replace(task, id=f"{task.id}#{repeat}") if repeat else task

    async def resume_at(self) -> tuple[int, int]:
        """Where a previous feeder of this run stopped: its progress file, or its statuses
        (whole epochs only), whichever is further."""
        n = self.epoch_size
        kept = load_progress(progress_path(self.cfg), n, self.book.sizes)
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
        n = self.epoch_size
        first = epoch * n  # position in the run's task stream
        per_batch = self.cfg.trainer.batch_size
        plan, task_of = await asyncio.to_thread(self._plan, epoch)  # a mix's: seconds at 1M
        sent = 0
        for lo in range(start, n, FEED_CHUNK):
            records = []
            for k in range(lo, min(lo + FEED_CHUNK, n)):
                task = msgspec.structs.replace(
                    task_of(int(plan[k])), epoch=epoch, batch=(first + k) // per_batch
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
            await asyncio.to_thread(save_progress, progress_path(self.cfg), *at, n, self.book.sizes)
            self.counters.set("tasks_published", first + done)
        return sent


async def feed(cfg: Config) -> int:
    """Publish the run's taskset; returns how many tasks were acknowledged."""
    return await Feeder(cfg).run()


def main(cfg: Config) -> None:
    asyncio.run(feed(cfg))
