"""An explorer step through the rollout scheduler on the real broker: a task whose
workflow keeps failing is retried, then dead-lettered with the reason, and the others are
published; a stop interrupts a generation still under way."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from aiokafka import TopicPartition

from streamrft.infra import admin
from streamrft.infra.consume import read_history
from streamrft.producers.explorer import Explorer
from streamrft.producers.task_intake import UNSTAMPED, Pending, Taken
from streamrft.schemas.codec import DEAD_LETTER, EXPERIENCE_GROUP, TASK
from streamrft.schemas.experience import Task
from tests.helpers import agents

pytestmark = pytest.mark.integration


def _tasks() -> list[Task]:
    modes = {"t1": "always", "t2": "once"}
    return [
        Task(id=f"t{i}", prompt=f"{i}+1=", answer=str(i + 1), workflow="agent",
             metadata={"fail": modes[f"t{i}"]} if f"t{i}" in modes else {})
        for i in range(4)
    ]  # fmt: skip


def test_a_task_that_keeps_failing_is_dead_lettered_and_the_rest_published(make_config):
    cfg = make_config(
        explorer={
            "agent": "tests.helpers.agents:flaky_agent",
            "repeat_times": 2,
            "tasks_per_call": 1,
            "calls_in_flight": 4,
            "task_retries": 2,
        }
    )
    agents.TRANSCRIPTS.clear()
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        explorer = Explorer(cfg, 0)
        async with contextlib.AsyncExitStack() as stack:
            await explorer._start(stack)
            explorer.follower.version = 0  # as if version 0 were applied
            items = [Pending(TopicPartition(topics.tasks, 0), i, t) for i, t in enumerate(_tasks())]
            await explorer.explore(Taken(UNSTAMPED, items))
        groups = await read_history(cfg.kafka, topics.experiences, EXPERIENCE_GROUP, "t-e", 3)
        letters = await read_history(cfg.kafka, topics.dead_letters, DEAD_LETTER, "t-d", 3)
        return explorer, groups, letters

    explorer, groups, letters = asyncio.run(scenario())
    assert sorted(g.task_id for g in groups) == ["t0", "t2", "t3"]
    # t2's first episode failed: the agent workflow drops that episode and keeps the other
    assert {g.task_id: len(g.experiences) for g in groups} == {"t0": 2, "t2": 1, "t3": 2}
    assert all(g.model_version == 0 for g in groups)
    (letter,) = letters
    assert (letter.source_topic, letter.partition, letter.offset) == (topics.tasks, 0, 1)
    assert TASK.decode(letter.value).id == "t1" and letter.error_type == "RolloutError"
    assert "returned no group" in letter.reason and "(attempt 3)" in letter.reason
    # t1: its 2 episodes, 3 times (the first call and 2 retries)
    assert len(agents.TRANSCRIPTS["flaky:t1"]) == 6
    assert explorer.counters["tasks_failed"] == 1 and explorer.counters["task_retries"] == 2
    assert explorer.step == 1


def test_a_stop_interrupts_a_long_generation_and_leaves_its_tasks_to_a_restart(make_config):
    """An explorer stopped in the middle of a generation that would run for ever (EOS
    never sampled) interrupts it between two tokens: the step ends without waiting for
    it, publishes nothing, dead-letters nothing and commits nothing (a restart explores
    those tasks again). At 7de3251 the step went on to the last token, which a supervisor
    stopping a CPU run of a real model ended with SIGKILL."""
    cfg = make_config(
        explorer={"repeat_times": 2, "max_new_tokens": 100_000, "tasks_per_call": 2},
        model={"max_positions": 100_032},
    )
    topics = cfg.topics()
    passes: list[int] = []
    interrupted = threading.Event()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        explorer = Explorer(cfg, 0)
        loop = asyncio.get_running_loop()
        eos = explorer.engine.tokenizer.eos_token_id

        def never_eos(_module, _inputs, logits):
            passes.append(1)
            if len(passes) == 20:  # well into the generation: the stop comes
                loop.call_soon_threadsafe(explorer.stop.set)
                assert interrupted.wait(60)  # this pass ends once the interrupt is in
            logits[..., eos] = -1e4
            return logits

        interrupt = explorer.scheduler.interrupt
        assert interrupt is not None  # the transformers engine can be interrupted

        def observed():
            interrupted.set()
            interrupt()

        explorer.scheduler.interrupt = observed
        explorer.engine.model.lm_head.register_forward_hook(never_eos)
        async with contextlib.AsyncExitStack() as stack:
            await explorer._start(stack)
            explorer.follower.version = 0
            tasks = [Task(id=f"t{i}", prompt=f"{i}+1=", answer=str(i + 1)) for i in range(4)]
            items = [Pending(TopicPartition(topics.tasks, 0), i, t) for i, t in enumerate(tasks)]
            await explorer.explore(Taken(UNSTAMPED, items))
        groups = await read_history(cfg.kafka, topics.experiences, EXPERIENCE_GROUP, "t-e", 1)
        letters = await read_history(cfg.kafka, topics.dead_letters, DEAD_LETTER, "t-d", 1)
        return explorer, groups, letters

    explorer, groups, letters = asyncio.run(scenario())
    assert interrupted.is_set() and len(passes) == 20
    assert groups == [] and letters == []
    assert explorer.step == 0  # the step ended before its commit (it counts after it)
