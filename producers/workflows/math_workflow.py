"""The ``math`` workflow: ask for the answer directly, score each response with the reward."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.producers.rewards import RewardFn
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
    """The experiences of group ``gid``: one per rollout of ``task``."""
    return [
        _experience(f"{gid}#{i}", r, task, reward, spec.model_version)
        for i, r in enumerate(rollouts)
    ]


def _experience(
    eid: str, r: Rollout, task: Task, reward: RewardFn, model_version: int
) -> Experience:
    value, info = reward(r.text, task)
    return r.experience(eid, value, model_version, info)
