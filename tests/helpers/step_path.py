"""The trainer's step path (``Trainer._step``: the engine's step, its retry, the dead
letters of a batch set aside) around a real train engine, without a broker: what the
tests of failing steps drive."""

from __future__ import annotations

from typing import Any


class Letters:
    """Stands where the trainer's event sender is: keeps the dead letters it is given."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    async def dead_letter(self, record) -> None:
        self.records.append(record)


def step_path(engine, groups: list) -> Any:
    """A :class:`~streamrft.consumers.trainer.Trainer` holding ``engine`` and a buffer
    that has just handed out ``groups`` (read at offsets 0, 1, ... of partition 0), with
    fresh counters and :class:`Letters` for its events; drive it with ``trainer._step``."""
    from streamrft.consumers.buffer import ExperienceBuffer
    from streamrft.consumers.trainer import Trainer
    from streamrft.infra.bus import Counters

    trainer = object.__new__(Trainer)
    trainer.engine, trainer.counters, trainer.events = engine, Counters(), Letters()
    trainer.buffer = ExperienceBuffer(max_staleness=8)
    for i, g in enumerate(groups):
        trainer.buffer.offer(g, ("run.experiences", 0), i)
    trainer.buffer.take(len(groups), force=True)
    trainer.publisher, trainer._failed_in_a_row = None, 0
    return trainer
