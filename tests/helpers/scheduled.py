"""One batch of tasks through the explorer's real rollout scheduler and math workflow, an
engine that answers a script, and a given reward: for the tests of how a reward's
failure reaches the scheduler's retries and give-ups."""

from __future__ import annotations

import asyncio

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.producers.rewards import RewardFn
from streamrft.producers.scheduler import BatchOutcome, RolloutScheduler, SchedulerLimits
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas import Task
from tests.helpers.scripted import CHARSET, ScriptedEngine

SPEC = RolloutSpec(
    repeat_times=2,
    temperature=1.0,
    max_new_tokens=4,
    seed=0,
    run="r",
    explorer="explorer-0",
    model_version=0,
)


def scheduled(
    reward: RewardFn, tasks: list[Task], answer: str = "7", retries: int = 1
) -> BatchOutcome:
    """The batch's outcome: each task's workflow call answers ``answer`` to every rollout
    and scores it with ``reward``; a failed call is retried ``retries`` times."""
    engine = ScriptedEngine(build_char_tokenizer(CHARSET), [answer])

    def call(workflow: str, batch: list[Task], seed: int):
        return get_workflow(workflow)(engine, batch, reward, SPEC)

    scheduler = RolloutScheduler(call, SchedulerLimits(0, 2, 0.0, retries))
    return asyncio.run(scheduler.run(tasks, 0, asyncio.Event()))
