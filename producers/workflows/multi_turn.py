"""The ``multi_turn`` workflow: episodes of several policy turns, each answered by an
environment, recorded as one experience per episode covering the whole conversation.

Per task, ``spec.repeat_times`` episodes (one experience group). Episodes of all tasks
advance turn by turn: one ``engine.rollout`` call per turn over every live episode
(``n=1`` each). After a policy turn the episode's environment
(:mod:`~streamrft.producers.workflows.environments`, the task's ``metadata["env"]`` or the
workflow's default) reads the turn's text and gives the next message (a tool result, a
user turn) or ends the episode.

The experience: ``prompt`` = the first rendered prompt; ``response`` = everything after
it. The policy's own sampled tokens have ``action_mask`` 1 and their sampled log-probs;
every token the environment inserts (tool results, user turns, the chat template's glue
between turns) has mask 0 and log-prob 0.0, so the trainer never trains on it. The
sequence is built by appending token ids, never by re-tokenizing the conversation's text
(that could split the policy's text into other tokens than it sampled): each next turn is
sampled from exactly the ids recorded (:mod:`~streamrft.producers.workflows.conversation`).

Bounds, per task by metadata (integers as strings) or by default: ``max_turns`` policy
turns (default :data:`MAX_TURNS`), and ``max_tokens`` in the whole sequence (default: the
model's ``max_position_embeddings``, else :data:`MAX_TOKENS`). A policy turn samples at
most ``spec.max_new_tokens`` and never past the budget (the first turn samples at least
one token whatever the prompt's length); an episode ends, ``truncated``, when a turn would
not fit, or at ``max_turns`` with a message still to insert.

Partial rollouts (``explorer.partial_rollout``, ``spec.refresh``): before every turn but
the first the explorer may apply a newer version (between two engine calls, never inside
one); each turn's tokens carry the version that sampled them (the engine's stamp), and an
episode sampled by several versions records where each one's tokens begin
(``Experience.segments``), its ``model_version`` being the oldest.

Reward: the environment's own reward of the episode when it gives one, else the
configured reward on the last policy turn's text. ``info``: the reward's and the
environment's numbers, ``turns``, ``truncated``, ``response_length`` (policy tokens) and
``episode_length`` (all tokens after the prompt).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.producers.rewards import RewardFn, score_all
from streamrft.producers.workflows.base import RolloutSpec, task_group
from streamrft.producers.workflows.conversation import TurnRenderer
from streamrft.producers.workflows.environments import Environment, Message, make_environment
from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import Experience, ExperienceGroup, Segment, Task

MAX_TURNS = 8
"""Policy turns per episode unless the task's ``metadata["max_turns"]`` says otherwise."""
MAX_TOKENS = 4096
"""Token budget of an episode when neither the task nor the model's config gives one."""
_TURN_SEED = 1_000_003
"""Turn ``t`` of a step samples with seed ``spec.seed + t * _TURN_SEED``."""


@dataclass
class Episode:
    """One conversation being played: its ids so far and what the trainer is to learn."""

    task: Task
    env: Environment
    turns: TurnRenderer
    conversation: list[Message]
    prompt_ids: list[int]
    max_turns: int
    budget: int
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_turns: int = 0
    last_text: str = ""
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    segments: list[Segment] = field(default_factory=list)
    """Where each version's policy tokens begin in :attr:`response`, oldest first."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response

    def room(self) -> int:
        """Tokens the next policy turn may sample (at least 1 for the first turn)."""
        left = self.budget - len(self.prompt_ids) - len(self.response)
        return max(left, 1) if self.policy_turns == 0 else left

    def add_policy(self, rollout: Rollout, limit: int, tokenizer, step_version: int) -> None:
        """Append a policy turn, cut to ``limit`` tokens (a prefix of a sample is a sample
        of the shorter length: its log-probs are unchanged), sampled by the rollout's
        version (``step_version`` when the engine did not stamp one)."""
        ids, logps = rollout.response_ids[:limit], rollout.logprobs[:limit]
        text = rollout.text
        if len(ids) < len(rollout.response_ids):
            text = tokenizer.decode(ids, skip_special_tokens=True)
        version = rollout.sampled_by(step_version)
        if not self.segments:  # the first one covers the response from its start
            self.segments.append(Segment(start=0, version=version))
        elif ids and version > self.segments[-1].version:
            self.segments.append(Segment(start=len(self.response), version=version))
        self.response += ids
        self.mask += [1] * len(ids)
        self.logprobs += logps
        self.policy_turns += 1
        self.last_text = text
        self.conversation.append({"role": "assistant", "content": text})

    def advance(self, policy_ids: list[int]) -> None:
        """The environment's answer to the last policy turn: insert it, or end."""
        step = self.env.step(self.last_text)
        if step.reward is not None:
            self.reward = step.reward
        if step.done or step.message is None:
            self.done = True
            return
        if self.policy_turns >= self.max_turns:
            self.done = self.truncated = True
            return
        glue = self.turns.glue(self.conversation, policy_ids, step.message)
        if len(self.prompt_ids) + len(self.response) + len(glue) >= self.budget:
            self.done = self.truncated = True  # no room left for a policy token after it
            return
        self.response += glue
        self.mask += [0] * len(glue)
        self.logprobs += [0.0] * len(glue)
        self.conversation.append(step.message)


