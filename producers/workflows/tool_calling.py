"""The ``tool_calling`` workflow: multi-turn episodes against the local tools.

:func:`~streamrft.producers.workflows.multi_turn.run_episodes` with the ``tools``
environment (:class:`~streamrft.producers.workflows.environments.ToolEnvironment`:
``calculator`` and ``lookup``) unless a task names another in ``metadata["env"]``. The
policy calls a tool in its chat template's format when the template takes ``tools``
(the Hermes ``<tool_call>{...}</tool_call>`` format of Qwen-style templates), else in the
plain-text format ``<tool>calculator(2+3)</tool>`` (explained in a system message to a
chat model, learned from demonstrations by a raw-format one); the result comes back as a
``tool`` message (never trained), and a turn without a call is the final answer, which
the configured reward scores (0 when the task's ``metadata["expected_call"]`` was not
made).
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrft.producers.engines.base import RolloutEngine
from streamrft.producers.rewards import RewardFn
from streamrft.producers.workflows.base import RolloutSpec
from streamrft.producers.workflows.multi_turn import run_episodes
from streamrft.schemas.experience import ExperienceGroup, Task

TOOLS_ENV = "tools"
"""The environment of ``tool_calling`` tasks that name none."""


def tool_calling_workflow(
    engine: RolloutEngine, tasks: Sequence[Task], reward: RewardFn, spec: RolloutSpec
) -> list[ExperienceGroup]:
    """Episodes with the local tools, one group of ``spec.repeat_times`` per task."""
    return run_episodes(engine, tasks, reward, spec, TOOLS_ENV)
