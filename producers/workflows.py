"""Workflows: turn a task into rollouts with rewards, i.e. one experience group.

A workflow owns prompt formatting and scoring; the engine owns sampling. ``math`` (the
default) asks for the answer directly and scores it with ``explorer.reward``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from streamrft.producers.engine import RolloutEngine
from streamrft.producers.rewards import RewardFn
from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Experience, ExperienceGroup, Task, make_group_id

WORKFLOWS = ("math",)


def check_workflow(name: str) -> None:
    if name not in WORKFLOWS:
        raise ConfigError(f"workflow {name!r} is not known; known: {', '.join(WORKFLOWS)}")


def run_math_workflow(
    engine: RolloutEngine,
    tasks: Sequence[Task],
    *,
    reward: RewardFn,
    repeat_times: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    run: str,
    explorer: str,
    model_version: int,
    explorer_step: int = -1,
) -> list[ExperienceGroup]:
    """Sample ``repeat_times`` responses per task in one batch and score them."""
    batches = engine.rollout(
        [t.prompt for t in tasks], repeat_times, temperature, max_new_tokens, seed
    )
    groups = []
    now = time.time()
    for task, rollouts in zip(tasks, batches, strict=True):
        gid = make_group_id(run, task.id, task.epoch)
        exps = []
        for i, r in enumerate(rollouts):
            value, info = reward(r.text, task)
            info = {**info, "response_length": float(len(r.response_ids))}
            exps.append(
                Experience(
                    id=f"{gid}#{i}",
                    tokens=pack_i32(r.prompt_ids + r.response_ids),
                    prompt_length=len(r.prompt_ids),
                    logprobs=pack_f32(r.logprobs),
                    action_mask=pack_u8([1] * len(r.response_ids)),
                    reward=value,
                    model_version=model_version,
                    response_text=r.text,
                    info=info,
                )
            )
        groups.append(
            ExperienceGroup(
                id=gid,
                run=run,
                task_id=task.id,
                explorer=explorer,
                model_version=model_version,
                experiences=exps,
                created_at=now,
                workflow=task.workflow,
                epoch=task.epoch,
                explorer_step=explorer_step,
            )
        )
    return groups
