"""Environments of the multi-turn workflows: what answers the policy between its turns.

An environment is a small object (:class:`Environment`): ``reset(task)`` gives the first
messages of the conversation, ``step(policy_text)`` reads a policy turn and gives the
next non-policy message (a tool result, a user turn), or ends the episode, optionally
with its own reward. One is made per episode from :data:`ENVIRONMENTS` by name: the
task's ``metadata["env"]``, else the workflow's default. Adding one is a class here (or
anywhere) and a line in that dict.

- ``conversation`` (``multi_turn``'s default): scripted user turns, ``metadata["turns"]``
  as a JSON list of strings; each policy turn is answered by the next one, and the episode
  ends after the policy answers the last (no turns: one policy turn, as ``math``).
- ``tools`` (``tool_calling``'s default): the local tools of
  :mod:`~streamrft.producers.workflows.tools`; a turn with a tool call gets the tool's
  result as a ``tool`` message, a turn without one is the final answer and ends the
  episode. ``metadata["expected_call"]`` (e.g. ``calculator(3+4)``): a call the policy
  must have made for any reward (without it the episode's reward is 0; with it the
  configured reward decides).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from streamrft.infra.prompts import chat_messages
from streamrft.producers.workflows.tools import TOOL_SCHEMAS, lookup_table, parse_call, run_call
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import Task

Message = dict[str, str]
"""A chat message: ``{"role": ..., "content": ...}``."""

ENV_KEY = "env"
"""The task metadata key that names a task's environment."""
TURNS_KEY = "turns"
"""The ``conversation`` environment's metadata key: a JSON list of user turns."""
EXPECTED_CALL_KEY = "expected_call"
"""The ``tools`` environment's metadata key: a call the policy must make for a reward."""


@dataclass(frozen=True)
class EnvStep:
    """What an environment answers to a policy turn."""

    message: Message | None
    """The next non-policy message (inserted, never trained); None: the episode ends."""
    done: bool = False
    """The episode ends here (a message given with it is not inserted)."""
    reward: float | None = None
    """The environment's own reward of the episode; None: the workflow's configured
    reward on the last policy turn decides (the last non-None one given wins)."""


class Environment(Protocol):
    """One episode's environment (made fresh per episode, so it may keep state)."""

    tools: list[dict]
    """JSON schemas of the tools the policy may call (empty: none); rendered by a chat
    template that takes ``tools``, else described in the plain-text format."""

    def reset(self, task: Task) -> list[Message]:
        """The conversation before the first policy turn (the task's messages or prompt)."""
        ...

    def step(self, policy_text: str) -> EnvStep:
        """Read the policy's turn (its decoded text) and answer it."""
        ...

    def info(self) -> dict[str, float]:
        """Numbers about the episode for the experience's ``info`` (tool calls...)."""
        ...


class ConversationEnvironment:
    """Scripted user turns from ``metadata["turns"]`` (a JSON list of strings)."""

    tools: list[dict] = []

    def __init__(self) -> None:
        self.turns: list[str] = []

    def reset(self, task: Task) -> list[Message]:
        try:
            turns = json.loads(task.metadata.get(TURNS_KEY, "[]"))
        except ValueError:
            turns = None
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise SchemaError(
                f"task {task.id!r}: metadata[{TURNS_KEY!r}] is not a JSON list of strings"
            )
        self.turns = turns
        return chat_messages(task)

    def step(self, policy_text: str) -> EnvStep:
        if not self.turns:
            return EnvStep(None, done=True)
        return EnvStep({"role": "user", "content": self.turns.pop(0)})

    def info(self) -> dict[str, float]:
        return {}


class ToolEnvironment:
    """The local tools: ``calculator`` and ``lookup`` (the task's ``metadata["lookup"]``)."""

    tools: list[dict] = TOOL_SCHEMAS

    def __init__(self) -> None:
        self.table: dict[str, str] | None = None
        self.expected: str | None = None
        self.calls: list[str] = []
        self.errors = 0

    def reset(self, task: Task) -> list[Message]:
        self.table = lookup_table(task.metadata)
        expected = task.metadata.get(EXPECTED_CALL_KEY)
        self.expected = None if expected is None else "".join(expected.split())
        return chat_messages(task)

    def step(self, policy_text: str) -> EnvStep:
        call = parse_call(policy_text)
        if call is None:  # a final answer
            missed = self.expected is not None and self.expected not in self.calls
            return EnvStep(None, done=True, reward=0.0 if missed else None)
        result = run_call(call, self.table)
        self.calls.append("".join(str(call).split()))
        self.errors += result.startswith("error:")
        return EnvStep({"role": "tool", "content": result})

    def info(self) -> dict[str, float]:
        info = {"tool_calls": float(len(self.calls)), "tool_errors": float(self.errors)}
        if self.expected is not None:
            info["expected_call"] = float(self.expected in self.calls)
        return info


ENVIRONMENTS: dict[str, type[Environment]] = {
    "conversation": ConversationEnvironment,
    "tools": ToolEnvironment,
}
"""Environment name (a task's ``metadata["env"]``) -> class, made once per episode."""


def make_environment(task: Task, default: str) -> Environment:
    """A fresh environment for ``task``: the one its ``metadata["env"]`` names, else
    ``default``; a :class:`SchemaError` naming the known ones for an unknown name."""
    name = task.metadata.get(ENV_KEY, default)
    try:
        return ENVIRONMENTS[name]()
    except KeyError:
        raise SchemaError(
            f"task {task.id!r}: metadata[{ENV_KEY!r}] names environment {name[:40]!r}, "
            f"which is not known; known: {', '.join(ENVIRONMENTS)}"
        ) from None
