"""An in-process RL loop for learning tests of the algorithms: the real train engine
(``TorchTrainEngine``: the configured preset, reference model, corrections) and the real
rollout engine and workflow, with no broker between them.

The message path is covered by the end-to-end tests; what these tests vary is the math,
so they run the explorer's sampling and the trainer's step in one process, one after the
other. ``lag`` makes the explorer sample with the weights of ``lag`` versions ago (the
trainer's version minus ``lag``), as a run whose explorers run ahead would.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from streamrft.consumers.expert_data import ExpertSource
from streamrft.consumers.train_engine import TorchTrainEngine
from streamrft.consumers.warmup import sft_warmup
from streamrft.infra.config import Config, TasksetConfig, from_dict
from streamrft.infra.expert import PREFERENCE_WORKFLOW, REJECTED_KEY
from streamrft.infra.modeling import load_policy, save_policy
from streamrft.infra.taskset import read_taskset
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.evaluation import greedy_accuracy
from streamrft.producers.rewards import exact_match
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas.experience import Task

ADDITION = Path(__file__).resolve().parents[2] / "examples" / "data" / "addition.jsonl"
MAX_NEW_TOKENS = 4


def learning_config(
    algorithm: dict[str, Any],
    seed: int = 0,
    trainer: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> Config:
    """The default example's model and trainer settings with ``algorithm``; ``model``:
    more ``model`` settings (a wider charset, a longer context)."""
    return from_dict(
        {
            "run": {"seed": seed, "dir": "/nonexistent"},
            "taskset": {"path": str(ADDITION)},
            "model": {"max_positions": 32, "seed": seed, **(model or {})},
            "explorer": {"repeat_times": 8, "max_new_tokens": MAX_NEW_TOKENS},
            "trainer": {"lr": 5e-4, "ppo_epochs": 2, "max_staleness": 8, **(trainer or {})},
            "algorithm": algorithm,
        }
    )


_WARM: dict[int, dict[str, torch.Tensor]] = {}


def warm_start(seed: int) -> dict[str, torch.Tensor]:
    """The tiny model of ``seed`` after the default example's SFT warm-up (60 steps of 64,
    lr 3e-3): about 0.35 greedy accuracy. Computed once per seed and process."""
    if seed not in _WARM:
        cfg = learning_config({}, seed)
        torch.manual_seed(seed)
        model, tokenizer = load_policy(cfg.model, dtype=torch.float32)
        tasks = read_taskset(ADDITION, TasksetConfig())
        sft_warmup(model, tokenizer, tasks, steps=60, batch=64, lr=3e-3, seed=seed)
        _WARM[seed] = copy.deepcopy(model.state_dict())
    return _WARM[seed]


def sft_teacher(seed: int, steps: int, out: Path) -> float:
    """The tiny model of ``seed`` after :func:`warm_start` and ``steps`` more SFT steps (64
    a step, lr 3e-3), written as a Hugging Face folder ``out`` (a teacher for on-policy
    distillation); returns its greedy accuracy."""
    cfg = learning_config({}, seed)
    model, tokenizer = load_policy(cfg.model, dtype=torch.float32)
    model.load_state_dict(warm_start(seed))
    tasks = read_taskset(ADDITION, TasksetConfig())
    sft_warmup(model, tokenizer, tasks, steps=steps, batch=64, lr=3e-3, seed=seed + 1)
    save_policy(model, tokenizer, out)
    rollout = TransformersEngine(model, tokenizer)
    return greedy_accuracy(rollout, tasks, exact_match, MAX_NEW_TOKENS)


@dataclass
class Learned:
    accuracy_before: float
    accuracy_after: float
    rewards: list[float] = field(default_factory=list)
    """Mean sampled reward of each step."""
    metrics: list[dict[str, float]] = field(default_factory=list)
    """Each step's metrics from the train engine."""

    def reward_gain(self, window: int = 5) -> float:
        """Mean reward of the last ``window`` steps minus that of the first ``window``."""
        head, tail = self.rewards[:window], self.rewards[-window:]
        return sum(tail) / len(tail) - sum(head) / len(head)


def preference_tasks(tasks: list[Task]) -> list[Task]:
    """``tasks`` with a wrong answer as ``metadata["rejected"]`` (the ``preference``
    workflow's pairs): the answer plus or minus 1 to 3, by the task's position, never
    negative."""
    out = []
    for i, task in enumerate(tasks):
        answer, delta = int(task.answer), 1 + i % 3
        wrong = answer - delta if i % 2 and answer >= delta else answer + delta
        out.append(
            msgspec.structs.replace(task, metadata={**task.metadata, REJECTED_KEY: str(wrong)})
        )
    return out


def learn(
    algorithm: dict[str, Any],
    steps: int,
    seed: int = 0,
    tasks_per_step: int = 32,
    lag: int = 0,
    trainer: dict[str, Any] | None = None,
    workflow: str = "math",
    agent: str = "",
) -> Learned:
    """``steps`` steps of ``algorithm`` from :func:`warm_start` on groups of ``workflow``
    (``expert``: the tasks' answers); the explorer samples with the weights of version
    ``step - lag`` (at least 0). With the ``mix`` strategy (``chord``) each batch also
    gets the expert source's groups of the step, as the trainer's buffer adds them.
    ``preference``: pairs of each task's answer and a wrong one (:func:`preference_tasks`).
    ``agent``: the ``agent`` workflow's function (``explorer.agent``)."""
    cfg = learning_config(algorithm, seed, trainer)
    torch.manual_seed(seed)
    engine = TorchTrainEngine(cfg)
    engine.model.load_state_dict(warm_start(seed))
    engine.prepare()
    experts = None
    if engine.algo.spec.sample_strategy == "mix":
        experts = ExpertSource.from_config(cfg, engine.algo.spec, engine.tokenizer)
    explorer_model = copy.deepcopy(engine.model).eval()
    rollout = TransformersEngine(explorer_model, engine.tokenizer)
    tasks = read_taskset(ADDITION, TasksetConfig())
    before = greedy_accuracy(rollout, tasks, exact_match, MAX_NEW_TOKENS)
    if workflow == PREFERENCE_WORKFLOW:
        tasks = preference_tasks(tasks)
    versions: deque[dict[str, torch.Tensor]] = deque(maxlen=lag + 1)
    rng = random.Random(seed)
    out = Learned(before, 0.0)
    for step in range(steps):
        versions.append(copy.deepcopy(engine.model.state_dict()))
        explorer_model.load_state_dict(versions[0])  # ``lag`` versions behind, or v0
        spec = RolloutSpec(
            repeat_times=cfg.explorer.repeat_times,
            temperature=1.0,
            max_new_tokens=MAX_NEW_TOKENS,
            seed=1000 * seed + step,
            run="learn",
            explorer="explorer-0",
            model_version=max(0, step - lag),
            agent=agent,
            agent_concurrency=32,
        )
        groups = get_workflow(workflow)(
            rollout, rng.sample(tasks, tasks_per_step), exact_match, spec
        )
        rewards = [e.reward for g in groups for e in g.experiences]
        if experts is not None:
            groups += experts.take(step, step)
        metrics = engine.train_step(groups, step)
        out.rewards.append(sum(rewards) / len(rewards))  # of the samples only
        out.metrics.append(metrics)
    explorer_model.load_state_dict(engine.model.state_dict())
    out.accuracy_after = greedy_accuracy(rollout, tasks, exact_match, MAX_NEW_TOKENS)
    return out
