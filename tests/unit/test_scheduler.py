"""The rollout scheduler: calls planned per workflow, run concurrently, retried alone,
given up with a reason, timed out, aborted on a stop."""

from __future__ import annotations

import asyncio
import threading
import time

from streamrft.producers import scheduler as scheduler_module
from streamrft.producers.scheduler import (
    RETRY_SEED_STRIDE,
    RolloutScheduler,
    SchedulerLimits,
    plan_calls,
)
from streamrft.schemas.errors import SamplingInterrupted
from streamrft.schemas.experience import ExperienceGroup, Task


def _task(i: int, workflow: str = "math") -> Task:
    return Task(id=f"t{i}", prompt="p", workflow=workflow)


def _group(task: Task) -> ExperienceGroup:
    return ExperienceGroup(
        id=f"r/{task.id}@0", run="r", task_id=task.id, explorer="e", model_version=0,
        experiences=[],
    )  # fmt: skip


def test_calls_are_planned_per_workflow_in_chunks_with_their_own_seeds():
    tasks = [_task(0), _task(1, "agent"), _task(2), _task(3), _task(4, "agent")]
    whole = plan_calls(tasks, 0, 100)
    assert [(c.workflow, [t.id for t in c.tasks], c.seed) for c in whole] == [
        ("math", ["t0", "t2", "t3"], 100),
        ("agent", ["t1", "t4"], 100 + 7_919),
    ]
    chunks = plan_calls(tasks, 2, 100)
    assert [[t.id for t in c.tasks] for c in chunks] == [["t0", "t2"], ["t3"], ["t1", "t4"]]
    assert len({c.seed for c in chunks}) == 3


def _run(run_call, tasks, limits, stop=None):
    async def main():
        return await RolloutScheduler(run_call, limits).run(tasks, 0, stop or asyncio.Event())

    return asyncio.run(main())


def test_a_failing_task_is_retried_alone_then_given_up_while_the_others_are_kept():
    attempts: dict[str, list[int]] = {}

    def run_call(workflow, tasks, seed):
        for t in tasks:
            attempts.setdefault(t.id, []).append(seed)
        if any(t.id == "t1" for t in tasks):
            raise ValueError("bad tool")
        if any(t.id == "t2" for t in tasks) and len(attempts["t2"]) == 1:
            return [_group(t) for t in tasks if t.id != "t2"]  # no group for t2, once
        return [_group(t) for t in tasks]

    out = _run(run_call, [_task(i) for i in range(4)], SchedulerLimits(retries=2))
    assert sorted(g.task_id for g in out.groups) == ["t0", "t2", "t3"]
    assert [(t.id, reason) for t, reason in out.failed] == [
        ("t1", "workflow 'math' raised ValueError: bad tool (attempt 3)")
    ]
    # the first call (all four) raised: each task alone again; t1 twice more, then given up
    assert {k: len(v) for k, v in attempts.items()} == {"t0": 2, "t1": 3, "t2": 2, "t3": 2}
    assert attempts["t1"][1] == attempts["t1"][0] + RETRY_SEED_STRIDE  # a different sample
    assert out.retried == 4 + 1 and not out.aborted


def test_a_task_the_workflow_made_no_group_for_is_tried_again():
    calls = []

    def run_call(workflow, tasks, seed):
        calls.append([t.id for t in tasks])
        return [_group(t) for t in tasks if not (t.id == "t1" and len(calls) == 1)]

    out = _run(run_call, [_task(0), _task(1)], SchedulerLimits())
    assert calls == [["t0", "t1"], ["t1"]]
    assert sorted(g.task_id for g in out.groups) == ["t0", "t1"] and out.retried == 1


def test_a_slow_call_does_not_hold_up_the_others_and_times_out():
    finished: list[str] = []
    release = threading.Event()

    def run_call(workflow, tasks, seed):
        if workflow == "slow":
            release.wait(5)  # held until the fast ones are done (or the timeout abandons it)
        finished.append(workflow)
        return [_group(t) for t in tasks]

    tasks = [_task(0, "slow"), _task(1, "a"), _task(2, "b")]
    limits = SchedulerLimits(calls_in_flight=3, timeout_s=0.5, retries=0)
    out = _run(run_call, tasks, limits)
    assert finished == ["a", "b"]  # the slow call was abandoned, not waited for
    release.set()
    assert sorted(g.task_id for g in out.groups) == ["t1", "t2"]
    assert out.failed == [(tasks[0], "workflow 'slow' timed out after 0.5s (attempt 1)")]


