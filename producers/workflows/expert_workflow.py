"""The ``expert`` workflow: the task's own answer as the one response, for supervised
training (the ``sft`` preset) and for expert data on the experiences topic (the ``mix``
strategy trains such groups with the supervised loss).

Nothing is sampled: each task becomes a group of one experience
(:func:`streamrft.infra.expert.expert_group`), scored by the reward like any response.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrft.infra.expert import expert_group
from streamrft.producers.engines.base import RolloutEngine
from streamrft.producers.rewards import RewardFn
from streamrft.producers.workflows.base import RolloutSpec
from streamrft.schemas.experience import ExperienceGroup, Task


def expert_workflow(
    engine: RolloutEngine, tasks: Sequence[Task], reward: RewardFn, spec: RolloutSpec
) -> list[ExperienceGroup]:
    """One group of one experience per task: prompt, then the task's answer and EOS."""
    render = spec.renderer(engine)
    groups = []
    for task in tasks:
        value, info = reward(task.answer, task)
        group = expert_group(
            task,
            render,
            run=spec.run,
            source=spec.explorer,
            version=spec.model_version,
            reward=value,
            info=info,
        )
        group.explorer_step = spec.explorer_step
        groups.append(group)
    return groups
