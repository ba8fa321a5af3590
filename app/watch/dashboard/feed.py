"""One watched run's events, folded into its :class:`~.view.RunView` as they arrive.

A feed reads the run's event topics from the beginning and follows them
(``run_events.read_events``) on the run's broker (``run_events.find_broker``). When no
broker holds the run's topics (the embedded broker of a finished run stopped with it), it
reads the run folder's ``metrics.jsonl`` instead, and again as the file grows, and its
``samples.jsonl`` (the newest samples of each explorer), again whenever it is rewritten.

A followed broker that stops answering is shown as not live at once, and back as live
when it answers again (the reader reconnects by itself). One that refuses
:data:`GONE_CHECKS` checks in a row is gone (the run ended, or its broker crashed): the
page keeps what was read, and the feed looks for the run's broker again; once one holds
the run's topics, the run is read again from the beginning into a fresh view, shown once
it has caught up. A feed that fails logs why, says ``failed: <reason>`` and starts over
after :data:`FAILED_PAUSE_S`. Listeners wait on :meth:`Feed.changed`;
:meth:`Feed.payload` is what they send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from streamrft.app.watch import run_events
from streamrft.app.watch.dashboard.view import RunView
from streamrft.app.watch.metrics_log import decode_line, metrics_path
from streamrft.app.watch.samples_log import read_samples, samples_path
from streamrft.infra import admin
from streamrft.infra.config import Config
from streamrft.infra.consume import Record
from streamrft.schemas.codec import METRICS
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.events import MetricsEvent
from streamrft.schemas.samples import Sample

log = logging.getLogger(__name__)

KINDS = ("metrics", "status", "control", "dead_letters")
"""The event topics every run has; ``samples`` too where the run has that topic (a run
made before it was added has not)."""
RETRY_S = 2.0
"""How often a feed with nothing to read looks again for the run's broker or file."""
FILE_POLL_S = 1.0
"""How often a followed ``metrics.jsonl`` is checked for new lines."""
FILE_QUIET_S = 10.0
"""A ``metrics.jsonl`` last written longer ago than this is not live (a finished run's)."""
CHUNK_BYTES = 1 << 20
"""``metrics.jsonl`` is read and decoded this many bytes at a time, off the event loop."""
MAX_LINE_BYTES = 2 * METRICS.max_bytes
"""A ``metrics.jsonl`` line longer than this (no metrics event is) is skipped as it is
read, never held whole."""
GONE_CHECKS = 2
"""A followed broker that refuses this many checks in a row (``RETRY_S`` apart) is gone."""
LIST_S = 5.0
"""How long listing a broker's topics may take."""
DRAIN_S = 10.0
"""How long the reader of a gone broker may take to finish before it is cancelled."""
FAILED_PAUSE_S = 5.0
"""A feed that failed starts over after this long."""
REFRESH_S = 5.0
"""A payload is made anew at least this often without new events (the rate "now" ages)."""


async def topic_names(broker: run_events.Broker) -> list[str] | None:
    """The topics on ``broker``; None when it does not answer within :data:`LIST_S` (a
    broker that just stopped would be retried for much longer)."""
    try:
        return await asyncio.wait_for(admin.list_topics(broker.kafka), LIST_S)
    except (StreamRFTError, asyncio.TimeoutError) as exc:
        log.info("dashboard: listing the topics of %s failed: %r", broker.source, exc)
        return None


