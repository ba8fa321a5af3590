"""The trainer's own expert data: groups built from a task set's answers, a few per step,
for the ``mix`` sample strategy (SFT + RL in the CHORD style, ``algorithm.type: chord``).

Expert groups can also arrive on the experiences topic from anyone (an explorer running
the ``expert`` workflow, an application): they carry the workflow name ``expert`` and the
step trains them the same way. This source is for a task set the trainer reads itself
(``algorithm.expert_data``), so no explorer has to run for it.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.infra.config import Config
from streamrft.infra.expert import expert_group
from streamrft.infra.prompts import PromptRenderer
from streamrft.infra.taskset import read_taskset
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup, Task

SOURCE = "trainer-expert"
"""The component name expert groups of this source carry (``ExperienceGroup.explorer``)."""


class ExpertSource:
    """``per_step`` expert groups for each step, drawn without replacement from the task
    set (reshuffled on each pass), seeded by the run's seed and the step: the same step
    draws the same tasks after a restart."""

    def __init__(
        self, tasks: list[Task], render: PromptRenderer, run: str, seed: int, per_step: int
    ) -> None:
        if not tasks:
            raise ConfigError("algorithm.expert_data: no tasks")
        missing = [t.id for t in tasks if not t.answer]
        if missing:
            raise ConfigError(
                f"algorithm.expert_data: {len(missing)} task(s) without an answer, e.g. "
                f"{missing[0]!r}: expert data needs answers"
            )
        self.tasks, self.render, self.run = tasks, render, run
        self.seed, self.per_step = seed, per_step
        self._shuffled: tuple[int, list[int]] = (-1, [])
        """The last pass's number and task order."""

    @classmethod
    def from_config(cls, cfg: Config, spec: AlgorithmSpec, tokenizer: Any) -> ExpertSource:
        """The source ``spec`` names (``expert_data``, ``expert_per_step``), rendering
        prompts as the explorers do (``taskset`` section)."""
        tasks = read_taskset(spec.expert_data, cfg.taskset)
        render = PromptRenderer.from_config(cfg.taskset, tokenizer)
        run = f"{cfg.run.id or cfg.run.name}/expert"  # group ids apart from the RL groups'
        return cls(tasks, render, run, cfg.run.seed, spec.expert_per_step)

    def take(self, step: int, version: int) -> list[ExperienceGroup]:
        """The expert groups of ``step``, stamped with ``version``."""
        groups = []
        for k in range(step * self.per_step, (step + 1) * self.per_step):
            epoch, index = divmod(k, len(self.tasks))
            task = msgspec.structs.replace(self.tasks[self._order(epoch)[index]], epoch=epoch)
            groups.append(
                expert_group(task, self.render, run=self.run, source=SOURCE, version=version)
            )
        return groups

    def _order(self, epoch: int) -> list[int]:
        """The task order of pass ``epoch`` (a shuffle seeded by the run's seed), shuffled
        once per pass rather than once per group drawn."""
        if self._shuffled[0] != epoch:
            order = list(range(len(self.tasks)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._shuffled = (epoch, order)
        return self._shuffled[1]
