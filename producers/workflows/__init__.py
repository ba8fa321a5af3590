"""Workflows: turn tasks into rollouts with rewards, i.e. one experience group per task.

A workflow is a function ``(engine, tasks, reward, spec) -> list[ExperienceGroup]`` (see
:class:`Workflow`) registered in :data:`WORKFLOWS` under the name tasks carry in their
``workflow`` field (default ``taskset.workflow``); adding one is a module here and a line in
that dict. ``math`` (the default) asks for the answer directly and scores it with
``explorer.reward``; ``expert`` turns a task's own answer into a trained response (SFT,
expert data); ``preference`` turns a task's answer and ``metadata["rejected"]`` into a
chosen/rejected pair (``dpo``); ``multi_turn`` plays episodes of several policy turns
against an environment (scripted user turns by default) and records each conversation as
one experience, trained only on the policy's own tokens (:mod:`.multi_turn`);
``tool_calling`` does the same against the local tools ``calculator`` and ``lookup``
(:mod:`.tool_calling`, :mod:`.tools`). Their environments are chosen by a task's
``metadata["env"]`` from :data:`~.environments.ENVIRONMENTS`. ``agent`` runs your own
agent code (``explorer.agent``) against an OpenAI-compatible endpoint of the policy that
records every completion (:mod:`.agent`).
"""

from __future__ import annotations

from streamrft.producers.workflows.agent import agent_workflow
from streamrft.producers.workflows.base import RolloutSpec, Workflow
from streamrft.producers.workflows.expert_workflow import expert_workflow
from streamrft.producers.workflows.math_workflow import math_workflow
from streamrft.producers.workflows.multi_turn import multi_turn_workflow
from streamrft.producers.workflows.preference_workflow import preference_workflow
from streamrft.producers.workflows.tool_calling import tool_calling_workflow
from streamrft.schemas.errors import ConfigError

WORKFLOWS: dict[str, Workflow] = {
    "math": math_workflow,
    "expert": expert_workflow,
    "preference": preference_workflow,
    "multi_turn": multi_turn_workflow,
    "tool_calling": tool_calling_workflow,
    "agent": agent_workflow,
}
"""Workflow name (a task's ``workflow``) -> workflow."""

__all__ = [
    "WORKFLOWS",
    "RolloutSpec",
    "Workflow",
    "check_workflow",
    "expert_workflow",
    "get_workflow",
    "math_workflow",
    "multi_turn_workflow",
    "preference_workflow",
    "tool_calling_workflow",
]


def get_workflow(name: str) -> Workflow:
    """The workflow registered as ``name``; a :class:`ConfigError` naming the known ones if none."""
    try:
        return WORKFLOWS[name]
    except KeyError:
        raise ConfigError(
            f"workflow {name!r} is not known (a task's workflow, default taskset.workflow); "
            f"known: {', '.join(WORKFLOWS)}"
        ) from None


def check_workflow(name: str) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a registered workflow."""
    get_workflow(name)