def _bound(task: Task, key: str, default: int) -> int:
    """A positive integer from the task's metadata, else ``default``."""
    value = task.metadata.get(key)
    if value is None:
        return default
    if not value.isdigit() or int(value) < 1:
        raise SchemaError(
            f"task {task.id!r}: metadata[{key!r}] {value[:40]!r} is not an integer >= 1"
        )
    return int(value)


def model_budget(engine: RolloutEngine) -> int:
    """The model's context length (``config.max_position_embeddings``), else MAX_TOKENS."""
    config = getattr(engine.model, "config", None)
    return int(getattr(config, "max_position_embeddings", None) or MAX_TOKENS)


def start_episode(
    task: Task, engine: RolloutEngine, spec: RolloutSpec, default_env: str
) -> Episode:
    """A fresh episode of ``task``: its environment reset, its first prompt rendered."""
    env = make_environment(task, default_env)
    turns = TurnRenderer(spec.renderer(engine), env.tools)
    conversation, prompt_ids = turns.start(env.reset(task))
    return Episode(
        task,
        env,
        turns,
        conversation,
        prompt_ids,
        max_turns=_bound(task, "max_turns", MAX_TURNS),
        budget=_bound(task, "max_tokens", model_budget(engine)),
    )


def play(engine: RolloutEngine, episodes: list[Episode], spec: RolloutSpec) -> None:
    """Play ``episodes`` to their ends: one engine call per turn over the live ones."""
    turn = 0
    while live := [e for e in episodes if not e.done]:
        if turn and spec.refresh is not None:
            spec.refresh()  # a partial rollout: newer weights between two turns
        limits = [min(spec.max_new_tokens, e.room()) for e in live]
        samples = engine.rollout(
            [e.ids for e in live],
            1,
            spec.temperature,
            max(limits),
            spec.seed + turn * _TURN_SEED,
        )
        for episode, limit, (rollout,) in zip(live, limits, samples, strict=True):
            episode.add_policy(rollout, limit, engine.tokenizer, spec.model_version)
            episode.advance(rollout.response_ids[:limit])
        turn += 1


def experience(
    eid: str, e: Episode, scored: tuple[float, dict[str, float]], tokenizer
) -> Experience:
    """The played episode as one experience (see the module docstring for what is
    trained), with its reward and the reward's info (``scored``); its version: its first
    segment's (every turn adds to one)."""
    value, info = scored
    return Experience(
        id=eid,
        tokens=pack_i32(e.ids),
        prompt_length=len(e.prompt_ids),
        logprobs=pack_f32(e.logprobs),
        action_mask=pack_u8(e.mask),
        reward=value,
        model_version=e.segments[0].version,
        segments=e.segments if len(e.segments) > 1 else [],
        response_text=tokenizer.decode(e.response),
        info={
            **info,
            **e.env.info(),
            "turns": float(e.policy_turns),
            "truncated": float(e.truncated),
            "response_length": float(sum(e.mask)),
            "episode_length": float(len(e.response)),
        },
    )


def _experiences(group: list[Episode], reward: RewardFn, tokenizer, gid: str) -> list[Experience]:
    """The experiences of group ``gid``: one per episode, those the environment did not
    reward scored together by ``reward`` on their last policy turn."""
    unscored = [e for e in group if e.reward is None]
    by_reward = iter(score_all(reward, [(e.last_text, e.task) for e in unscored]))
    scored = [next(by_reward) if e.reward is None else (e.reward, {}) for e in group]
    return [
        experience(f"{gid}#{i}", e, s, tokenizer)
        for i, (e, s) in enumerate(zip(group, scored, strict=True))
    ]


def run_episodes(
    engine: RolloutEngine,
    tasks: Sequence[Task],
    reward: RewardFn,
    spec: RolloutSpec,
    default_env: str = "conversation",
) -> list[ExperienceGroup]:
    """``spec.repeat_times`` episodes per task, played together; one group per task."""
    episodes = [
        [start_episode(t, engine, spec, default_env) for _ in range(spec.repeat_times)]
        for t in tasks
    ]
    play(engine, [e for group in episodes for e in group], spec)
    now = time.time()
    return [
        task_group(
            task,
            spec,
            now,
            functools.partial(_experiences, group, reward, engine.tokenizer),
        )
        for task, group in zip(tasks, episodes, strict=True)
    ]


def multi_turn_workflow(
    engine: RolloutEngine, tasks: Sequence[Task], reward: RewardFn, spec: RolloutSpec
) -> list[ExperienceGroup]:
    """The ``multi_turn`` workflow: :func:`run_episodes` with the ``conversation``
    environment unless a task names another."""
    return run_episodes(engine, tasks, reward, spec, "conversation")
