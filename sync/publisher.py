"""The trainer's side of the sync protocol: number a version and hand it to the transport.

Version *v* is the trainer's weights after step *v* (version 0: after the warm-up), where
the step is the trainer's clock: after a restart, one past the highest batch trained
(``Trainer.clock``), so versions keep following the batches explorers sample.
Numbers only grow, across a trainer restart too: a resumed trainer may restart from a
checkpoint older than the last version it announced, so new versions continue above every
version already on the control topic and a number never names two sets of weights.
*When* to publish is the trainer's decision (the sync style); this component does the how.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from streamrft.infra.bus import Counters
from streamrft.infra.config import Config
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.errors import SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.payload import ModelWeights, Snapshot
from streamrft.sync.transport import Announce, MakePayload, WeightSender

log = logging.getLogger(__name__)


async def announced_floor(cfg: Config) -> int:
    """Highest version already announced on the run's control topic (-1: none)."""
    history = await read_history(cfg.kafka, cfg.topics().control, CONTROL, "trainer-resume")
    return max((ev.version for ev in history if isinstance(ev, ModelVersionReady)), default=-1)


def _kind(event: ModelVersionReady) -> str:
    """What a version holds besides full weights, for the log."""
    if event.lora:
        return ", adapter"
    return f", delta on {event.delta_base}" if event.delta_base >= 0 else ""