def test_calls_in_flight_bounds_the_threads_at_once():
    live, peak, lock = [0], [0], threading.Lock()

    def run_call(workflow, tasks, seed):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return [_group(t) for t in tasks]

    out = _run(
        run_call, [_task(i) for i in range(8)], SchedulerLimits(tasks_per_call=1, calls_in_flight=3)
    )
    assert len(out.groups) == 8 and peak[0] == 3


def test_a_stop_aborts_the_batch_keeping_what_the_running_calls_made():
    def run_call(workflow, tasks, seed):
        time.sleep(0.1)
        return [_group(t) for t in tasks]

    async def main():
        stop = asyncio.Event()
        scheduler = RolloutScheduler(run_call, SchedulerLimits(tasks_per_call=1, calls_in_flight=2))
        run = asyncio.create_task(scheduler.run([_task(i) for i in range(6)], 0, stop))
        await asyncio.sleep(0.02)
        stop.set()
        return await run

    out = asyncio.run(main())
    assert out.aborted and sorted(g.task_id for g in out.groups) == ["t0", "t1"]
    assert out.failed == []


def test_calls_still_running_after_a_stop_are_interrupted_and_their_tasks_left_uncommitted(
    monkeypatch,
):
    """A call that would sample for ever is interrupted INTERRUPT_AFTER_S after the stop;
    the call that ended first keeps its group, the interrupted task is neither retried
    nor given up (a restart explores it: the explorer commits nothing of an aborted step)."""
    monkeypatch.setattr(scheduler_module, "INTERRUPT_AFTER_S", 0.05)
    interrupted = threading.Event()
    started = threading.Event()

    def run_call(workflow, tasks, seed):
        if tasks[0].id == "t0":
            return [_group(t) for t in tasks]
        started.set()
        if not interrupted.wait(60):  # a generation far longer than any test
            return [_group(t) for t in tasks]
        raise SamplingInterrupted("sampling interrupted: the process is stopping")

    async def main():
        stop = asyncio.Event()
        limits = SchedulerLimits(tasks_per_call=1, calls_in_flight=2, retries=2)
        scheduler = RolloutScheduler(run_call, limits, interrupt=interrupted.set)
        run = asyncio.create_task(scheduler.run([_task(i) for i in range(4)], 0, stop))
        await asyncio.to_thread(started.wait, 60)
        stop.set()
        return await run

    out = asyncio.run(main())
    assert interrupted.is_set() and out.aborted
    assert [g.task_id for g in out.groups] == ["t0"]
    assert out.failed == [] and out.retried == 0


def test_without_an_interrupt_an_aborted_batch_waits_for_its_running_calls():
    release = threading.Event()
    started = threading.Event()

    def run_call(workflow, tasks, seed):
        started.set()
        release.wait(60)
        return [_group(t) for t in tasks]

    async def main():
        stop = asyncio.Event()
        scheduler = RolloutScheduler(run_call, SchedulerLimits(tasks_per_call=1, calls_in_flight=1))
        run = asyncio.create_task(scheduler.run([_task(0), _task(1)], 0, stop))
        await asyncio.to_thread(started.wait, 60)
        stop.set()
        await asyncio.sleep(0.2)  # well past an interrupt's delay, were there one
        assert not run.done()
        release.set()
        return await run

    out = asyncio.run(main())
    assert out.aborted and [g.task_id for g in out.groups] == ["t0"]


def test_what_a_call_returns_after_the_interrupt_is_dropped(monkeypatch):
    """A workflow that keeps the episodes that ended before the interrupt (the agent
    workflow drops the failed ones) returns a partial group: publishing it would have the
    trainer keep it and drop the whole group a restart makes (same id)."""
    monkeypatch.setattr(scheduler_module, "INTERRUPT_AFTER_S", 0.05)
    interrupted = threading.Event()
    started = threading.Event()

    def run_call(workflow, tasks, seed):
        started.set()
        interrupted.wait(60)
        return [_group(t) for t in tasks]  # made of whatever ended before the interrupt

    async def main():
        stop = asyncio.Event()
        limits = SchedulerLimits(tasks_per_call=1, calls_in_flight=1)
        scheduler = RolloutScheduler(run_call, limits, interrupt=interrupted.set)
        run = asyncio.create_task(scheduler.run([_task(0), _task(1)], 0, stop))
        await asyncio.to_thread(started.wait, 60)
        stop.set()
        return await run

    out = asyncio.run(main())
    assert interrupted.is_set() and out.aborted
    assert out.groups == [] and out.failed == []
