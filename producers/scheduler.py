"""The rollout scheduler: one explorer step's workflow calls, concurrent, bounded, retried.

A step's tasks are split into *calls* (:class:`Call`): the tasks of one workflow, up to
``explorer.tasks_per_call`` of them (0: all, the most batched engine use). Up to
``explorer.calls_in_flight`` calls run at once, each on a thread, so a slow call (a long
multi-turn episode, an agent waiting on a tool) does not hold up the others. A call that
raises, runs past ``explorer.task_timeout_s`` or returns no group for some of its tasks is
split: each of those tasks is tried again alone, up to ``explorer.task_retries`` times,
then given up (:attr:`BatchOutcome.failed`, which the explorer dead-letters with the
reason). A call past its timeout is abandoned, not stopped (a thread cannot be): its result
is ignored when it comes.

The batch's lifecycle: it is *finalised* when every call has ended (the explorer then
publishes the groups, dead-letters the failures and commits the tasks); on a stop it is
*aborted*: no new call starts, the calls running are awaited, and the groups they made are
returned as partial results (the explorer publishes them but commits nothing: the tasks are
explored again after a restart, and the trainer drops the duplicate groups by id). Calls
still running :data:`INTERRUPT_AFTER_S` after the stop are interrupted (the ``interrupt``
the scheduler was given: the engine's, which ends a long generation between two tokens),
so a stopping explorer exits within its supervisor's grace; what a call returns after the
interrupt is dropped (a workflow may have made a group of the episodes that ended first),
and its tasks are explored again after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamrft.infra.daemon_call import on_daemon_thread
from streamrft.schemas.experience import ExperienceGroup, Task

log = logging.getLogger(__name__)

RunCall = Callable[[str, list[Task], int], list[ExperienceGroup]]
"""``(workflow, tasks, seed) -> groups``: one blocking workflow call (run on a thread)."""

RETRY_SEED_STRIDE = 104_729
"""A retried task's seed moves by this much per attempt (a different sample)."""
INTERRUPT_AFTER_S = 2.0
"""How long an aborted batch waits for its running calls before interrupting them (the
supervisor gives a signalled process 5 s)."""


@dataclass(frozen=True)
class SchedulerLimits:
    """The ``explorer.*`` settings of the scheduler."""

    tasks_per_call: int = 0
    calls_in_flight: int = 4
    timeout_s: float = 0.0
    retries: int = 2


@dataclass
class Call:
    """Tasks of one workflow sampled by one workflow call."""

    workflow: str
    tasks: list[Task]
    seed: int
    attempt: int = 0


@dataclass
class BatchOutcome:
    """What a batch's calls made."""

    groups: list[ExperienceGroup] = field(default_factory=list)
    failed: list[tuple[Task, str]] = field(default_factory=list)
    """Tasks given up, with the last reason."""
    aborted: bool = False
    retried: int = 0
    """Task attempts beyond the first."""


def plan_calls(tasks: Sequence[Task], tasks_per_call: int, seed: int) -> list[Call]:
    """The step's calls: tasks of one workflow together (in first-seen order), in chunks
    of ``tasks_per_call`` (0: one call per workflow), each with its own seed."""
    by_workflow: dict[str, list[Task]] = {}
    for task in tasks:
        by_workflow.setdefault(task.workflow, []).append(task)
    calls: list[Call] = []
    for name, group in by_workflow.items():
        size = tasks_per_call or len(group)
        for start in range(0, len(group), size):
            calls.append(Call(name, group[start : start + size], seed + len(calls) * 7_919))
    return calls


class RolloutScheduler:
    """Runs a step's calls (see the module docstring)."""

    def __init__(
        self,
        run_call: RunCall,
        limits: SchedulerLimits,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        self.run_call = run_call
        self.limits = limits
        self.interrupt = interrupt
        """Stops the running calls' sampling (the engine's ``interrupt``); None: none."""

    async def run(self, tasks: Sequence[Task], seed: int, stop: asyncio.Event) -> BatchOutcome:
        """Sample ``tasks``; ends when every call has, or early on ``stop`` (aborted)."""
        out = BatchOutcome()
        queue = plan_calls(tasks, self.limits.tasks_per_call, seed)
        running: set[asyncio.Task] = set()
        interrupt_at: float | None = None  # an aborted batch's: when to interrupt its calls
        interrupted = False
        while queue or running:
            while queue and len(running) < self.limits.calls_in_flight and not stop.is_set():
                call = queue.pop(0)
                running.add(asyncio.create_task(self._attempt(call), name=call.workflow))
            if stop.is_set() and not out.aborted:
                out.aborted, queue = True, []
                log.info("batch aborted: waiting for %d running workflow calls", len(running))
                if self.interrupt is not None:
                    interrupt_at = time.monotonic() + INTERRUPT_AFTER_S
            if not running:
                break
            waits: set[asyncio.Future] = set(running)
            stopping = None if out.aborted else asyncio.ensure_future(stop.wait())
            if stopping is not None:  # once aborted, only the running calls are waited for
                waits.add(stopping)
            timeout = None if interrupt_at is None else max(0.0, interrupt_at - time.monotonic())
            done, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if stopping is not None:
                stopping.cancel()
            if not done and interrupt_at is not None and self.interrupt is not None:
                log.info("interrupting %d workflow calls still sampling", len(running))
                self.interrupt()
                interrupt_at, interrupted = None, True
            for finished in done - {stopping}:
                running.discard(finished)
                if interrupted:  # a call cut short may return a partial group: none kept
                    continue
                queue += self._settle(finished.result(), out)
        return out

    async def _attempt(self, call: Call) -> tuple[Call, list[ExperienceGroup], str | None]:
        """Run ``call`` once: its groups, or the reason it failed as a whole."""
        work = on_daemon_thread(
            self.run_call, call.workflow, call.tasks, call.seed, name="workflow-call"
        )
        timeout = self.limits.timeout_s or None
        try:
            return call, await asyncio.wait_for(work, timeout), None
        except asyncio.TimeoutError:
            return call, [], f"workflow {call.workflow!r} timed out after {timeout:g}s"
        except Exception as exc:  # a workflow's failure, whatever it is, is the task's
            return call, [], f"workflow {call.workflow!r} raised {type(exc).__name__}: {exc}"

    def _settle(
        self, result: tuple[Call, list[ExperienceGroup], str | None], out: BatchOutcome
    ) -> list[Call]:
        """Keep a call's groups; the retries of its tasks that made none (none once the
        batch is aborted: those tasks are not committed, a restart explores them)."""
        call, groups, reason = result
        made = {(g.task_id, g.epoch) for g in groups}
        out.groups += groups
        if out.aborted:
            return []
        missing = [t for t in call.tasks if (t.id, t.epoch) not in made]
        reason = reason or f"workflow {call.workflow!r} returned no group for the task"
        retries = []
        for task in missing:
            if call.attempt < self.limits.retries:
                seed = call.seed + (call.attempt + 1) * RETRY_SEED_STRIDE
                retries.append(Call(call.workflow, [task], seed, call.attempt + 1))
                out.retried += 1
            else:
                out.failed.append((task, f"{reason} (attempt {call.attempt + 1})"))
        if missing:
            log.warning("%d task(s) of a %r call failed: %s", len(missing), call.workflow, reason)
        return retries
