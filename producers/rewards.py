"""Reward functions: ``(response text, task) -> (reward, info)``. Pure."""

from __future__ import annotations

import re
from collections.abc import Callable

from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task

RewardFn = Callable[[str, Task], tuple[float, dict[str, float]]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the response, stripped, equals the answer; else 0.0."""
    ok = response.strip() == task.answer.strip()
    return float(ok), {"correct": float(ok)}


def last_number(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the last number in the response equals the answer numerically."""
    found = _NUMBER.findall(response)
    try:
        ok = bool(found) and float(found[-1]) == float(task.answer)
    except ValueError:
        ok = False
    return float(ok), {"correct": float(ok), "has_number": float(bool(found))}


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "last_number": last_number}


def get_reward(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise ConfigError(
            f"explorer.reward: unknown reward {name!r}; known: {', '.join(REWARDS)}"
        ) from None
