"""Greedy evaluation of the trainer's current weights on the eval taskset."""

from __future__ import annotations

from streamrft.producers.engine import RolloutEngine
from streamrft.producers.rewards import RewardFn
from streamrft.schemas.experience import Task


def greedy_accuracy(
    engine: RolloutEngine,
    tasks: list[Task],
    reward: RewardFn,
    max_new_tokens: int,
    batch: int = 256,
) -> float:
    """Mean reward of greedy responses (accuracy for 0/1 rewards)."""
    total = 0.0
    for lo in range(0, len(tasks), batch):
        chunk = tasks[lo : lo + batch]
        for task, text in zip(
            chunk, engine.greedy([t.prompt for t in chunk], max_new_tokens), strict=True
        ):
            total += reward(text, task)[0]
    return total / len(tasks)
