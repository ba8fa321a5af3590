"""Workflows: turn tasks into rollouts with rewards, i.e. one experience group per task.

A workflow is a function ``(engine, tasks, reward, spec) -> list[ExperienceGroup]`` (see
:class:`Workflow`) registered in :data:`WORKFLOWS` under the name tasks carry in their
``workflow`` field (default ``taskset.workflow``); adding one is a module here and a line in
that dict. ``math`` (the default) asks for the answer directly and scores it with
``explorer.reward``; ``expert`` turns a task's own answer into a trained response (SFT,
expert data); ``preference`` turns a task's answer and ``metadata["rejected"]`` into a
chosen/rejected pair (``dpo``).
"""

from __future__ import annotations

from streamrft.producers.workflows.base import RolloutSpec, Workflow
from streamrft.producers.workflows.expert_workflow import expert_workflow
from streamrft.producers.workflows.math_workflow import math_workflow
from streamrft.producers.workflows.preference_workflow import preference_workflow
from streamrft.schemas.errors import ConfigError

WORKFLOWS: dict[str, Workflow] = {
    "math": math_workflow,
    "expert": expert_workflow,
    "preference": preference_workflow,
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
    "preference_workflow",
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
