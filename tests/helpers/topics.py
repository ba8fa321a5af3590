"""Reading a finished run's topics back in a test."""

from __future__ import annotations

import asyncio

from streamrft.infra.consume import read_history
from streamrft.schemas.codec import EXPERIENCE_GROUP, METRICS


def groups_and_trainer_metrics(cfg) -> tuple[list, list]:
    """Every experience group published in run ``cfg``, and the trainer's metrics events."""
    topics = cfg.topics()

    async def read():
        groups = await read_history(cfg.kafka, topics.experiences, EXPERIENCE_GROUP, "t-exp", 3)
        metrics = await read_history(cfg.kafka, topics.metrics, METRICS, "t-metrics", 3)
        return groups, [m for m in metrics if m.component == "trainer"]

    return asyncio.run(read())
