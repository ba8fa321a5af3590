"""A component's connection to the run's event topics, in two parts with one job each.

- :class:`EventSender` sends: control events, status heartbeats, metrics, dead letters
  (acks=all, retried through a broker outage). What a status or metrics event says about
  the component (its step, version, whether it starves) comes from a ``position``
  callback the owner passes in, so nobody assigns the sender's fields.
- :class:`ControlView` reads: a background reader of the control topic (and, when asked,
  the status topic) that keeps a read-only picture of the run: the versions announced,
  the newest status of every peer, pending sync requests, whether a Shutdown came. Callers
  query it and wait on it (:meth:`ControlView.wait_until`); they never change it.

Every long-running process (explorer, trainer, feeder) holds one sender and, if it follows
the run, one view. Both have an explicit lifecycle (``start``/``stop``, stop safe twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from streamrft.infra import kafka
from streamrft.infra.config import Config
from streamrft.infra.consume import OnBad, Record, consume
from streamrft.infra.probes import ProbeServer, ProcessProbes
from streamrft.infra.retry import retrying
from streamrft.schemas.codec import CONTROL, DEAD_LETTER, METRICS, STATUS, Codec, dead_letter_of
from streamrft.schemas.errors import SchemaError, ServiceError, StreamRFTError, SyncTimeout
from streamrft.schemas.events import (
    ControlEvent,
    MetricsEvent,
    ModelVersionReady,
    Rejection,
    RunState,
    Shutdown,
    StatusEvent,
    SyncRequest,
    TrainedGroup,
    VersionsRetired,
)
from streamrft.schemas.limits import MAX_REJECTIONS_REPORTED

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
"""Long-running components re-send their status this often (liveness for the trainer)."""
SHUTDOWN_CLOCK_SKEW_S = 2.0
"""A Shutdown event older than this process by more than this is from an earlier attempt."""
PEER_HISTORY_S = 60.0
"""Status events older than this process by more than this are from an earlier attempt."""
MAX_REQUESTERS = 1024
"""Explorers whose unanswered sync requests a view keeps (the newest ones)."""
CAUGHT_UP_QUIET_POLLS = 3
"""A view whose reads came back empty this many times in a row has read the history (the
embedded broker's end offsets alone cannot be trusted to say where a topic ends)."""


class Counters:
    """A process's running totals (groups published, versions applied, ...), reported with
    every status event. Components add to them; nobody replaces them."""

    def __init__(self, initial: Mapping[str, float] | None = None) -> None:
        self._values: dict[str, float] = dict(initial or {})

    def add(self, name: str, n: float = 1) -> None:
        self._values[name] = self._values.get(name, 0) + n

    def set(self, name: str, value: float) -> None:
        self._values[name] = value

    def restore(self, values: Mapping[str, float]) -> None:
        """Take the totals of an earlier attempt (a checkpoint), on top of these."""
        self._values.update(values)

    def get(self, name: str, default: float = 0) -> float:
        return self._values.get(name, default)

    def snapshot(self) -> dict[str, float]:
        return dict(self._values)

    def __getitem__(self, name: str) -> float:
        return self._values[name]


@dataclass(frozen=True)
class Position:
    """Where a component stands, as its status and metrics events report it."""

    step: int = 0
    version: int = -1
    starved: bool = False
    """Trainer only: it has waited a while for experiences (see StatusEvent.starved)."""
    working: bool = False
    """Explorers and serve processes: work under way (see StatusEvent.working)."""
    ready: bool = True
    """It can do its work (``/readyz``, ``monitor.http_port``): an explorer, evaluator or
    serve process holds weights; the trainer has resumed and joined its experiences."""


class EventSender:
    """Sends one component's events. ``position()`` is read at every send."""

    def __init__(
        self,
        cfg: Config,
        component: str,
        role: str,
        counters: Counters | None = None,
        position: Callable[[], Position] = Position,
    ) -> None:
        self.cfg = cfg
        self.topics = cfg.topics()
        self.component = component
        self.role = role
        self.counters = counters if counters is not None else Counters()
        self._position = position
        self.state = RunState.RUNNING
        """The state this component last reported (see :meth:`status`)."""
        self._producer: AIOKafkaProducer | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._probes: ProcessProbes | None = None
        self._probe_server: ProbeServer | None = None
        self._rejections: deque[Rejection] = deque(maxlen=MAX_REJECTIONS_REPORTED)

    @property
    def rejections(self) -> list[Rejection]:
        """The version announcements this component refused (newest last), which every
        status it sends carries."""
        return list(self._rejections)

    def reject(self, rejection: Rejection) -> bool:
        """Add ``rejection`` to what every status says from now; False when that
        announcement (version, method, manifest) was refused already."""
        same = (rejection.version, rejection.method, rejection.manifest_sha256)
        if any((r.version, r.method, r.manifest_sha256) == same for r in self._rejections):
            return False
        self._rejections.append(rejection)
        return True

    async def start(self, heartbeat_s: float = 0.0) -> None:
        """Start the producer; with ``heartbeat_s`` (a long-running component), re-send the
        status that often and serve the probes of ``monitor.http_port`` when it is set: the
        events this sender delivers are what they answer from."""
        producer = kafka.event_producer(self.cfg.kafka, f"{self.component}-events")
        await kafka.start_client(producer, f"{self.component} event producer")
        self._producer = producer  # only once started: until then send() refuses at once
        if heartbeat_s > 0 and self.cfg.monitor.http_port:
            self._probes = ProcessProbes(
                self.topics.run,
                self.component,
                self.role,
                self.cfg.monitor.health_timeout_s,
                lambda: self._position().ready,
            )
            server = ProbeServer(self.cfg.monitor, self._probes, self.component)
            try:
                await server.start()
            except StreamRFTError:  # the port is taken: nothing left running
                await self.stop()
                raise
            self._probe_server = server
        if heartbeat_s > 0:
            self._heartbeat_task = asyncio.create_task(self._heartbeat(heartbeat_s))

    async def stop(self) -> None:
        """Stop the heartbeat and flush the producer; safe to call twice."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        if self._probe_server is not None:
            await self._probe_server.stop()
            self._probe_server = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def __aenter__(self) -> EventSender:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def send(self, topic: str, codec: Codec, obj: object, key: str | None = None) -> None:
        """Send one event (acks=all, awaited, as its own batch), retrying through a broker
        outage of up to ``run.outage_timeout_s``; then :class:`ServiceError`."""
        producer = self._producer
        if producer is None:
            raise ServiceError(f"{self.component}: event sender not started")
        value, headers = codec.encode(obj), codec.headers()

        async def attempt() -> None:
            await producer.send_and_wait(
                topic, value, key=key.encode() if key else None, headers=headers
            )

        await retrying(
            f"{self.component}: sending to {topic}",
            attempt,
            self.cfg.run.outage_timeout_s,
            lambda _exc: self.counters.add("send_retries"),
        )

    async def control(self, event: ControlEvent) -> None:
        await self.send(self.topics.control, CONTROL, event, key=self.component)

    async def status(self, state: RunState | None = None, detail: str = "") -> None:
        """Send a status event; ``state`` (when given) becomes the state reported from now."""
        if state is not None:
            self.state = state
        pos = self._position()
        event = StatusEvent(
            component=self.component,
            role=self.role,
            state=self.state,
            step=pos.step,
            version=pos.version,
            created_at=time.time(),
            detail=detail,
            counters=self.counters.snapshot(),
            starved=pos.starved,
            working=pos.working,
            rejected=list(self._rejections),
        )
        await self.send(self.topics.status, STATUS, event, key=self.component)
        if self._probes is not None:
            self._probes.sent_status(event)

    async def metrics(
        self, values: dict[str, float], trained: list[TrainedGroup] | None = None
    ) -> None:
        pos = self._position()
        event = MetricsEvent(
            run=self.topics.run,
            component=self.component,
            step=pos.step,
            version=pos.version,
            values=values,
            created_at=time.time(),
            trained=trained or [],
        )
        await self.send(self.topics.metrics, METRICS, event, key=self.topics.run)
        if self._probes is not None:
            self._probes.sent_metrics(event)

    async def dead_letter(self, record: Record) -> None:
        """Record a message this component could not handle; never drop it silently."""
        letter = dead_letter_of(
            record.topic,
            record.partition,
            record.offset,
            record.key,
            record.value,
            record.error or SchemaError("dead-lettered with no reason given"),
            self.component,
            self.cfg.kafka.max_request_bytes,
        )
        log.warning(
            "dead letter %s[%d]@%d: %s",
            record.topic,
            record.partition,
            record.offset,
            letter.reason,
        )
        self.counters.add("dead_letters")
        await self.send(self.topics.dead_letters, DEAD_LETTER, letter, key=self.component)

    async def _heartbeat(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(ServiceError):
                await self.status()


class ControlView:
    """What a component knows of the run from the control (and status) topics. Read-only.

    ``dead_letter`` is how a record that does not decode is set aside (the component's
    :meth:`EventSender.dead_letter`). If the reader fails for any other reason (a dead
    letter that cannot be sent within ``run.outage_timeout_s``, a broker error), every
    later :meth:`check` and :meth:`wait_until` raises :class:`ServiceError` with the cause:
    the process fails loudly instead of waiting for versions that can no longer arrive.
    """

    def __init__(
        self,
        cfg: Config,
        component: str,
        dead_letter: OnBad,
        listen_status: bool = False,
    ) -> None:
        self.cfg = cfg
        self.topics = cfg.topics()
        self.component = component
        self._dead_letter = dead_letter
        self._listen_status = listen_status
        self.started_at = time.time()
        self.shutdown = asyncio.Event()
        """Set once a Shutdown newer than this process arrives."""
        self.ended_before = False
        """A Shutdown from before this process came after every version announced so far:
        the run had ended when it started (a resumed run announces versions after it)."""
        self.shutdowns_from = self.started_at
        """A Shutdown older than this (give or take the clock skew) is from an earlier
        attempt of the run; a process started on behalf of a run attempt that began earlier
        (an evaluator restarted by ``streamrft run``) sets it to the attempt's start."""
        self._changed = asyncio.Event()
        self._versions: dict[int, ModelVersionReady] = {}
        self._announcements: dict[int, list[ModelVersionReady]] = {}
        self._requests: dict[str, SyncRequest] = {}
        """The highest request of each explorer (at most :data:`MAX_REQUESTERS`, the newest):
        a flood of requests takes no more room than one per name."""
        self._retired: set[int] = set()
        self._peers: dict[str, StatusEvent] = {}
        self._peer_seen: dict[str, float] = {}
        self._reader: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.caught_up = asyncio.Event()
        """Set once the reader has read what its topics held when it started."""
        self._ends: dict[TopicPartition, int] = {}
        self._quiet = 0
        self.own_rejections: Sequence[Rejection] = ()
        """What the newest status of an earlier process of this component said it refused
        (its statuses sent before this view started); read from the status topic when the
        view listens to it."""

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        topics = [self.topics.control]
        if self._listen_status:
            topics.append(self.topics.status)
        reader = kafka.event_reader(self.cfg.kafka, topics, f"{self.component}-control")
        await kafka.start_client(reader, f"{self.component} control reader")
        self._reader = reader
        # each event topic has one partition (see infra/admin.py); without the ends, the
        # quiet reads alone say when the history is read
        with contextlib.suppress(KafkaError):
            ends = await reader.end_offsets([TopicPartition(t, 0) for t in topics])
            self._ends = {tp: end for tp, end in ends.items() if end > 0}
            if not self._ends:
                self.caught_up.set()
        self._task = asyncio.create_task(self._read())

    async def stop(self) -> None:
        """Stop the reader; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._reader is not None:
            await self._reader.stop()
            self._reader = None

    # -- the reader --------------------------------------------------------------------------
    async def _read(self) -> None:
        """Follow the topics until cancelled. Sends it makes (dead letters) already ride out
        a broker outage (:meth:`EventSender.send`); any failure that reaches here is kept
        for :meth:`check` and ends the reader: the record it happened on was read and will
        not come again, so reading on would lose it silently."""
        codecs: dict[str, Codec | None] = {self.topics.control: CONTROL, self.topics.status: STATUS}
        assert self._reader is not None
        try:
            await consume(
                self._reader,
                codecs,
                self._on_record,
                on_bad=self._dead_letter,
                after_poll=self._after_poll,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # kept for check(): the process fails with the cause
            log.error("%s: control reader failed: %r", self.component, exc)
            self._error = exc
            self._changed.set()

    async def _after_poll(self, records: list[Record]) -> None:
        """Set :attr:`caught_up` once every topic's position reached the end offset seen at
        start, or the reads came back empty :data:`CAUGHT_UP_QUIET_POLLS` times."""
        if self.caught_up.is_set():
            return
        self._quiet = 0 if records else self._quiet + 1
        assert self._reader is not None
        behind = [tp for tp, end in self._ends.items() if await self._position(tp) < end]
        if (self._ends and not behind) or self._quiet >= CAUGHT_UP_QUIET_POLLS:
            self.caught_up.set()
            self._changed.set()

    async def _position(self, tp: TopicPartition) -> int:
        assert self._reader is not None
        if tp not in self._reader.assignment():
            return -1  # not assigned yet: nothing read
        return await self._reader.position(tp)

    def _on_record(self, rec: Record) -> None:
        if rec.topic == self.topics.status:
            self._on_status(rec.obj)
        else:
            self._on_control(rec.obj)
        self._changed.set()

    def _on_status(self, event: StatusEvent) -> None:
        if event.component == self.component:
            if event.created_at < self.started_at:  # an earlier process of this component
                self.own_rejections = event.rejected[-MAX_REJECTIONS_REPORTED:]
        elif event.created_at >= self.started_at - PEER_HISTORY_S:
            self._peers[event.component] = event
            self._peer_seen[event.component] = time.monotonic()

    def _on_control(self, event: ControlEvent) -> None:
        match event:
            case ModelVersionReady():
                if event.version in self._retired:
                    return  # an announcement replayed after its retirement
                # a later announcement of the same version (an nccl broadcast's object-store
                # fallback, the auto method's store copy) is its latest; each is kept
                self._versions[event.version] = event
                self._announcements.setdefault(event.version, []).append(event)
                self.ended_before = False
            case VersionsRetired():
                self._retire(event.versions)
            case Shutdown():
                # The control topic is read from the beginning, so a resumed run also sees
                # the Shutdown that ended its previous attempt: only a newer one counts.
                if (
                    event.created_at
                    and event.created_at < self.shutdowns_from - SHUTDOWN_CLOCK_SKEW_S
                ):
                    log.debug("%s: ignoring a Shutdown from before this process", self.component)
                    self.ended_before = True
                    return
                log.info("%s: shutdown requested (%s)", self.component, event.reason)
                self.shutdown.set()
            case SyncRequest():
                held = self._requests.pop(event.explorer, None)
                if held is not None and held.min_version > event.min_version:
                    event = held
                self._requests[event.explorer] = event
                while len(self._requests) > MAX_REQUESTERS:  # names made up by a flood
                    del self._requests[next(iter(self._requests))]

    # -- queries -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`ServiceError` (with the cause) if the reader has failed."""
        if self._error is not None:
            raise ServiceError(
                f"{self.component}: the control-topic reader failed: {self._error!r}"
            ) from self._error

    @property
    def versions(self) -> Mapping[int, ModelVersionReady]:
        """Every version announced so far, by number (its latest announcement)."""
        return types.MappingProxyType(self._versions)

    def announcements(self, version: int) -> list[ModelVersionReady]:
        """Every announcement of ``version``, in the order they came (one per place it can
        be read from: shared memory, the object store, a broadcast)."""
        return list(self._announcements.get(version, ()))

    @property
    def latest_version(self) -> ModelVersionReady | None:
        return self._versions[max(self._versions)] if self._versions else None

    @property
    def retired(self) -> frozenset[int]:
        """Versions announced retired (``VersionsRetired``): forgotten by :attr:`versions`."""
        return frozenset(self._retired)

    def requests_above(self, version: int) -> list[SyncRequest]:
        """Sync requests for a version above ``version`` (the older ones are answered)."""
        return [r for r in self._requests.values() if r.min_version > version]

    def _retire(self, versions: list[int]) -> None:
        """Forget retired versions that were announced, except the newest: whatever a
        retirement says, the run keeps a version to load, and a version not announced yet
        cannot be retired ahead of time."""
        newest = max(self._versions, default=-1)
        for v in versions:
            if v not in self._versions:
                continue
            if v == newest:
                log.warning(
                    "%s: ignoring the retirement of the newest version %d", self.component, v
                )
                continue
            self._retired.add(v)
            self._versions.pop(v, None)
            self._announcements.pop(v, None)

    def sizes(self) -> dict[str, int]:
        """How much the view holds (a long run's soak checks these stay bounded): versions
        announced and not retired, their announcements, unanswered sync requests, peers,
        and versions retired (one int each: the one thing that grows with the run)."""
        return {
            "view_versions": len(self._versions),
            "view_announcements": sum(len(a) for a in self._announcements.values()),
            "view_requests": len(self._requests),
            "view_peers": len(self._peers),
            "view_retired": len(self._retired),
        }

    def peer(self, component: str) -> StatusEvent | None:
        """The newest status of ``component`` this view read (None: never heard from)."""
        return self._peers.get(component)

    def peer_starved(self, component: str, since: float) -> bool:
        """Whether ``component`` (the trainer) said it starves in a status sent after
        ``since`` (Unix time): an older word may predate what this process just sent."""
        ev = self._peers.get(component)
        return (
            ev is not None and ev.starved and ev.state != RunState.STOPPED and ev.created_at > since
        )

    def waiting_peers(self, within_s: float) -> list[str]:
        """Explorers heard from within ``within_s`` seconds that say they wait for a version."""
        return [
            name
            for name in self.live_peers("explorer", within_s)
            if self._peers[name].state == RunState.WAITING_SYNC
        ]

    def exploring_peers(self, within_s: float) -> list[str]:
        """Explorers heard from within ``within_s`` seconds that say they are RUNNING and
        hold tasks partitions: the ones that may still publish experiences."""
        return [
            name
            for name in self.live_peers("explorer", within_s)
            if self._peers[name].state == RunState.RUNNING
            and self._peers[name].counters.get("tasks_partitions", 0) > 0
        ]

    def working_peers(self, within_s: float) -> list[str]:
        """Explorers and serve processes heard from within ``within_s`` seconds that say
        they are RUNNING with work in hand (an explorer's step: rollouts, a version
        download; a serve process's episodes waiting for rewards, groups to publish)."""
        return [
            name
            for role in ("explorer", "serve")
            for name in self.live_peers(role, within_s)
            if self._peers[name].state == RunState.RUNNING and self._peers[name].working
        ]

    def heard_from(self, role: str) -> bool:
        """Whether any component of ``role`` has ever sent a status (this run's history
        included)."""
        return any(event.role == role for event in self._peers.values())

    def live_peers(self, role: str, within_s: float) -> list[str]:
        """Components of ``role`` heard from within ``within_s`` seconds and not STOPPED."""
        now = time.monotonic()
        return sorted(
            name
            for name, ev in self._peers.items()
            if ev.role == role
            and ev.state != RunState.STOPPED
            and now - self._peer_seen[name] <= within_s
        )

    async def wait_until(
        self, ready: Callable[[], bool], timeout: float, stop: asyncio.Event, what: str
    ) -> bool:
        """Wait (re-checking on every event read) until ``ready()``; False on stop/shutdown.

        Raises :class:`SyncTimeout` naming ``what`` after ``timeout`` seconds, and
        :class:`ServiceError` if the reader fails meanwhile.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            self.check()
            if stop.is_set() or self.shutdown.is_set():
                return False
            remaining = deadline - loop.time()
            if remaining <= 0:
                have = self.latest_version.version if self.latest_version else None
                raise SyncTimeout(
                    f"{self.component}: {what} within {timeout:.0f}s (newest version seen: "
                    f"{have}); see synchronizer.sync_timeout"
                )
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))
        return True
