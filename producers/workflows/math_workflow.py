"""The ``math`` workflow: ask for the answer directly, score each response with the reward."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.producers.rewards import RewardFn, score_all
from streamrft.producers.workflows.base import RolloutSpec, task_group
from streamrft.schemas.experience import Experience, ExperienceGroup, Task


def math_workflow(
    engine: RolloutEngine, tasks: Sequence[Task], reward: RewardFn, spec: RolloutSpec
) -> list[ExperienceGroup]:
    """Sample ``spec.repeat_times`` responses per task in one batch and score them."""
    batches = engine.rollout(
        spec.renderer(engine).batch(tasks),
        spec.repeat_times,
        spec.temperature,
        spec.max_new_tokens,
        spec.seed,
    )
    now = time.time()
    return [
        task_group(task, spec, now, functools.partial(_experiences, rollouts, task, reward, spec))
        for task, rollouts in zip(tasks, batches, strict=True)
    ]


def _experiences(
    rollouts: Sequence[Rollout], task: Task, reward: RewardFn, spec: RolloutSpec, gid: str
) -> list[Experience]:
    """The experiences of group ``gid``: one per rollout of ``task``, scored together."""
    scored = score_all(reward, [(r.text, task) for r in rollouts])
    return [
        r.experience(f"{gid}#{i}", value, spec.model_version, info)
        for i, (r, (value, info)) in enumerate(zip(rollouts, scored, strict=True))
    ]
