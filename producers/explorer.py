"""The explorer process: tasks in, experience groups out, new weights applied at sync points.

One explorer step:
  take up to ``batch_size`` tasks of one batch (:class:`~.task_intake.TaskIntake`) ->
  sync point (:class:`~streamrft.sync.follower.WeightFollower`: the version that batch
  needs, waiting while this explorer is ahead of the trainer; received in the background
  as soon as it was announced, so mostly only its copy into the model is left) -> workflow
  (roll out and score) -> publish the groups (acks=all) -> commit the tasks' offsets ->
  metrics (with the step's sync times) and status.
A task's offset is committed only after its group is acknowledged by the broker, so an
explorer that dies mid-step loses nothing: its tasks are explored again (at-least-once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import time
from typing import Any

import msgspec
import torch

from streamrft.infra.bus import ControlView, Counters, EventSender, Position
from streamrft.infra.config import Config
from streamrft.infra.consume import Record
from streamrft.infra.modeling import model_device
from streamrft.infra.produce import OutRecord, fitting_records, send_all
from streamrft.infra.signals import install_stop_handlers
from streamrft.producers.policy import followed_policy, start_sampler
from streamrft.producers.rewards import get_reward
from streamrft.producers.samples import pick_samples, sample_records
from streamrft.producers.scheduler import RolloutScheduler, SchedulerLimits
from streamrft.producers.task_intake import UNSTAMPED, Taken, TaskIntake
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas.codec import TASK
from streamrft.schemas.errors import RolloutError, StreamRFTError
from streamrft.schemas.events import RunState
from streamrft.schemas.experience import ExperienceGroup, Task
from streamrft.sync.follower import Synced

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 60.0
"""How long a step may go on after the run's Shutdown before it is stopped."""
SAMPLE_SEND_S = 10.0
"""Longest try to publish a step's samples (best effort, after its groups)."""
SAMPLE_FAILURES = 3
"""Steps in a row whose samples failed after which an explorer makes no more."""
REFRESH_TIMEOUT_S = 600.0
"""Longest an episode waits between two turns for a newer version to be applied
(``explorer.partial_rollout``) before it goes on with the weights held."""


def explorer_identity(index: int | None) -> tuple[str, int]:
    """(component id, seed index). ``index``: the supervisor's numbering (``explorer-<i>``);
    None for an explorer started by hand, whose id ``explorer-<pid>-<4 hex>`` no numbered
    one has (its groups carry it in their ``explorer`` field; group ids do not, so a task
    that two explorers explored is trained once)."""
    if index is not None:
        return f"explorer-{index}", index
    tag = secrets.token_hex(2)
    return f"explorer-{os.getpid()}-{tag}", (os.getpid() << 16) + int(tag, 16)


