"""The ``preference`` workflow: a task's chosen and rejected answers as one pair, for
preference optimisation (the ``dpo`` preset).

A preference task carries the chosen answer in ``answer`` and the rejected one in
``metadata["rejected"]``. Nothing is sampled: each task becomes a group of kind
``preference`` (:func:`streamrft.infra.expert.preference_group`): the chosen experience
(reward 1), then the rejected one (reward 0), with the same prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrft.infra.expert import preference_group
from streamrft.producers.engines.base import RolloutEngine
from streamrft.producers.rewards import RewardFn
from streamrft.producers.workflows.base import RolloutSpec
from streamrft.schemas.experience import ExperienceGroup, Task


def preference_workflow(
    engine: RolloutEngine, tasks: Sequence[Task], reward: RewardFn, spec: RolloutSpec
) -> list[ExperienceGroup]:
    """One chosen/rejected pair per task; ``reward`` is unused (the pair's order is the
    label)."""
    render = spec.renderer(engine)
    groups = []
    for task in tasks:
        group = preference_group(
            task, render, run=spec.run, source=spec.explorer, version=spec.model_version
        )
        group.explorer_step = spec.explorer_step
        groups.append(group)
    return groups
