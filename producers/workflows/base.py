"""What a workflow is: tasks in, experience groups out, with the engine and reward it is given."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines.base import RolloutEngine
from streamrft.producers.rewards import RewardFn
from streamrft.schemas.experience import Experience, ExperienceGroup, Task, make_group_id


@dataclass(frozen=True)
class RolloutSpec:
    """How one explorer step samples, and how its groups are stamped."""

    repeat_times: int
    """Rollouts per task (one experience group)."""
    temperature: float
    max_new_tokens: int
    seed: int
    """Seed of the step's sampling."""
    run: str
    """Run namespace (group ids are derived from it)."""
    explorer: str
    """Name of the explorer that publishes the groups."""
    model_version: int
    """Version of the weights that sampled."""
    explorer_step: int = -1
    prompts: PromptRenderer | None = None
    """Renders tasks into prompt token ids (``taskset.format``, ``taskset.system_prompt``);
    None: the defaults (``auto``, no system prompt) with the engine's tokenizer."""
    agent: str = ""
    """``module:function`` of the ``agent`` workflow (``explorer.agent``)."""
    agent_concurrency: int = 8
    """Episodes the ``agent`` workflow runs at once (``explorer.agent_concurrency``)."""
    agent_record: str = "episode"
    """How the ``agent`` workflow records an episode (``explorer.agent_record``)."""
    corrected: bool = False
    """The run's trainer corrects for a sampling distribution other than its policy's
    (``algorithm.off_policy_correction``): an agent's ``top_p`` / ``top_k`` are served."""
    refresh: Callable[[], None] | None = None
    """Applies the newest version the explorer may take, if newer than the engine's
    (``explorer.partial_rollout``); an episode workflow calls it between two turns, never
    during an engine call. None: the step's version for the whole step."""

    def renderer(self, engine: RolloutEngine) -> PromptRenderer:
        """:attr:`prompts`, or the default renderer around ``engine``'s tokenizer."""
        return self.prompts or PromptRenderer(engine.tokenizer)


class Workflow(Protocol):
    """Turns tasks that share a workflow name into one experience group per task.

    A workflow owns prompt formatting, turns and scoring; the engine owns sampling.
    """

    def __call__(
        self,
        engine: RolloutEngine,
        tasks: Sequence[Task],
        reward: RewardFn,
        spec: RolloutSpec,
    ) -> list[ExperienceGroup]: ...


def task_group(
    task: Task, spec: RolloutSpec, now: float, experiences: Callable[[str], list[Experience]]
) -> ExperienceGroup:
    """The group of ``task`` sampled under ``spec`` (id ``<run>/<task id>@<epoch>``, the same
    whichever explorer samples it); ``experiences(group_id)`` makes its experiences, whose
    ids are ``<group id>#<index>``. Its version: the oldest of its experiences' (a version
    applied during the step, ``explorer.partial_rollout``, may have sampled them), else
    the step's."""
    gid = make_group_id(spec.run, task.id, task.epoch)
    made = experiences(gid)
    return ExperienceGroup(
        id=gid,
        run=spec.run,
        task_id=task.id,
        explorer=spec.explorer,
        model_version=min((e.model_version for e in made), default=spec.model_version),
        experiences=made,
        created_at=now,
        workflow=task.workflow,
        epoch=task.epoch,
        explorer_step=spec.explorer_step,
    )
