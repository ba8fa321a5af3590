"""One watched run's events, folded into its :class:`~.view.RunView` as they arrive.

A feed reads the run's event topics from the beginning and follows them
(``run_events.read_events``) on the run's broker (``run_events.find_broker``). When no
broker holds the run's topics (the embedded broker of a finished run stopped with it), it
reads the run folder's ``metrics.jsonl`` instead, and again as the file grows. A broker
that goes away while followed (the run ended) leaves the view as read, marked as no longer
live. Listeners wait on :meth:`Feed.changed`; :meth:`Feed.payload` is what they send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import msgspec

from streamrft.infra import admin
from streamrft.infra.app import run_events
from streamrft.infra.app.dashboard.view import RunView
from streamrft.infra.app.metrics_log import decode_line, metrics_path
from streamrft.infra.config import Config
from streamrft.infra.consume import Record
from streamrft.schemas.errors import StreamRFTError

log = logging.getLogger(__name__)

KINDS = ("metrics", "status", "control", "dead_letters")
RETRY_S = 2.0
"""How often a feed with nothing to read looks again for the run's broker or file."""
FILE_POLL_S = 1.0
"""How often a followed ``metrics.jsonl`` is checked for new lines."""
GONE_CHECKS = 2
"""A followed broker that refuses this many checks in a row (``RETRY_S`` apart) is gone."""
LIST_S = 5.0
"""How long listing a broker's topics may take."""
DRAIN_S = 10.0
"""How long the reader of a gone broker may take to finish before it is cancelled."""


async def topic_names(broker: run_events.Broker) -> list[str] | None:
    """The topics on ``broker``; None when it does not answer within :data:`LIST_S` (a
    broker that just stopped would be retried for much longer)."""
    try:
        return await asyncio.wait_for(admin.list_topics(broker.kafka), LIST_S)
    except (StreamRFTError, asyncio.TimeoutError) as exc:
        log.info("dashboard: listing the topics of %s failed: %r", broker.source, exc)
        return None


class Feed:
    """The events of run ``cfg.run.id``; see the module docstring."""

    def __init__(self, cfg: Config, bootstrap: str | None, infra_dir: Path | None) -> None:
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.infra_dir = infra_dir
        self.view = RunView(run=str(cfg.run.id))
        self.source = "looking for the run's broker or metrics.jsonl"
        self.live = False
        self.undecodable = 0
        self.seq = 0
        """Bumped at every change; listeners compare it with what they sent."""
        self._tick = asyncio.Event()
        self._cached: tuple[int, bytes] = (-1, b"")
        self.task: asyncio.Task[None] | None = None

    # -- listeners -----------------------------------------------------------------------------
    def changed(self) -> asyncio.Event:
        """An event set at the next change (take it, then compare :attr:`seq`)."""
        return self._tick

    def _bump(self) -> None:
        self.seq += 1
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    def payload(self) -> bytes:
        """The page's data as JSON: the view's snapshot, where it comes from, the time."""
        seq, view = self._cached
        if seq != self.seq:
            view = msgspec.json.encode(self.view.snapshot())
            self._cached = (self.seq, view)
        return msgspec.json.encode(
            {
                "seq": self.seq,
                "source": self.source,
                "live": self.live,
                "undecodable": self.undecodable,
                "server_time": time.time(),
                "view": msgspec.Raw(view),
            }
        )

    def _set_source(self, source: str, live: bool) -> None:
        self.source, self.live = source, live
        self._bump()

    def _apply(self, kind: str, event: object) -> None:
        self.view.apply(kind, event)

    def _bad(self, rec: Record) -> None:
        self.undecodable += 1
        log.warning("dashboard: undecodable event on %s offset %s", rec.topic, rec.offset)

    # -- following -----------------------------------------------------------------------------
    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.follow(), name=f"feed {self.cfg.run.id}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
            self.task = None

    async def follow(self) -> None:
        """Follow the run's broker, else its ``metrics.jsonl``; look again every
        :data:`RETRY_S` while neither is there."""
        while True:
            broker = await self._broker()
            if broker is not None:
                await self._from_broker(broker)
                return
            path = metrics_path(self.cfg.run_dir)
            if path.is_file():
                await self._from_file(path)
                return
            await asyncio.sleep(RETRY_S)

    async def _broker(self) -> run_events.Broker | None:
        """The run's broker, if one is reachable and holds the run's metrics topic."""
        broker = await asyncio.to_thread(
            run_events.find_broker, self.cfg, self.bootstrap, self.infra_dir
        )
        if broker is None:
            return None
        names = await topic_names(broker)
        return broker if names is not None and self.cfg.topics().metrics in names else None

    async def _from_broker(self, broker: run_events.Broker) -> None:
        where = f"broker {broker.kafka.bootstrap_servers} ({broker.source})"
        self._set_source(where, live=True)
        reader = asyncio.create_task(
            run_events.read_events(
                broker.kafka,
                self.cfg.topics(),
                KINDS,
                self._apply,
                follow=True,
                on_bad=self._bad,
                after_poll=lambda records: self._bump() if records else None,
                client_id="streamrft-dashboard",
            )
        )
        watch = asyncio.create_task(self._watch(broker.kafka.bootstrap_servers))
        try:
            await asyncio.wait({reader, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not reader.done():
                reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(reader, DRAIN_S)
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            log.warning("dashboard: reading %s failed: %s", where, reader.exception())
        self._set_source(f"{where}; gone, showing what was read", live=False)

    async def _watch(self, bootstrap: str) -> None:
        """Return once ``bootstrap`` refused :data:`GONE_CHECKS` connections in a row."""
        refused = 0
        while refused < GONE_CHECKS:
            await asyncio.sleep(RETRY_S)
            up = await asyncio.to_thread(run_events.reachable, bootstrap)
            refused = 0 if up else refused + 1

    async def _from_file(self, path: Path) -> None:
        """Fold the file's events, then its new lines as they are written."""
        self._set_source(f"{path} (no broker holds the run's topics)", live=True)
        offset, partial = 0, b""
        while True:
            with path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read()
            offset += len(data)
            *lines, partial = (partial + data).split(b"\n")
            for line in lines:
                if line.strip():
                    self._fold_line(line)
            if lines:
                self._bump()
            await asyncio.sleep(FILE_POLL_S)

    def _fold_line(self, line: bytes) -> None:
        try:
            self.view.apply("metrics", decode_line(line))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.undecodable += 1
            log.warning("dashboard: a line of metrics.jsonl is no metrics event: %s", exc)
