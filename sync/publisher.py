"""The trainer's side of the sync protocol: number a version and hand it to the transport.

Version *v* is the trainer's weights after step *v* (version 0: after the warm-up).
Numbers only grow, across a trainer restart too: a resumed trainer may restart from a
checkpoint older than the last version it announced, so new versions continue above every
version already on the control topic and a number never names two sets of weights.
*When* to publish is the trainer's decision (the sync style); this component does the how.
"""

from __future__ import annotations

import logging
import time

from streamrft.infra.bus import Counters
from streamrft.infra.config import Config
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.payload import ModelWeights
from streamrft.sync.transport import Announce, WeightSender

log = logging.getLogger(__name__)


async def announced_floor(cfg: Config) -> int:
    """Highest version already announced on the run's control topic (-1: none)."""
    history = await read_history(cfg.kafka, cfg.topics().control, CONTROL, "trainer-resume")
    return max((ev.version for ev in history if isinstance(ev, ModelVersionReady)), default=-1)


class VersionPublisher:
    """Publishes the trainer's weights as numbered versions through one transport."""

    def __init__(
        self, weights: ModelWeights, sender: WeightSender, announce: Announce, counters: Counters
    ) -> None:
        self.weights = weights
        self.sender = sender
        self.announce = announce
        self.counters = counters
        self.version = -1
        """The version the trainer's weights are (its last published; -1 before the first)."""
        self._floor = -1

    def resume(self, version: int, floor: int) -> None:
        """After a restore: the checkpoint's version, and the highest one ever announced."""
        self.version = version
        self._floor = floor

    async def publish(self, step: int) -> ModelVersionReady:
        """Publish the weights after ``step`` as the next version, and announce it."""
        t0 = time.perf_counter()
        version = max(step, self._floor + 1, self.version + 1)
        self._floor = version
        event = await self.sender.send(
            lambda must_be_full: self.weights.payload(version, step, must_be_full), self.announce
        )
        self.version = event.version
        self.counters.add("versions_published")
        self.counters.add("publish_seconds", time.perf_counter() - t0)
        log.info(
            "trainer: version %d published (%s%s)",
            event.version,
            event.method,
            ", adapter" if event.lora else "",
        )
        return event

    def close(self) -> None:
        self.sender.close()
