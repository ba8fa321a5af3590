"""A component's connection to the event topics: status, metrics, dead letters, control.

Every long-running process (explorer, trainer, feeder) holds one :class:`EventBus`. It owns
the event producer and, when asked, a background reader of the control topic that keeps
the newest :class:`ModelVersionReady` and notices :class:`Shutdown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from streamrft.infra import kafka
from streamrft.infra.config import Config
from streamrft.infra.retry import retrying
from streamrft.schemas.codec import CONTROL, DEAD_LETTER, METRICS, STATUS, Codec, dead_letter_of
from streamrft.schemas.errors import SchemaError, ServiceError, SyncTimeout
from streamrft.schemas.events import (
    ControlEvent,
    MetricsEvent,
    ModelVersionReady,
    RunState,
    Shutdown,
    StatusEvent,
    SyncRequest,
    TrainedGroup,
)

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
"""Long-running components re-send their status this often (liveness for the trainer)."""
SHUTDOWN_CLOCK_SKEW_S = 2.0
"""A Shutdown event older than this process by more than this is from an earlier attempt."""


class EventBus:
    def __init__(self, cfg: Config, component: str, role: str) -> None:
        self.cfg = cfg
        self.topics = cfg.topics()
        self.component = component
        self.role = role
        self.counters: dict[str, float] = {}
        self.state = RunState.RUNNING
        self.starved = False
        """Sent with every status: the trainer waits for experiences (see StatusEvent)."""
        self.step = 0
        self.version = -1
        self._producer: AIOKafkaProducer | None = None
        self._control: AIOKafkaConsumer | None = None
        self._control_task: asyncio.Task[None] | None = None
        self.versions: dict[int, ModelVersionReady] = {}
        """Every version announced on the control topic, by number."""
        self.version_event = asyncio.Event()
        self.shutdown_event = asyncio.Event()
        self.sync_requests: list[SyncRequest] = []
        self.started_at = time.time()
        self.peers: dict[str, StatusEvent] = {}
        """Newest status of every other component (when started with ``listen_status``)."""
        self._peer_seen: dict[str, float] = {}
        self._heartbeat_task: asyncio.Task[None] | None = None

    async def start(
        self, listen_control: bool = False, listen_status: bool = False, heartbeat_s: float = 0.0
    ) -> None:
        """Start the producer; optionally follow control (and status) and send heartbeats."""
        self._producer = kafka.event_producer(self.cfg.kafka, f"{self.component}-events")
        await kafka.start_client(self._producer, f"{self.component} event producer")
        topics = [self.topics.control] if listen_control else []
        if listen_status:
            topics.append(self.topics.status)
        if topics:
            self._control = kafka.event_reader(self.cfg.kafka, topics, f"{self.component}-control")
            await kafka.start_client(self._control, f"{self.component} control reader")
            self._control_task = asyncio.create_task(self._read_control())
        if heartbeat_s > 0:
            self._heartbeat_task = asyncio.create_task(self._heartbeat(heartbeat_s))

    async def stop(self) -> None:
        """Stop the control reader and flush the producer; safe to call twice."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        if self._control_task is not None:
            self._control_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._control_task
            self._control_task = None
        if self._control is not None:
            await self._control.stop()
            self._control = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def __aenter__(self) -> EventBus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- sending ---------------------------------------------------------------------------
    async def send(self, topic: str, codec: Codec, obj: object, key: str | None = None) -> None:
        """Send one event (acks=all), retrying through a broker outage of up to
        ``run.outage_timeout_s``; then :class:`ServiceError`."""
        producer = self._producer
        if producer is None:
            raise ServiceError(f"{self.component}: event bus not started")
        value, headers = codec.encode(obj), codec.headers()

        async def attempt() -> None:
            await producer.send_and_wait(
                topic, value, key=key.encode() if key else None, headers=headers
            )

        await retrying(
            f"{self.component}: sending to {topic}",
            attempt,
            self.cfg.run.outage_timeout_s,
            lambda _exc: self.count("send_retries"),
        )

    async def control(self, event: ControlEvent) -> None:
        """Send one control event as its own batch (acks=all, awaited)."""
        await self.send(self.topics.control, CONTROL, event, key=self.component)

    async def status(self, state: RunState | None = None, detail: str = "") -> None:
        if state is not None:
            self.state = state
        await self.send(
            self.topics.status,
            STATUS,
            StatusEvent(
                component=self.component,
                role=self.role,
                state=self.state,
                step=self.step,
                version=self.version,
                created_at=time.time(),
                detail=detail,
                counters=dict(self.counters),
                starved=self.starved,
            ),
            key=self.component,
        )

    async def metrics(
        self, values: dict[str, float], trained: list[TrainedGroup] | None = None
    ) -> None:
        await self.send(
            self.topics.metrics,
            METRICS,
            MetricsEvent(
                run=self.topics.run,
                component=self.component,
                step=self.step,
                version=self.version,
                values=values,
                created_at=time.time(),
                trained=trained or [],
            ),
            key=self.topics.run,
        )

    async def dead_letter(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        exc: Exception,
    ) -> None:
        """Record a message this component could not handle; never drop it silently."""
        letter = dead_letter_of(
            topic,
            partition,
            offset,
            key,
            value,
            exc,
            self.component,
            self.cfg.kafka.max_request_bytes,
        )
        log.warning("dead letter %s[%d]@%d: %s", topic, partition, offset, letter.reason)
        self.count("dead_letters")
        await self.send(self.topics.dead_letters, DEAD_LETTER, letter, key=self.component)

    def count(self, name: str, n: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # -- control ---------------------------------------------------------------------------
    async def _read_control(self) -> None:
        assert self._control is not None
        while True:
            batches = await self._control.getmany(timeout_ms=200)
            for tp, records in batches.items():
                is_status = tp.topic == self.topics.status
                for rec in records:
                    try:
                        if is_status:
                            self._on_status(STATUS.decode(rec.value, rec.headers))
                        else:
                            self._on_control(CONTROL.decode(rec.value, rec.headers))
                    except SchemaError as exc:
                        await self.dead_letter(
                            tp.topic, tp.partition, rec.offset, rec.key, rec.value, exc
                        )

    @property
    def latest_version(self) -> ModelVersionReady | None:
        """The newest version announced so far (its latest announcement)."""
        return self.versions[max(self.versions)] if self.versions else None

    def _on_status(self, event: StatusEvent) -> None:
        if event.component != self.component and event.created_at >= self.started_at - 60:
            self.peers[event.component] = event
            self._peer_seen[event.component] = time.monotonic()

    def peer_starved(self, component: str, since: float) -> bool:
        """Whether ``component`` (the trainer) said it starves in a status sent after
        ``since`` (Unix time): an older word may predate what this process just sent."""
        ev = self.peers.get(component)
        return (
            ev is not None and ev.starved and ev.state != RunState.STOPPED and ev.created_at > since
        )

    def live_peers(self, role: str, within_s: float) -> list[str]:
        """Components of ``role`` heard from within ``within_s`` seconds and not STOPPED."""
        now = time.monotonic()
        return sorted(
            name
            for name, ev in self.peers.items()
            if ev.role == role
            and ev.state != RunState.STOPPED
            and now - self._peer_seen[name] <= within_s
        )

    async def _heartbeat(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(ServiceError):
                await self.status()

    def _on_control(self, event: ControlEvent) -> None:
        match event:
            case ModelVersionReady():
                # a later announcement of the same version (an nccl broadcast's object-store
                # fallback) replaces the earlier one
                self.versions[event.version] = event
                self.version_event.set()
            case Shutdown():
                # The control topic is read from the beginning, so a resumed run also sees
                # the Shutdown that ended its previous attempt: only a newer one counts.
                if event.created_at and event.created_at < self.started_at - SHUTDOWN_CLOCK_SKEW_S:
                    log.debug(
                        "%s: ignoring a Shutdown from before this process started", self.component
                    )
                    return
                log.info("%s: shutdown requested (%s)", self.component, event.reason)
                self.shutdown_event.set()
            case SyncRequest():
                self.sync_requests.append(event)

    async def wait_until(
        self, ready: Callable[[], bool], timeout: float, stop: asyncio.Event, what: str
    ) -> bool:
        """Wait (re-checking on every control event) until ``ready()``; False on stop/shutdown.

        Raises :class:`SyncTimeout` naming ``what`` after ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            if stop.is_set() or self.shutdown_event.is_set():
                return False
            remaining = deadline - loop.time()
            if remaining <= 0:
                have = self.latest_version.version if self.latest_version else None
                raise SyncTimeout(
                    f"{self.component}: {what} within {timeout:.0f}s (newest version seen: "
                    f"{have}); see synchronizer.sync_timeout"
                )
            self.version_event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.version_event.wait(), min(remaining, 0.5))
        return True

    async def wait_for_version(
        self, min_version: int, timeout: float, stop: asyncio.Event
    ) -> ModelVersionReady | None:
        """Wait until a version >= ``min_version`` is announced; None on stop or shutdown."""
        ok = await self.wait_until(
            lambda: self.latest_version is not None and self.latest_version.version >= min_version,
            timeout,
            stop,
            f"no model version >= {min_version}",
        )
        return self.latest_version if ok else None


async def read_history(
    cfg: Config, topic: str, codec: Codec, client_id: str, quiet_polls: int = 3
) -> list:
    """Every decodable message of a single-partition event topic, from the beginning.

    The end is where the topic goes quiet for ``quiet_polls`` polls (the embedded broker's
    "latest" offset cannot be trusted). Undecodable messages are skipped here: whoever
    consumes the topic live dead-letters them.
    """
    reader = kafka.event_reader(cfg.kafka, [topic], client_id)
    await kafka.start_client(reader, f"{client_id} reader")
    events, quiet = [], 0
    try:
        while quiet < quiet_polls:
            batches = await reader.getmany(timeout_ms=200)
            quiet = 0 if batches else quiet + 1
            for records in batches.values():
                for rec in records:
                    with contextlib.suppress(SchemaError):
                        events.append(codec.decode(rec.value, rec.headers))
    finally:
        await reader.stop()
    return events