class VersionPublisher:
    """Publishes the trainer's weights as numbered versions through one transport, in the
    background: :meth:`submit` copies the weights out of the model (:meth:`ModelWeights.snapshot`:
    the only time the trainer waits) and returns; a worker task then makes the payload
    (a delta: off the event loop), sends it and announces it while the trainer trains its
    next step. At most one version waits behind the one being sent; a newer one takes
    its place (and its snapshot buffers: two sets in all). So a version is announced only
    once its bytes are where its event says (the sender announces last), and a skipped
    number is never announced: explorers wait for a version ``>=`` the one they need.
    """

    def __init__(
        self, weights: ModelWeights, sender: WeightSender, announce: Announce, counters: Counters
    ) -> None:
        self.weights = weights
        self.sender = sender
        self.announce = self._stamped(announce)
        self.counters = counters
        self.version = -1
        """The version the trainer's weights are: the number of the last snapshot (-1
        before the first), announced or on its way."""
        self.announced = -1
        """The last version announced (a checkpoint names this one, never one on its way)."""
        self.last_event: ModelVersionReady | None = None
        self._floor = -1
        self._step = 0
        self._fresh = False
        """The model still holds exactly :attr:`version` (no step since it was published)."""
        self._resent = -1
        self._queued: _Queued | None = None
        self._spare: Snapshot | None = None
        """Buffers of a snapshot no longer needed, for the next one."""
        self._error: BaseException | None = None
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._done = asyncio.Condition()

    def _stamped(self, announce: Announce) -> Announce:
        """``announce`` of events that say what the payload adds to the transport's event
        (a delta's base, the state's sha256: :meth:`ModelWeights.stamp`)."""

        async def stamped(event: ModelVersionReady) -> None:
            await announce(self.weights.stamp(event))

        return stamped

    def resume(self, version: int, floor: int) -> None:
        """After a restore: the checkpoint's version, and the highest one ever announced."""
        self.version = version
        self.announced = version
        self._floor = floor

    async def submit(self, step: int, clock: int | None = None) -> int:
        """Take the weights after ``step`` as the next version and return its number once
        they are copied out (the model may change from then on); it is sent and announced
        in the background. The number is ``clock`` (default ``step``; see
        ``Trainer.clock``) unless a version that high was announced already. Raises what
        sending an earlier version raised (:meth:`check`)."""
        self.check()
        t0 = time.perf_counter()
        version = max(step if clock is None else clock, self._floor + 1, self.version + 1)
        self._floor = version
        # the queued version leaves the queue before the copy, so the worker cannot take
        # it (and send its buffers) while they are overwritten; a version being sent is
        # never written into: its buffers are neither queued nor spare
        replaced, self._queued = self._queued, None
        into = replaced.frozen if replaced is not None else self._spare
        self._spare = None
        frozen = await asyncio.to_thread(self.weights.snapshot, into)
        self._queued = _Queued(version, step, frozen)
        if replaced is not None:
            self.counters.add("versions_replaced")
            log.info("trainer: version %d replaces %d, not yet sent", version, replaced.version)
        self.version = version
        self._step, self._fresh = step, True
        self.counters.add("publish_blocked_seconds", time.perf_counter() - t0)
        self._start_worker()
        self._wake.set()
        await asyncio.sleep(0)  # the worker, when idle, takes it now: queued is what waits
        return version

    async def publish(self, step: int, clock: int | None = None) -> ModelVersionReady:
        """:meth:`submit`, then wait until that version is announced; its event."""
        version = await self.submit(step, clock)
        return await self.wait(version)

    async def wait(self, version: int) -> ModelVersionReady:
        """The event of the first version ``>= version`` announced (a queued version may be
        replaced by a newer one); raises what sending failed with."""
        if self.announced < version and self._error is None:
            async with self._done:
                await self._done.wait_for(
                    lambda: self.announced >= version or self._error or self._stopped()
                )
        self.check()
        if self.announced < version:
            raise SyncError(f"version {version} was not sent: the publisher stopped")
        assert self.last_event is not None
        return self.last_event

    async def drain(self, background: bool = True) -> None:
        """Wait until every submitted version is announced and, with ``background``, what
        the sender does after that is done (``auto``: the store copy); raise why not."""
        if self.version > self.announced:
            await self.wait(self.version)
        self.check()
        if background:
            await self.sender.drain()

    def check(self) -> None:
        """Raise the error sending a version failed with (an outage past
        ``run.outage_timeout_s``), in the trainer's loop."""
        if self._error is not None:
            raise self._error

    def _stopped(self) -> bool:
        return self._worker is None or self._worker.done()

    def _start_worker(self) -> None:
        """The worker on the running loop (made again on a new loop: asyncio.run cancels
        what a finished loop left)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._worker is None or self._worker.done():
            self._loop = loop
            self._wake, self._done = asyncio.Event(), asyncio.Condition()
            self._worker = loop.create_task(self._send_queued(), name="version-publisher")

    async def _send_queued(self) -> None:
        """The worker: send the queued version, one at a time, until closed."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queued is not None:
                    item, self._queued = self._queued, None
                    await self._send(item)
                    self._spare = item.frozen  # the queued one, if any, has its own
                    async with self._done:
                        self._done.notify_all()
        except asyncio.CancelledError:
            self._done_now()  # whoever waits must not wait forever (see wait)
            raise
        except BaseException as exc:  # handed to the trainer's loop by check()
            self._error = exc
            self._done_now()

    def _done_now(self) -> None:
        """Wake the waiters of :meth:`wait` (from the worker, without awaiting)."""

        async def notify() -> None:
            async with self._done:
                self._done.notify_all()

        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody waits
            asyncio.get_running_loop().create_task(notify())

    async def _send(self, item: _Queued) -> None:
        t0 = time.perf_counter()
        event = await self.sender.send(await self._make(item), self.announce)
        event = self.weights.stamp(event)
        self.announced, self.last_event = event.version, event
        self.counters.add("versions_published")
        self.counters.add("publish_seconds", time.perf_counter() - t0)
        log.info(
            "trainer: version %d published (%s%s, %d bytes)",
            event.version,
            event.method,
            _kind(event),
            event.bytes,
        )
        self.counters.add("published_bytes", event.bytes)
        if event.delta_base >= 0:
            self.counters.add("deltas_published")

    async def _make(self, item: _Queued) -> MakePayload:
        """The transport's payload maker for ``item``, made off the event loop (a delta's
        bitwise compare with the last version and the state's sha256 take seconds on a
        large model; the loop keeps the heartbeats and the intake's consumer group alive);
        a transport that asks for a full version after all gets one made then."""
        version, step, frozen = item.version, item.step, item.frozen
        ready = await asyncio.to_thread(self.weights.payload, version, step, False, frozen)
        return lambda must_be_full: (
            self.weights.payload(version, step, True, frozen) if must_be_full else ready
        )

    def stepped(self) -> None:
        """The model changed since the last version (a training step)."""
        self._fresh = False

    async def reach(self, waiting: list[str]) -> bool:
        """Send the current version again where every explorer can load it, for explorers
        in ``waiting`` that cannot load it (``nccl``: not members of the group it went to,
        e.g. one that joined since and whose first batch needs it), while the model still
        holds it; once per version. True when it was sent again."""
        if self.version < 0 or not self._fresh or self._resent == self.version:
            return False
        if all(self.sender.reaches(name) for name in waiting):
            return False
        await self.drain()  # one sender call at a time
        self._resent = self.version
        version, step = self.version, self._step
        event = await self.sender.resend(
            lambda full: self.weights.payload(version, step, full), self.announce
        )
        if event is not None:
            log.info("trainer: version %d sent again (%s) for %s", version, event.method, waiting)
        return event is not None

    async def aclose(self) -> None:
        """Stop the worker (a version on its way is abandoned), then the sender."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = self._loop = None
        self.close()

    def close(self) -> None:
        self.sender.close()


@dataclass(frozen=True)
class _Queued:
    """A version submitted and not yet sent."""

    version: int
    step: int
    frozen: Snapshot