class Explorer:
    def __init__(self, cfg: Config, index: int | None = None) -> None:
        self.cfg = cfg
        self.name, self.index = explorer_identity(index)
        self.topics = cfg.topics()
        self.stop = asyncio.Event()
        self.step = 0
        self.working = False
        """It holds tasks whose groups are not published yet (StatusEvent.working)."""
        self.counters = Counters()
        self.events = EventSender(cfg, self.name, "explorer", self.counters, self._position)
        self.view = ControlView(cfg, self.name, self.events.dead_letter, listen_status=True)
        torch.set_num_threads(cfg.explorer.threads)
        policy = followed_policy(cfg, self.name, self.view, self.events, self.counters, self.stop)
        self.engine, self.prompts, self.follower = policy.engine, policy.prompts, policy.follower
        self.scheduler = RolloutScheduler(
            self._call,
            SchedulerLimits(
                cfg.explorer.tasks_per_call,
                cfg.explorer.calls_in_flight,
                cfg.explorer.task_timeout_s,
                cfg.explorer.task_retries,
            ),
            interrupt=getattr(self.engine, "interrupt", None),
        )
        self.reward = get_reward(
            cfg.explorer.reward, cfg.explorer.reward_skips_thinking, cfg.reward
        )
        self.intake = TaskIntake(cfg, self.name, self.events, self.counters)
        self.producer: Any = None  # made in _start(), inside the event loop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sample_failures = 0
        """Steps in a row whose samples were not published."""
        self._showing: asyncio.Task[None] | None = None

    def _position(self) -> Position:
        held = self.follower.version
        return Position(step=self.step, version=held, working=self.working, ready=held >= 0)

    def _stopping(self) -> bool:
        """A stop signal or a Shutdown came; raises if the control reader failed (the
        Shutdown could never come)."""
        self.view.check()
        return self.stop.is_set() or self.view.shutdown.is_set()

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        install_stop_handlers(self.stop, self.name)
        async with contextlib.AsyncExitStack() as stack:  # stops what started, in reverse
            await self._start(stack)
            watch = asyncio.create_task(self._stop_after_shutdown(), name="shutdown-grace")
            stack.callback(watch.cancel)
            await self._loop()
            if self._showing is not None:  # the last step's samples, if they go at all
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._showing), SAMPLE_SEND_S)

    async def _stop_after_shutdown(self) -> None:
        """A Shutdown lets the step in progress finish; one still running
        :data:`SHUTDOWN_GRACE_S` later (a stuck workflow, no ``explorer.task_timeout_s``)
        is stopped as by a signal: what it made is published, nothing is committed."""
        await self.view.shutdown.wait()
        await asyncio.sleep(SHUTDOWN_GRACE_S)
        if not self.stop.is_set():
            log.warning(
                "%s: still busy %.0f s after the run's Shutdown; stopping the step",
                self.name,
                SHUTDOWN_GRACE_S,
            )
            self.stop.set()

    async def _loop(self) -> None:
        max_steps = self.cfg.explorer.max_steps
        while not self._stopping() and not (max_steps and self.step >= max_steps):
            assignments = self.intake.assignments  # a rebalance from here on: take again
            taken = await self.intake.take(
                self.cfg.explorer.batch_size, self._stopping, self.follower.broadcast_pending
            )
            self.working = bool(taken.tasks)
            try:
                synced = await self._sync(taken, assignments)
                if synced is Synced.STOP:
                    break
                if synced is Synced.RETAKE:
                    self.intake.give_back(taken)
                elif taken.tasks:
                    await self.explore(taken)
                else:  # nothing to explore: commit past what was dead-lettered
                    await self.intake.commit()
            finally:
                self.working = False

    async def _sync(self, taken: Taken, assignments: int) -> Synced:
        """The sync point before sampling ``taken`` (its batch; the explorer's own step for
        unstamped tasks), or, with no tasks, only a broadcast group waiting for this
        explorer. Ends early (RETAKE) when it has to wait and the partitions moved since
        the take began (``assignments``: the intake's count then)."""
        if not taken.tasks:
            if not self.follower.broadcast_pending():
                return Synced.READY
            return await self.follower.sync_point(None, self.step)
        batch = taken.batch if taken.batch != UNSTAMPED else self.step
        return await self.follower.sync_point(
            batch, self.step, lambda: self.intake.assignments != assignments
        )

    async def explore(self, taken: Taken) -> None:
        """One step on the tasks taken: roll out (:mod:`.scheduler`), publish, dead-letter
        the tasks given up, commit, report. An aborted step (a stop came) publishes what
        it made and commits nothing: its tasks are explored again after a restart."""
        t0 = time.perf_counter()
        seed = self.cfg.run.seed * 1_000_003 + self.index * 10_007 + self.step
        tasks, too_long = self._fit_context(taken.tasks)
        async with self.intake.rolling_out():  # longer than max_poll_interval_ms: stuck
            outcome = await self.scheduler.run(tasks, seed, self.stop)
        outcome.failed.extend(too_long)
        rollout_s = time.perf_counter() - t0
        groups = _stamp(outcome.groups, taken.tasks)
        records, big = fitting_records(
            self.topics.experiences, groups, self.cfg.kafka.max_request_bytes
        )
        if big:  # no broker or trainer takes them: their tasks are given up, with the reason
            by_task = {t.id: t for t in taken.tasks}
            outcome.failed.extend(
                (
                    by_task[g.task_id],
                    f"its group is {big[g.id]} bytes encoded, more than a record holds "
                    "(kafka.max_request_bytes, 16 MiB at most): fewer or shorter rollouts",
                )
                for g in groups
                if g.id in big and g.task_id in by_task
            )
            groups = [g for g in groups if g.id not in big]
        await self.publish(records)
        self._show_soon(groups, seed)
        if outcome.aborted:
            log.info(
                "%s: step aborted; %d groups published, nothing committed", self.name, len(groups)
            )
            return
        await self._give_up(taken, outcome.failed)
        await self.intake.commit()
        self.step += 1
        self.counters.add("task_retries", outcome.retried)
        await self.report(groups, rollout_s)

    def _fit_context(self, tasks: list[Task]) -> tuple[list[Task], list[tuple[Task, str]]]:
        """The tasks whose rendered prompt leaves the model room to answer, and the others
        with the reason (given up before the engine sees them)."""
        config = getattr(self.engine.model, "config", None)
        context = int(getattr(config, "max_position_embeddings", 0) or 0)
        if not context:
            return tasks, []
        fit, too_long = [], []
        for task in tasks:
            try:
                n = len(self.prompts.ids(task))
            except (StreamRFTError, ValueError, TypeError, KeyError):
                n = 0  # a prompt this renderer cannot make: the workflow's to judge
            if n < context:
                fit.append(task)
            else:
                reason = f"its prompt is {n} tokens, the model's context {context}: no room"
                too_long.append((task, reason))
        return fit, too_long

    def _call(self, workflow: str, tasks: list[Task], seed: int) -> list[ExperienceGroup]:
        """One workflow call (on a scheduler thread)."""
        cfg = self.cfg.explorer
        spec = RolloutSpec(
            repeat_times=cfg.repeat_times,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            seed=seed,
            run=self.topics.run,
            explorer=self.name,
            model_version=self.follower.version,
            explorer_step=self.step,
            prompts=self.prompts,
            agent=cfg.agent,
            agent_concurrency=cfg.agent_concurrency,
            agent_record=cfg.agent_record,
            refresh=self._refresh if cfg.partial_rollout else None,
            corrected=self.cfg.algorithm.off_policy_correction != "none",
        )
        return get_workflow(workflow)(self.engine, tasks, self.reward, spec)

    def _refresh(self) -> None:
        """Between two turns of an episode (on a scheduler thread): apply the newest
        usable version if it is newer than the one held (``explorer.partial_rollout``)."""
        if self.loop is None or self.stop.is_set() or self.view.shutdown.is_set():
            return
        applied = asyncio.run_coroutine_threadsafe(self._take_newer(), self.loop)
        try:
            applied.result(REFRESH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            applied.cancel()
            log.warning(
                "%s: a newer version took over %.0f s; going on", self.name, REFRESH_TIMEOUT_S
            )
        except Exception as exc:
            # sync point meets the same fault (a control reader gone, a store down) itself
            log.warning("%s: no newer version between turns: %r", self.name, exc)

    async def _take_newer(self) -> None:
        held = self.follower.version
        if self.follower.newest() > held:
            await self.follower.apply_newest()
            if self.follower.version > held:
                self.counters.add("versions_applied_mid_step")

    async def _give_up(self, taken: Taken, failed: list[tuple[Task, str]]) -> None:
        """Dead-letter each task the scheduler gave up on, with its reason."""
        where = {(p.task.id, p.task.epoch): p for p in taken.items}
        for task, reason in failed:
            pending = where[(task.id, task.epoch)]
            await self.events.dead_letter(
                Record(
                    topic=pending.tp.topic,
                    partition=pending.tp.partition,
                    offset=pending.offset,
                    key=task.id.encode(),
                    value=TASK.encode(task),
                    headers=TASK.headers(),
                    error=RolloutError(f"task {task.id!r}: {reason}"),
                )
            )
        self.counters.add("tasks_failed", len(failed))

    async def publish(self, records: list[OutRecord]) -> None:
        """Publish a step's groups (their records, :func:`fitting_records`; acks=all), all
        of them again after a broker outage. A group sent twice is harmless: the trainer
        deduplicates by experience id. Key: the task id, so a group stays whole on one
        partition."""
        await send_all(
            self.producer,
            records,
            f"{self.name}: publishing {len(records)} experience groups",
            self.cfg.run.outage_timeout_s,
            lambda _exc: self.counters.add("publish_retries"),
        )

    def _show_soon(self, groups: list[ExperienceGroup], seed: int) -> None:
        """:meth:`_show` in the background: the next step does not wait for it (a step
        whose predecessor's samples are still on their way shows none)."""
        if not self.cfg.explorer.samples_per_step:
            return
        if self._showing is not None and not self._showing.done():
            self.counters.add("samples_skipped", self.cfg.explorer.samples_per_step)
            return
        self._showing = asyncio.create_task(self._show(groups, seed), name="samples")

    async def _show(self, groups: list[ExperienceGroup], seed: int) -> None:
        """Publish a few of the step's rollouts decoded (``explorer.samples_per_step``),
        best effort: samples that cannot be made or sent are counted and skipped, and after
        :data:`SAMPLE_FAILURES` failures in a row (a run without a ``samples`` topic, one
        made before it existed) the explorer stops making them, saying so once."""
        k = self.cfg.explorer.samples_per_step
        if not groups or self.sample_failures >= SAMPLE_FAILURES:
            return
        try:
            shown = pick_samples(groups, k, self.engine.tokenizer, seed)
            await asyncio.wait_for(
                send_all(
                    self.producer,
                    sample_records(self.topics.samples, shown),
                    f"{self.name}: publishing {len(shown)} samples",
                    SAMPLE_SEND_S,
                ),
                SAMPLE_SEND_S + 5,
            )
            self.sample_failures = 0
        except Exception as exc:
            self.sample_failures += 1
            self.counters.add("samples_dropped", k)
            log.warning("%s: samples of step %d not published: %r", self.name, self.step, exc)
            if self.sample_failures >= SAMPLE_FAILURES:
                log.warning(
                    "%s: no samples published %d steps in a row (is there a %s topic?); "
                    "publishing none from now on",
                    self.name,
                    SAMPLE_FAILURES,
                    self.topics.samples,
                )

    async def report(self, groups: list[ExperienceGroup], rollout_s: float) -> None:
        rewards = [e.reward for g in groups for e in g.experiences]
        lengths = [e.response_length for g in groups for e in g.experiences]
        self.counters.add("groups_published", len(groups))
        self.counters.add("experiences_published", len(rewards))
        values = {"explorer/rollout_seconds": rollout_s, "explorer/groups": float(len(groups))}
        times = self.follower.take_times()  # this step's sync point, and receives meanwhile
        values["explorer/version_wait_s"] = times.version_wait_s
        values["explorer/sync_wait_s"] = times.sync_wait_s
        values["explorer/apply_s"] = times.apply_s
        values["explorer/receive_s"] = times.receive_s
        if rewards:  # a step whose every task was given up has none
            values["explorer/reward_mean"] = sum(rewards) / len(rewards)
            values["explorer/response_length"] = sum(lengths) / len(lengths)
        await self.events.metrics(values)
        await self.events.status()

    # -- lifecycle ---------------------------------------------------------------------------
    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        self.producer = await start_sampler(
            stack, self.cfg, self.name, self.events, self.view, self.follower
        )
        stack.push_async_callback(self.intake.stop)
        await self.intake.start()
        # before the first status: what an earlier process of this explorer rejected
        await self.follower.remember_rejections()
        self.follower.start_staging()  # versions are received from now on, in the background
        await self.events.status(RunState.RUNNING, "started")
        model = self.engine.model
        log.info(
            "%s: engine %s ready, model on %s in %s",
            self.name,
            self.cfg.explorer.engine,
            model_device(model),
            self.cfg.model.dtype,
        )


def main(cfg: Config, index: int | None = None) -> None:
    asyncio.run(Explorer(cfg, index).run())


def _stamp(groups: list[ExperienceGroup], tasks: list[Task]) -> list[ExperienceGroup]:
    """Every group carries its task's batch, whatever the workflow filled in."""
    batches = {(task.id, task.epoch): task.batch for task in tasks}
    return [msgspec.structs.replace(g, batch=batches[(g.task_id, g.epoch)]) for g in groups]
