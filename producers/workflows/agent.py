"""The ``agent`` workflow: your agent code, unchanged, talks to the policy through an
OpenAI client, and every completion it asks for becomes an experience.

``explorer.agent: "package.module:function"`` names a plain function called once per
episode (``explorer.repeat_times`` episodes per task, ``explorer.agent_concurrency`` at a
time) as ``function(task, base_url, model)``. ``base_url`` is this explorer's recording
endpoint for that episode (:mod:`streamrft.producers.serving.endpoint`): point any OpenAI
client at it (``openai.OpenAI(base_url=base_url, api_key="none")``) and call
``chat.completions`` / ``completions`` with ``model``, as many turns and tools as the agent
likes. The function returns the episode's reward (a float, or ``(float, info)``), or None
to score the last response with ``explorer.reward``.

An episode is recorded as one experience per conversation it holds
(``explorer.agent_record: episode``, :mod:`streamrft.producers.serving.episodes`): a
request that continues an earlier response of the episode (the tool results or the next
user turn after it) extends that response's experience by appending token ids, the mask 1
only on the policy's own tokens; an agent that rewrote its history starts a new one
(counted). ``completion``: each completion is its own experience. Every experience of an
episode gets the episode's reward; the task's group holds those of all its episodes (a
GRPO group: the episodes of one task). An episode that raises is dropped (and logged); a
task none of whose episodes produced a completion yields no group.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import msgspec

from streamrft.producers.engines.base import RolloutEngine
from streamrft.producers.rewards import RewardFn, import_function
from streamrft.producers.serving.endpoint import RecordingEndpoint, recording_endpoint
from streamrft.producers.workflows.base import RolloutSpec, task_group
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Experience, ExperienceGroup, Task

log = logging.getLogger(__name__)

AGENT_WORKFLOW = "agent"


def agent_workflow(
    engine: RolloutEngine, tasks: Sequence[Task], reward: RewardFn, spec: RolloutSpec
) -> list[ExperienceGroup]:
    """Run ``spec.repeat_times`` episodes of the agent per task; one group per task."""
    if not spec.agent:
        raise ConfigError("explorer.agent: the agent workflow needs 'package.module:function'")
    agent = import_function(
        spec.agent, "explorer.agent", ("task", "base_url", "model"), "-> reward"
    )
    endpoint = recording_endpoint(engine, spec.renderer(engine), spec.run, spec.explorer)
    endpoint.prepare(
        spec.model_version,
        spec.temperature,
        spec.max_new_tokens,
        spec.agent_record,
        spec.corrected,
        max_batch=spec.agent_concurrency,  # every episode running at once: one engine call
    )
    episodes = [(task, i) for task in tasks for i in range(spec.repeat_times)]
    done = _map_on_daemon_threads(
        lambda ep: _episode(agent, endpoint, reward, *ep), episodes, spec.agent_concurrency
    )
    now = time.time()
    groups = []
    for task in tasks:
        experiences = [
            e for (t, _), exps in zip(episodes, done, strict=True) if t is task for e in exps
        ]
        if experiences:
            groups.append(task_group(task, spec, now, partial(_numbered, experiences)))
        else:
            log.warning("%s: task %r: no episode produced a completion", spec.explorer, task.id)
    return groups


def _episode(
    agent, endpoint: RecordingEndpoint, reward: RewardFn, task: Task, index: int
) -> list[Experience]:
    """One episode: the agent's completions, rewarded (none if it raised)."""
    episode = f"{index}-{secrets.token_hex(8)}"
    try:
        result = agent(task, endpoint.base_url(episode), endpoint.model_name)
    except Exception as exc:  # the user's code: any failure drops the episode, loudly
        log.warning("agent episode %d of task %r failed: %r", index, task.id, exc)
        endpoint.recorder.take(episode, 0.0)  # forget what it recorded
        return []
    try:
        value, info = _reward_of(result, endpoint, episode, reward, task)
    except Exception as exc:  # a return value that is no reward: the episode dropped, loudly
        log.warning("agent episode %d of task %r returned no reward: %r", index, task.id, exc)
        endpoint.recorder.take(episode, 0.0)  # forget what it recorded
        return []
    experiences = endpoint.collect(episode, value)
    return [
        msgspec.structs.replace(e, info={**e.info, **info, "episode": float(index)})
        for e in experiences
    ]


def _reward_of(
    result, endpoint: RecordingEndpoint, episode: str, reward: RewardFn, task: Task
) -> tuple[float, dict[str, float]]:
    """The agent's return value as (reward, info); None: ``explorer.reward`` of the last
    response the episode got."""
    if isinstance(result, tuple):
        value, info = result
        return float(value), dict(info)
    if result is not None:
        return float(result), {}
    group = endpoint.recorder.groups.get(episode)
    last = list(group.responses.values())[-1].text if group else ""
    return reward(last, task)


def _numbered(experiences: list[Experience], gid: str) -> list[Experience]:
    return [msgspec.structs.replace(e, id=f"{gid}#{i}") for i, e in enumerate(experiences)]


def _map_on_daemon_threads(fn: Callable[[Any], Any], items: list, workers: int) -> list:
    """``[fn(item) for item in items]`` on up to ``workers`` daemon threads: an agent stuck
    for good (a tool that never answers) never keeps the explorer from exiting, as a
    thread pool's worker would."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    order = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None or errors:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # re-raised by the caller
                errors.append(exc)

    threads = [
        threading.Thread(target=work, name="agent", daemon=True)
        for _ in range(min(workers, len(items)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
