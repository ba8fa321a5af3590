"""The ``math`` workflow: ask for the answer directly, score each response with the reward."""

from __future__ import annotations

import time
from collections.abc import Sequence

from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.producers.rewards import RewardFn
from streamrft.producers.workflows.base import RolloutSpec, task_group
from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
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
        task_group(
            task,
            spec,
            now,
            lambda gid, task=task, rollouts=rollouts: [
                _experience(f"{gid}#{i}", r, task, reward, spec.model_version)
                for i, r in enumerate(rollouts)
            ],
        )
        for task, rollouts in zip(tasks, batches, strict=True)
    ]


def _experience(
    eid: str, r: Rollout, task: Task, reward: RewardFn, model_version: int
) -> Experience:
    value, info = reward(r.text, task)
    return Experience(
        id=eid,
        tokens=pack_i32(r.prompt_ids + r.response_ids),
        prompt_length=len(r.prompt_ids),
        logprobs=pack_f32(r.logprobs),
        action_mask=pack_u8([1] * len(r.response_ids)),
        reward=value,
        model_version=model_version,
        response_text=r.text,
        info={**info, "response_length": float(len(r.response_ids))},
    )
