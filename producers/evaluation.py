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
from streamrft.infra.prompts import PromptRenderer
from streamrft.infra.taskset import read_taskset, read_training_set
from streamrft.producers.engines import RolloutEngine, TransformersEngine
from streamrft.producers.rewards import RewardFn, get_reward
from streamrft.schemas.experience import Task


def greedy_accuracy(
    engine: RolloutEngine,
    tasks: list[Task],
    reward: RewardFn,
    max_new_tokens: int,
    batch: int = 256,
    prompts: PromptRenderer | None = None,
) -> float:
    """Mean reward of greedy responses (accuracy for 0/1 rewards). ``prompts`` renders the
    tasks as the explorer does (None: the default renderer around the engine's tokenizer)."""
    render = prompts or PromptRenderer(engine.tokenizer)
    total = 0.0
    for lo in range(0, len(tasks), batch):
        chunk = tasks[lo : lo + batch]
        for task, text in zip(
            chunk, engine.greedy(render.batch(chunk), max_new_tokens), strict=True
        ):
            total += reward(text, task)[0]
    return total / len(tasks)


class GreedyEvaluator:
    """``evaluator(model, tokenizer) -> {"eval/accuracy": ...}`` on ``taskset.eval_path``
    (the training taskset when none is given), scored with ``explorer.reward``."""

    def __init__(self, cfg: Config) -> None:
        t = cfg.taskset
        self.tasks = read_taskset(t.eval_path, t) if t.eval_path else read_training_set(t)
        self.taskset = cfg.taskset
        self.reward = get_reward(cfg.explorer.reward, cfg.explorer.reward_skips_thinking)
        self.max_new_tokens = cfg.explorer.max_new_tokens

    def __call__(self, model: torch.nn.Module, tokenizer: Any) -> dict[str, float]:
        engine = TransformersEngine(model, tokenizer)
        prompts = PromptRenderer.from_config(self.taskset, tokenizer)
        accuracy = greedy_accuracy(
            engine, self.tasks, self.reward, self.max_new_tokens, prompts=prompts
        )
        return {"eval/accuracy": accuracy}


def is_correct(value: float, info: dict[str, float]) -> bool:
    """Whether a scored response counts as correct (pass@k): the reward's own ``correct``
    entry when it reports one (a format bonus is not correctness), else the full reward."""
    return info["correct"] > 0 if "correct" in info else value >= 1.0


def correct_counts(
    engine: RolloutEngine,
    tasks: list[Task],
    reward: RewardFn,
    n: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    batch: int = 256,
    prompts: PromptRenderer | None = None,
) -> list[int]:
    """Per task, how many of ``n`` samples at ``temperature`` are correct (:func:`is_correct`):
    what pass@k is computed from (:mod:`.pass_at_k`). ``batch``: sequences per engine call;
    ``prompts`` as for :func:`greedy_accuracy`. The same ``seed`` draws the same samples."""
    render = prompts or PromptRenderer(engine.tokenizer)
    per_call = max(1, batch // n)
    counts = []
    for lo in range(0, len(tasks), per_call):
        chunk = tasks[lo : lo + per_call]
        groups = engine.rollout(render.batch(chunk), n, temperature, max_new_tokens, seed + lo)
        for task, group in zip(chunk, groups, strict=True):
            counts.append(sum(is_correct(*reward(r.text, task)) for r in group))
    return counts
