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
import logging
import time

from streamrft.infra.bus import Counters
from streamrft.infra.config import Config
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.payload import ModelWeights
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
    """Publishes the trainer's weights as numbered versions through one transport."""

    def __init__(
        self, weights: ModelWeights, sender: WeightSender, announce: Announce, counters: Counters
    ) -> None:
        self.weights = weights
        self.sender = sender
        self.announce = self._stamped(announce)
        self.counters = counters
        self.version = -1
        """The version the trainer's weights are (its last published; -1 before the first)."""
        self._floor = -1
        self._step = 0
        self._fresh = False
        """The model still holds exactly :attr:`version` (no step since it was published)."""
        self._resent = -1

    def _stamped(self, announce: Announce) -> Announce:
        """``announce`` of events that say what the payload adds to the transport's event
        (a delta's base, the state's sha256: :meth:`ModelWeights.stamp`)."""

        async def stamped(event: ModelVersionReady) -> None:
            await announce(self.weights.stamp(event))

        return stamped

    def resume(self, version: int, floor: int) -> None:
        """After a restore: the checkpoint's version, and the highest one ever announced."""
        self.version = version
        self._floor = floor

    async def publish(self, step: int, clock: int | None = None) -> ModelVersionReady:
        """Publish the weights after ``step`` as the next version, and announce it. The
        number is ``clock`` (default ``step``; see ``Trainer.clock``) unless a version that
        high was announced already."""
        t0 = time.perf_counter()
        version = max(step if clock is None else clock, self._floor + 1, self.version + 1)
        self._floor = version
        event = await self.sender.send(await self._make(version, step), self.announce)
        event = self.weights.stamp(event)
        self.version = event.version
        self._step, self._fresh = step, True
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
        return event

    async def _make(self, version: int, step: int) -> MakePayload:
        """The transport's payload maker for ``version``. With delta versions the payload's
        work (a bitwise compare with the last version, the state's sha256, the copy kept as
        the next base) takes seconds on a large model: it is done here, off the event loop
        (which keeps the heartbeats and the intake's consumer group alive); a transport that
        asks for a full version after all gets one made then."""
        if self.weights.delta is None:
            return lambda must_be_full: self.weights.payload(version, step, must_be_full)
        ready = await asyncio.to_thread(self.weights.payload, version, step)
        return lambda must_be_full: (
            self.weights.payload(version, step, True) if must_be_full else ready
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
        self._resent = self.version
        version, step = self.version, self._step
        event = await self.sender.resend(
            lambda full: self.weights.payload(version, step, full), self.announce
        )
        if event is not None:
            log.info("trainer: version %d sent again (%s) for %s", version, event.method, waiting)
        return event is not None

    def close(self) -> None:
        self.sender.close()
