"""Evaluation of a policy on the eval taskset: greedy responses (and pass@k samples), scored
by the run's reward.

One home for evaluation, whoever holds the policy: the trainer is handed a
:class:`GreedyEvaluator` by the application layer (``streamrft train``) and calls it with
its current weights; the evaluator process (``producers/evaluator.py``) and checkpoint
scoring (``streamrft score``) measure their engine with an :class:`EvalSuite`. All three
read the same tasks (:func:`eval_tasks`) and compute the greedy reward by the same
function, so they agree on one set of weights. The trainer never names an engine or a
reward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from streamrft.infra.config import Config
from streamrft.infra.prompts import PromptRenderer
from streamrft.infra.taskset import read_taskset, read_training_set
from streamrft.producers.engines import RolloutEngine, TransformersEngine
from streamrft.producers.pass_at_k import mean_pass_at_k
from streamrft.producers.rewards import RewardFn, get_reward, score_all
from streamrft.schemas.experience import Task


def eval_tasks(cfg: Config) -> list[Task]:
    """The tasks evaluation runs on: ``eval.path`` (else the training taskset) read with the
    ``taskset`` section's rules, its first ``eval.max_tasks`` (0: all)."""
    e, t = cfg.eval, cfg.taskset
    tasks = read_taskset(e.path, t) if e.path else read_training_set(t)
    return tasks[: e.max_tasks] if e.max_tasks else tasks


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
        texts = engine.greedy(render.batch(chunk), max_new_tokens)
        total += sum(v for v, _ in score_all(reward, list(zip(texts, chunk, strict=True))))
    return total / len(tasks)


def greedy_scores(
    engine: RolloutEngine,
    tasks: list[Task],
    reward: RewardFn,
    max_new_tokens: int,
    prompts: PromptRenderer | None = None,
    batch: int = 256,
) -> tuple[float, float]:
    """(mean reward, fraction correct) of the greedy responses to ``tasks``, from one pass:
    the mean reward by :func:`greedy_accuracy` (the very function), correctness by
    :func:`is_correct` of each score."""
    verdicts: list[bool] = []

    def scored(text: str, task: Task) -> tuple[float, dict[str, float]]:
        value, info = reward(text, task)
        verdicts.append(is_correct(value, info))
        return value, info

    mean_reward = greedy_accuracy(engine, tasks, scored, max_new_tokens, batch, prompts)
    return mean_reward, sum(verdicts) / len(tasks)


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


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation of one set of weights measured."""

    greedy_reward: float
    """Mean reward of the greedy responses: ``eval/accuracy``, as the trainer reports it."""
    greedy_accuracy: float
    """Fraction of the greedy responses that are correct (:func:`is_correct`)."""
    pass_at_1: float | None
    """None when no samples were drawn (``k`` 0)."""
    pass_at_k: float | None
    k: int
    samples: int
    tasks: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The values of an evaluator's metrics event (``eval/*``)."""
        values = {
            "eval/accuracy": self.greedy_reward,
            "eval/greedy_accuracy": self.greedy_accuracy,
            "eval/tasks": float(self.tasks),
            "eval/seconds": self.seconds,
        }
        if self.pass_at_1 is not None and self.pass_at_k is not None:
            values["eval/pass@1"] = self.pass_at_1
            values[f"eval/pass@{self.k}"] = self.pass_at_k
            values["eval/samples"] = float(self.samples)
        return values


class EvalSuite:
    """The eval tasks, the reward and the lengths of ``cfg`` (``eval.*`` over
    ``explorer.*``), measured on whatever engine holds the weights."""

    def __init__(self, cfg: Config) -> None:
        e = cfg.eval
        self.tasks = eval_tasks(cfg)
        self.reward = get_reward(
            cfg.explorer.reward, cfg.explorer.reward_skips_thinking, cfg.reward
        )
        self.max_new_tokens = e.max_new_tokens or cfg.explorer.max_new_tokens
        self.temperature = e.temperature or cfg.explorer.temperature
        self.seed = cfg.run.seed
        self.batch = e.batch_size

    def measure(
        self, engine: RolloutEngine, prompts: PromptRenderer, k: int = 0, n: int = 0
    ) -> EvalResult:
        """Greedy reward and accuracy; with ``k`` > 0 also pass@1 and pass@k from ``n``
        samples per task (``n`` >= ``k``)."""
        t0 = time.perf_counter()
        reward, accuracy = greedy_scores(
            engine, self.tasks, self.reward, self.max_new_tokens, prompts, self.batch
        )
        pass_1 = pass_k = None
        if k:
            counts = correct_counts(
                engine,
                self.tasks,
                self.reward,
                n,
                self.temperature,
                self.max_new_tokens,
                self.seed,
                self.batch,
                prompts,
            )
            pass_1, pass_k = mean_pass_at_k(counts, n, 1), mean_pass_at_k(counts, n, k)
        return EvalResult(
            greedy_reward=reward,
            greedy_accuracy=accuracy,
            pass_at_1=pass_1,
            pass_at_k=pass_k,
            k=k,
            samples=n if k else 0,
            tasks=len(self.tasks),
            seconds=time.perf_counter() - t0,
        )


class GreedyEvaluator:
    """``evaluator(model, tokenizer) -> {"eval/accuracy": ..., "eval/greedy_accuracy": ...}``:
    the trainer's own evaluation of its weights (:class:`EvalSuite`'s greedy part)."""

    def __init__(self, cfg: Config) -> None:
        self.suite = EvalSuite(cfg)
        self.taskset = cfg.taskset

    @property
    def tasks(self) -> list[Task]:
        return self.suite.tasks

    def __call__(self, model: torch.nn.Module, tokenizer: Any) -> dict[str, float]:
        engine = TransformersEngine(model, tokenizer)
        prompts = PromptRenderer.from_config(self.taskset, tokenizer)
        result = self.suite.measure(engine, prompts)
        return {
            "eval/accuracy": result.greedy_reward,
            "eval/greedy_accuracy": result.greedy_accuracy,
        }


def trainer_evaluator(cfg: Config) -> GreedyEvaluator | None:
    """What the trainer evaluates its weights with: None when it does not
    (``eval.in_trainer``; by default, when ``streamrft run`` starts an evaluator)."""
    return GreedyEvaluator(cfg) if cfg.eval.trainer_evaluates else None
