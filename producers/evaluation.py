"""Evaluation of a policy on the eval taskset: greedy responses, scored by the run's reward.

One home for evaluation, whoever holds the policy: the trainer is handed a
:class:`GreedyEvaluator` by the application layer (``streamrft train``) and calls it with
its current weights; bench and serve modes call it with theirs. The trainer never names an
engine or a reward.
"""

from __future__ import annotations

from typing import Any

import torch

from streamrft.infra.config import Config
from streamrft.infra.taskset import read_taskset
from streamrft.producers.engines import RolloutEngine, TransformersEngine
from streamrft.producers.rewards import RewardFn, get_reward
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


class GreedyEvaluator:
    """``evaluator(model, tokenizer) -> {"eval/accuracy": ...}`` on ``taskset.eval_path``
    (the training taskset when none is given), scored with ``explorer.reward``."""

    def __init__(self, cfg: Config) -> None:
        path = cfg.taskset.eval_path or cfg.taskset.path
        self.tasks = read_taskset(path, cfg.taskset)
        self.reward = get_reward(cfg.explorer.reward)
        self.max_new_tokens = cfg.explorer.max_new_tokens

    def __call__(self, model: torch.nn.Module, tokenizer: Any) -> dict[str, float]:
        engine = TransformersEngine(model, tokenizer)
        accuracy = greedy_accuracy(engine, self.tasks, self.reward, self.max_new_tokens)
        return {"eval/accuracy": accuracy}