def read_chunk(path: Path, offset: int) -> tuple[bytes, os.stat_result] | None:
    """Up to :data:`CHUNK_BYTES` of ``path`` from ``offset``, and its stat; None: no such
    file."""
    try:
        with path.open("rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_size < offset:
                return b"", st
            fh.seek(offset)
            return fh.read(CHUNK_BYTES), st
    except FileNotFoundError:
        return None


@dataclass
class LineSplitter:
    """Splits a file read in chunks into whole lines; the unfinished last line waits for the
    next chunk, up to :data:`MAX_LINE_BYTES` (beyond that it is dropped, and the rest of it
    up to its newline too: ``skipped`` counts such lines)."""

    partial: bytes = b""
    skipping: bool = False
    skipped: int = 0

    def lines(self, data: bytes) -> list[bytes]:
        if self.skipping:
            cut = data.find(b"\n")
            if cut < 0:
                return []
            data, self.skipping = data[cut + 1 :], False
        *lines, self.partial = (self.partial + data).split(b"\n")
        if len(self.partial) > MAX_LINE_BYTES:
            self.partial, self.skipping = b"", True
            self.skipped += 1
        return lines


@dataclass
class SamplesFile:
    """A run's ``samples.jsonl``, whose whole content is read again when it changes (it is
    replaced whole, never appended to)."""

    path: Path
    seen: tuple[int, int, int] | None = None
    """``(inode, size, mtime_ns)`` when last read."""

    def changed(self) -> bool:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        now = (st.st_ino, st.st_size, st.st_mtime_ns)
        if now == self.seen:
            return False
        self.seen = now
        return True

    def read(self) -> list[Sample]:
        return read_samples(self.path)


def decode_lines(lines: list[bytes]) -> tuple[list[MetricsEvent], list[str]]:
    """The metrics events of ``lines`` and why the others are none."""
    events, bad = [], []
    for line in lines:
        if not line.strip():
            continue
        try:
            events.append(decode_line(line))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            bad.append(str(exc))
    return events, bad


class Feed:
    """The events of run ``cfg.run.id``; see the module docstring."""

    def __init__(self, cfg: Config, bootstrap: str | None, infra_dir: Path | None) -> None:
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.infra_dir = infra_dir
        self.view = RunView(run=str(cfg.run.id))
        self.source = "looking for the run's broker or metrics.jsonl"
        self.kind = ""
        """Where the view comes from: "broker", "file" (metrics and samples only), "" (nowhere
        yet)."""
        self.live = False
        self.kinds: tuple[str, ...] = KINDS
        """The run's event topics the broker holds."""
        self.undecodable = 0
        self.seq = 0
        """Bumped at every change; listeners compare it with what they sent."""
        self.listeners = 0
        """Open streams of this feed."""
        self.idle_since = time.monotonic()
        """When its last listener left (or it started without one)."""
        self._tick = asyncio.Event()
        self._cached: tuple[tuple[int, int], bytes] = ((-1, 0), b"")
        self.task: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None

    # -- listeners -----------------------------------------------------------------------------
    def changed(self) -> asyncio.Event:
        """An event set at the next change (take it, then compare :attr:`seq`)."""
        return self._tick

    def _bump(self) -> None:
        self.seq += 1
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    def listen(self, delta: int) -> None:
        """A stream opened (+1) or closed (-1)."""
        self.listeners += delta
        if self.listeners == 0:
            self.idle_since = time.monotonic()

    def payload(self) -> bytes:
        """The page's data as JSON: the view's snapshot, where it comes from, the time."""
        key, view = self._cached
        now = time.time()
        if key != (self.seq, int(now // REFRESH_S)):
            view = msgspec.json.encode(self.view.snapshot(now=now))
            self._cached = ((self.seq, int(now // REFRESH_S)), view)
        return msgspec.json.encode(
            {
                "seq": self.seq,
                "source": self.source,
                "kind": self.kind,
                "live": self.live,
                "undecodable": self.undecodable,
                "server_time": time.time(),
                "view": msgspec.Raw(view),
            }
        )

    def _set_source(self, source: str, live: bool, kind: str | None = None) -> None:
        if kind is not None:
            self.kind = kind
        if (source, live) != (self.source, self.live):
            self.source, self.live = source, live
            self._bump()

    def _bad(self, rec: Record) -> None:
        self.undecodable += 1
        log.warning("dashboard: undecodable event on %s offset %s", rec.topic, rec.offset)

    # -- following -----------------------------------------------------------------------------
    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.follow(), name=f"feed {self.cfg.run.id}")
            self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A feed's task ended: only a stop cancels it; anything else is a failure, shown,
        logged and retried."""
        if task is not self.task or task.cancelled():
            return
        exc = task.exception()
        reason = repr(exc) if exc is not None else "its reader ended"
        log.error(
            "dashboard: the feed of run %s failed (again in %.0f s): %s",
            self.cfg.run.id,
            FAILED_PAUSE_S,
            reason,
            exc_info=exc,
        )
        self.task = None
        self._set_source(f"failed: {reason}; trying again in {FAILED_PAUSE_S:.0f} s", False)
        self._retry = asyncio.get_running_loop().call_later(FAILED_PAUSE_S, self._restart)

    def _restart(self) -> None:
        self._retry = None
        self.view = RunView(run=str(self.cfg.run.id))
        self.kind = ""
        self._bump()
        self.start()

    async def stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("dashboard: the feed of run %s failed as it stopped", self.cfg.run.id)

    async def follow(self) -> None:
        """Follow the run's broker, else its ``metrics.jsonl``; look again every
        :data:`RETRY_S` while neither is there, and again for its broker once it is gone."""
        read_once = False
        while True:
            broker = await self._broker()
            if broker is not None:
                await self._from_broker(broker, fresh=read_once)
                read_once = True
                continue
            path = metrics_path(self.cfg.run_dir)
            if not read_once and path.is_file():
                await self._from_file(path)
                return  # never: a followed file is followed until the feed stops
            if not read_once and not self.cfg.run_dir.exists():
                self._set_source(
                    "unknown run: no topics on the broker and no run folder "
                    f"({self.cfg.run_dir}); looking again",
                    False,
                )
            await asyncio.sleep(RETRY_S)

    async def _broker(self) -> run_events.Broker | None:
        """The run's broker, if one is reachable and holds the run's metrics topic."""
        broker = await asyncio.to_thread(
            run_events.find_broker, self.cfg, self.bootstrap, self.infra_dir
        )
        if broker is None:
            return None
        names = await topic_names(broker)
        if names is None or self.cfg.topics().metrics not in names:
            return None
        self.kinds = (*KINDS, "samples") if self.cfg.topics().samples in names else KINDS
        return broker

    async def _from_broker(self, broker: run_events.Broker, fresh: bool) -> None:
        """Read the run's topics from the beginning until the broker is gone. ``fresh``:
        into a new view, shown once it has caught up (the old one stays until then)."""
        where = f"broker {broker.kafka.bootstrap_servers} ({broker.source})"
        view = RunView(run=str(self.cfg.run.id)) if fresh else self.view
        caught_up = not fresh

        def after_poll(records: list[Record]) -> None:
            nonlocal caught_up
            if not caught_up and not records:
                caught_up, self.view = True, view
                self._bump()
            elif records and caught_up:
                self._bump()

        self._set_source(where, live=True, kind="broker")
        reader = asyncio.create_task(
            run_events.read_events(
                broker.kafka,
                self.cfg.topics(),
                self.kinds,
                view.apply,
                follow=True,
                on_bad=self._bad,
                after_poll=after_poll,
                client_id="streamrft-dashboard",
            )
        )
        assert broker.kafka.bootstrap_servers is not None  # found reachable
        watch = asyncio.create_task(self._watch(broker.kafka.bootstrap_servers, where))
        try:
            await asyncio.wait({reader, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(reader, DRAIN_S)
        failed = reader.exception() if reader.done() and not reader.cancelled() else None
        if not caught_up:
            self.view = view  # what the broker gave before it went: newer than the old one
        at = time.strftime("%H:%M:%S")
        if failed is not None:
            log.warning("dashboard: reading %s failed: %r", where, failed)
            self._set_source(f"{where}; reading failed at {at} ({failed!r}), again soon", False)
            await asyncio.sleep(RETRY_S)
        else:
            self._set_source(f"{where}; gone at {at}, showing what was read", live=False)

    async def _watch(self, bootstrap: str, where: str) -> None:
        """Show the broker as not live while it refuses connections, as live once it
        answers again; return once it refused :data:`GONE_CHECKS` checks in a row."""
        refused = 0
        while refused < GONE_CHECKS:
            await asyncio.sleep(RETRY_S)
            up = await asyncio.to_thread(run_events.reachable, bootstrap)
            refused = 0 if up else refused + 1
            self._set_source(where if up else f"{where}; not answering", live=up)

    async def _from_file(self, path: Path) -> None:
        """Fold the file's events, then its new lines as they are written; a file that
        shrank or was replaced is read again from its start into a fresh view. The run's
        ``samples.jsonl`` is read whole each time it changes."""
        what = f"{path} (metrics and samples only: no broker holds the run's topics)"
        self._set_source(what, live=False, kind="file")
        offset, inode, split = 0, None, LineSplitter()
        samples = SamplesFile(samples_path(path.parent))
        while True:
            if await asyncio.to_thread(samples.changed):
                self.view.samples_from_file(await asyncio.to_thread(samples.read))
                self._bump()
            chunk = await asyncio.to_thread(read_chunk, path, offset)
            data, st = chunk if chunk is not None else (b"", None)
            size, ino = (st.st_size, st.st_ino) if st is not None else (0, None)
            if size < offset or (inode is not None and ino != inode):
                log.info("dashboard: %s was truncated or replaced: reading it again", path)
                self.view = RunView(run=str(self.cfg.run.id))
                offset, inode, split = 0, None, LineSplitter()
                samples = SamplesFile(samples.path)  # into the fresh view too
                self._bump()
                if chunk is None:
                    await asyncio.sleep(FILE_POLL_S)
                continue
            inode = ino
            if data:
                offset += len(data)
                skipped = split.skipped
                await self._fold_lines(split.lines(data))
                if split.skipped > skipped:
                    log.warning(
                        "dashboard: a line of %s over %d bytes: skipped", path, MAX_LINE_BYTES
                    )
            live = st is not None and time.time() - st.st_mtime < FILE_QUIET_S
            self._set_source(what + ("; growing" if live else "; not growing"), live)
            if offset < size:
                continue  # more to read now
            await asyncio.sleep(FILE_POLL_S)

    async def _fold_lines(self, lines: list[bytes]) -> None:
        """Decode off the loop, then fold into the view."""
        events, bad = await asyncio.to_thread(decode_lines, lines)
        for why in bad[:3]:
            log.warning("dashboard: a line of metrics.jsonl is no metrics event: %s", why)
        self.undecodable += len(bad)
        for ev in events:
            self.view.apply("metrics", ev)
        if events or bad:
            self._bump()
