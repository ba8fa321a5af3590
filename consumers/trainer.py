"""The trainer process: consume experience groups, learn, publish versions, checkpoint.

The step loop:
  collect ``batch_size`` fresh groups (:class:`~.intake.ExperienceIntake`: decode, dead
  letters, dedup, staleness) -> one step of the train engine (:mod:`.train_engine`)
  -> after the step: a version when the sync style says so (copied out, then sent in the
  background by
  :class:`~streamrft.sync.publisher.VersionPublisher`), evaluate, checkpoint, metrics
  with the ledger of the groups trained.
Offsets are committed only after a checkpoint, so a crash neither loses nor double-counts
an experience: the restarted trainer reloads weights, optimizer, dedup state and offsets
together (:class:`~.state.TrainerState`).

A replay (``replay``: :mod:`.replay`) is the same loop on a recorded stream: the intake
reads it between its bounds and the loop ends when it is read to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shutil
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path

import torch
from aiokafka.errors import KafkaError

from streamrft.consumers.algorithms import resolve_algorithm
from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.checkpoint import mark_keep, unmark_keep
from streamrft.consumers.checkpoint_store import (
    STAGING,
    CheckpointStore,
    CheckpointUploads,
    StoredRecord,
)
from streamrft.consumers.expert_data import ExpertSource
from streamrft.consumers.intake import ExperienceIntake
from streamrft.consumers.poison import RECORD, GroupLimits, InFlight, Written, step_failure
from streamrft.consumers.replay import ReplayCursor
from streamrft.consumers.shared_copy import WAIT_S, SharedCopy
from streamrft.consumers.state import TrainerState
from streamrft.consumers.strategies import check_strategy, make_strategy
from streamrft.consumers.train_engine import Evaluator, make_train_engine
from streamrft.infra.admin import unexplored_tasks
from streamrft.infra.bus import HEARTBEAT_S, ControlView, Counters, EventSender, Position
from streamrft.infra.config import Config
from streamrft.infra.consume import Record
from streamrft.infra.daemon_call import on_daemon_thread
from streamrft.infra.signals import install_stop_handlers
from streamrft.infra.taskset import read_training_set
from streamrft.schemas.codec import EXPERIENCE_GROUP
from streamrft.schemas.errors import (
    ConfigError,
    RewardServiceError,
    SchemaError,
    ServiceError,
    Stalled,
    StreamRFTError,
    SyncError,
)
from streamrft.schemas.events import RunState, Shutdown, TrainedGroup, VersionsRetired
from streamrft.schemas.experience import ExperienceGroup
from streamrft.sync.publisher import VersionPublisher, announced_floor
from streamrft.sync.retention import to_retire
from streamrft.sync.styles import trainer_publishes
from streamrft.sync.transport import SenderContext, make_sender

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3
"""Batches set aside in a row after which a failing step is the trainer's fault: it raises."""
REDELETE_ON_START = 64
"""Versions retired by an earlier trainer of the run whose files a new one deletes again
(the newest: an earlier trainer may have died before deleting them, or a store outage
kept them; older ones were deleted long ago)."""


class Trainer:
    """The loop and the sync decisions; the model lives in the train engine."""

    def __init__(
        self, cfg: Config, evaluate: Evaluator | None, replay: ReplayCursor | None = None
    ) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.stop = asyncio.Event()
        self.step = 0
        self.counters = Counters()
        self._best_at: int | None = None
        """``trainer.keep_best``: the step whose evaluation was a new best (its checkpoint,
        saved right after it at the same step, is the one to keep)."""
        self._best_missing_said = False
        self._trained_here = False
        """A step was trained by this process (an evaluation before it judges weights that
        some checkpoint already holds)."""
        self.events = EventSender(cfg, "trainer", "trainer", self.counters, self._position)
        self.resumed = False
        """Restored (or started fresh), version published and joined to its experiences:
        ready to train (``/readyz``)."""
        # the status topic: who is working (the idle rule), who a broadcast goes to
        self.view = ControlView(cfg, "trainer", self.events.dead_letter, listen_status=True)
        spec = resolve_algorithm(cfg).spec  # bad names fail here, before the model loads
        if spec.dynamic_sampling and self.tcfg.max_staleness < 2:
            log.warning(
                "trainer: algorithm.dynamic_sampling fills a batch from the next one, which "
                "moves versions one batch ahead; with trainer.max_staleness %d the rest of "
                "that batch may be dropped as stale: use 2 or more",
                self.tcfg.max_staleness,
            )
        check_strategy(spec)
        torch.set_num_threads(self.tcfg.threads)
        self.engine = make_train_engine(cfg)
        experts = None
        if spec.sample_strategy == "mix":
            experts = ExpertSource.from_config(cfg, spec, self.engine.tokenizer).take
        self.buffer = ExperienceBuffer(
            self.tcfg.max_staleness,
            self.tcfg.dedup_window,
            strategy=make_strategy(spec, self.tcfg, experts),
            dynamic_sampling=spec.dynamic_sampling,
        )
        self._evaluate = evaluate
        limits = GroupLimits(
            self.tcfg.max_group_rows,
            self.engine.context_length,
            self.tcfg.max_tokens_per_micro_batch,
        )
        self.intake = ExperienceIntake(
            cfg, self.buffer, self.events, self.counters, self.engine.vocab_size, replay, limits
        )
        self.inflight = InFlight(cfg.run_dir / "checkpoints" / RECORD, self.tcfg.max_step_crashes)
        """The poison record (with the checkpoints: in the store too, once it is open)."""
        self.shared_record: SharedCopy | None = None
        """The poison record's copy in the store, written off the loop."""
        self._failed_in_a_row = 0
        self.publisher: VersionPublisher | None = None  # made once the model is final
        self.uploads: CheckpointUploads | None = None
        """Checkpoints on their way to the store (``trainer.checkpoint_store``)."""
        self._blocked_s = 0.0
        self._retired: set[int] = set()
        """Versions this trainer announced retired (its view may not have read it yet)."""
        self._unremoved: set[int] = set()
        """Retired versions whose files are to be deleted (or failed to be: again later)."""
        self._retiring: set[int] = set()
        """Versions announced retired at the last call: deleted at the next."""
        """Seconds the last publication held the loop (its snapshot)."""

    @property
    def version(self) -> int:
        return self.publisher.version if self.publisher is not None else -1

    def _position(self) -> Position:
        return Position(
            step=self.step, version=self.version, starved=self.intake.starved, ready=self.resumed
        )

    @property
    def clock(self) -> int:
        """Where the run is, in steps: the step count, or one past the highest batch trained
        when that is further (after a restart the trainer goes on from the batches the
        explorers reached, not from its checkpoint's step). Versions are numbered by it
        and the sync schedule follows it, so a batch's version stays ``batch -
        sync_offset`` (:mod:`streamrft.sync.styles`)."""
        return max(self.step, self.buffer.trained_through + 1)

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        install_stop_handlers(self.stop, "trainer")
        async with contextlib.AsyncExitStack() as stack:  # stops what started, in reverse
            await self._start(stack)
            while not self.stop.is_set() and not (
                self.tcfg.max_steps and self.step >= self.tcfg.max_steps
            ):
                self.view.check()
                collected = await self._collect()
                if collected is None:
                    break
                stepped = await self._train(*collected)
                if stepped is not None:
                    await self._after_step(*stepped)
            stalled = await self._why_idle() if self.intake.ended_idle else None
            await self._finish()
        if stalled:
            raise Stalled(stalled)

    async def _why_idle(self) -> str | None:
        """The stream stayed idle with no explorer working: the run is done when nothing
        is left to explore (every task on ``tasks`` committed by the explorers, and a
        feeder, if any, done publishing); otherwise nothing can make progress, and this
        says what is left (the trainer then exits with ``EXIT_STALLED``, not 0)."""
        topics = self.cfg.topics()
        try:
            left = await unexplored_tasks(self.cfg.kafka, topics)
        except (KafkaError, StreamRFTError) as exc:
            log.warning("trainer: could not count the tasks left (%s)", exc)
            left = 0
        live = self.view.live_peers("explorer", 3 * HEARTBEAT_S)
        feeder = self.view.peer("feeder")
        idle = f"no experience for {self.tcfg.idle_timeout_s:.0f}s"
        if left:
            return (
                f"{idle}, and {left} tasks on {topics.tasks} were never explored: "
                f"{len(live)} explorer(s) heard from in the last {3 * HEARTBEAT_S:.0f}s "
                f"({', '.join(live) or 'none'}), none working"
            )
        if feeder is not None and feeder.state != RunState.STOPPED:
            return (
                f"{idle}, and the feeder has not finished publishing (epoch {feeder.step} of "
                f"{self.cfg.taskset.total_epochs}, last heard {time.time() - feeder.created_at:.0f}s ago)"
            )
        log.info("trainer: every task was explored; the run is done")
        return None

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        """Warm-up (a fresh run) or restore (a resumed one), version 0 (or the next), a
        first evaluation, then join the experiences group at the restored offsets."""
        await self.events.start(heartbeat_s=HEARTBEAT_S)
        stack.push_async_callback(self.events.stop)
        stack.push_async_callback(self._report_stopped)
        await self.view.start()
        stack.push_async_callback(self.view.stop)
        # a Shutdown on the control topic (`streamrft stop`) stops it as a signal does
        watch = asyncio.create_task(self._stop_on_shutdown(), name="shutdown watch")
        stack.callback(watch.cancel)
        if self.cfg.stores_checkpoints:
            await self._open_checkpoint_store()
            # a client of its own, with short timeouts: a step never waits long for it
            quick = await asyncio.to_thread(CheckpointStore, self.cfg, True)
            stored = StoredRecord(quick, RECORD)
            self.inflight = InFlight(
                self.cfg.run_dir / "checkpoints" / RECORD, self.tcfg.max_step_crashes, stored
            )
            # never written over before it could be read (InFlight.catch_up)
            self.shared_record = SharedCopy(
                stored, "poison_record", self.counters, before=self.inflight.catch_up
            )
            stack.callback(self.shared_record.close)
        ckpt = self.engine.latest() if self.tcfg.resume else None
        if ckpt is None and self.tcfg.warmup_sft_steps:
            await self._warmup()
        # off the loop: loading a large model takes long, and the heartbeats and the probes
        # (/healthz) must go on meanwhile
        weights = await asyncio.to_thread(self.engine.prepare)
        ctx = SenderContext(
            self.counters, lambda: self.view.live_peers("explorer", 3 * HEARTBEAT_S)
        )
        sender = await asyncio.to_thread(make_sender, self.cfg, ctx)  # may reach the store
        stack.callback(sender.close)
        self.publisher = VersionPublisher(weights, sender, self.events.control, self.counters)
        stack.push_async_callback(self.publisher.aclose)
        state = await asyncio.to_thread(self.engine.load, ckpt) if ckpt is not None else None
        if state is not None:
            self._restore(state, ckpt)
        self.publisher.resume(state.version if state else -1, await announced_floor(self.cfg))
        await self.publisher.submit(self.step)  # sent while the first evaluation runs
        await self.evaluate()
        stack.push_async_callback(self.intake.stop)
        # on a daemon thread: the store's copy is read too; copies from before the
        # checkpoint resumed from (self.step) are ignored
        self.intake.poisoned = await on_daemon_thread(
            self.inflight.recover, self.step, name="poison-record"
        )
        await self._share_record(self.inflight.last, wait=True)  # the crash counted once
        await self.intake.start(state.resume_offsets() if state else {})
        self.resumed = True
        await self.events.status(RunState.RUNNING, "training")

    async def _stop_on_shutdown(self) -> None:
        await self.view.shutdown.wait()
        self.stop.set()

    async def _warmup(self) -> None:
        steps = self.tcfg.warmup_sft_steps
        await self.events.status(RunState.RUNNING, f"SFT warm-up, {steps} steps")
        tasks = read_training_set(self.cfg.taskset)
        losses = await asyncio.to_thread(self.engine.warmup, tasks)
        await self.events.metrics(
            {"warmup/sft_loss_first": losses[0], "warmup/sft_loss_last": losses[-1]}
        )

    async def _collect(self) -> tuple[list[ExperienceGroup], float] | None:
        """The next batch and how long the trainer waited for it; None: finish."""
        t0 = time.perf_counter()
        groups = await self.intake.collect(
            self.tcfg.batch_size,
            lambda: self.version,
            self.stop,
            self._answer_requests,
            self._explorers_working,
        )
        return None if groups is None else (groups, time.perf_counter() - t0)

    def _explorers_working(self) -> bool:
        """What keeps the idle clock from running out: an explorer or serve process at work,
        or, in a run that starts no explorer of its own (``explorer.count`` 0), none heard
        from yet (explorers started elsewhere may take minutes to load a model)."""
        if self.view.working_peers(3 * HEARTBEAT_S):
            return True
        return self.cfg.explorer.count == 0 and not self.view.heard_from("explorer")

    async def _train(
        self, groups: list[ExperienceGroup], wait_s: float
    ) -> tuple[dict[str, float], list] | None:
        """One engine step; its metrics with staleness and the ledger of groups trained
        (None: the step failed and its groups were set aside)."""
        t0 = time.perf_counter()
        ids = [g.id for g in groups]
        begun = await asyncio.to_thread(self.inflight.begin, ids, self.step)
        await self._share_record(begun, wait=True)
        values = await self._step(groups)
        trained = self.step + (values is not None)  # the step counted below
        done = await asyncio.to_thread(self.inflight.done, ids, trained)  # or set aside
        await self._share_record(done, wait=False)
        if values is None:
            return None
        assert self.publisher is not None
        self.publisher.stepped()
        # the books and the staleness count the groups read from the stream for this step:
        # not replays nor the trainer's own expert groups (the batch's last ``last_extra``)
        fresh = groups[: len(groups) - self.buffer.last_extra]
        staleness = [self.version - g.model_version for g in fresh]
        self.step += 1
        self.counters.add("groups_trained", len(fresh))
        self.counters.add("experiences_trained", sum(len(g.experiences) for g in fresh))
        values.update(
            {
                "train/step_seconds": time.perf_counter() - t0,
                "train/wait_seconds": wait_s,
                "train/staleness_mean": sum(staleness) / len(staleness),
                "train/staleness_max": float(max(staleness)),
                # the distribution: how many groups of the batch were k versions old
                **{
                    f"train/staleness_groups_{k}": float(n)
                    for k, n in sorted(Counter(staleness).items())
                },
                "train/duplicates_dropped": float(self.buffer.duplicates_dropped),
                "train/stale_dropped": float(self.buffer.stale_dropped),
                "train/zero_variance_dropped": float(self.buffer.zero_variance_dropped),
                # of this batch, groups trained before (sample_strategy priority_replay)
                "train/replayed_groups": float(self.buffer.last_replayed),
            }
        )
        return values, [TrainedGroup(g.id, g.model_version) for g in fresh]

    async def _share_record(self, written: Written | None, wait: bool) -> None:
        """The poison record just written on this host, to the store too (when checkpoints
        go there) in the background; ``wait``: a batch in flight, which a trainer restarted
        on another host must count, is waited for in the store, up to
        :data:`~.shared_copy.WAIT_S` and not at all while the store does not keep up
        (docs/reliability.md: a batch that kills the trainer)."""
        if self.shared_record is None or written is None:
            return
        self.shared_record.submit(*written)
        if wait:
            await self.shared_record.stored(written.seq)

    async def _step(self, groups: list[ExperienceGroup]) -> dict[str, float] | None:
        """The engine's step; a failure the batch may cause (out of memory) is retried once
        a row at a time, then the batch's groups are dead-lettered (None). Three batches
        failing in a row is the trainer's fault, not theirs: it raises. A step that fails
        leaves the model and optimizer as they were before it (the engine undoes what it
        applied, ``step_undo.py``), so the retry trains the batch once and a batch set
        aside was never learned from; a failure the engine cannot undo
        (:class:`~streamrft.schemas.errors.StepNotUndone`) ends the trainer, whose
        successor resumes from the checkpoint, before the batch."""
        not_copied = self.engine.steps_not_copied
        try:
            return await self._step_or_retry(groups)
        finally:  # steps the engine had no host memory to copy first
            if self.engine.steps_not_copied > not_copied:
                self.counters.add("steps_not_copied", self.engine.steps_not_copied - not_copied)

    async def _step_or_retry(self, groups: list[ExperienceGroup]) -> dict[str, float] | None:
        try:
            values = await asyncio.to_thread(self.engine.train_step, groups, self.version)
        except Exception as exc:
            if not (step_failure(exc) and self.engine.retries_steps):
                raise
            log.warning("trainer: step failed (%r); retrying it a row at a time", exc)
            self.counters.add("steps_retried")
            try:
                values = await asyncio.to_thread(self.engine.retry_row_by_row, groups, self.version)
            except Exception as again:
                if not step_failure(again):
                    raise
                self._failed_in_a_row += 1
                if self._failed_in_a_row >= MAX_FAILED_STEPS:
                    raise
                await self._set_aside(groups, again)
                return None
        self._failed_in_a_row = 0
        return values

    async def _set_aside(self, groups: list[ExperienceGroup], exc: BaseException) -> None:
        """Dead-letter every group of a batch that could not be trained, with the reason."""
        fresh = groups[: len(groups) - self.buffer.last_extra]
        log.error(
            "trainer: a batch of %d groups cannot be trained (%r): set aside", len(fresh), exc
        )
        for group, (partition, offset) in zip(fresh, self.buffer.last_positions, strict=True):
            reason = SchemaError(
                f"group {group.id}: the training step failed on its batch: {exc!r}"
            )
            await self.events.dead_letter(
                Record(
                    partition[0],
                    partition[1],
                    offset,
                    group.task_id.encode(),  # the record's own key (infra.produce)
                    EXPERIENCE_GROUP.encode(group),
                    EXPERIENCE_GROUP.headers(),
                    error=reason,
                )
            )
        self.counters.add("groups_set_aside", len(fresh))

    async def _after_step(self, values: dict[str, float], trained: list[TrainedGroup]) -> None:
        """Metrics and ledger, then a version when due, evaluation and checkpoint on their
        intervals, and the status."""
        # what the last publication held the loop for (its snapshot, after the step before:
        # the version is sent in the background); this step's metrics carry the version it
        # trained with, so they go out before this step's version
        values["trainer/publish_blocked_seconds"] = self._blocked_s
        self._trained_here = True
        if self.step % 10 == 0 or self.step == 1:
            _log_step(self.step, values)
        await self.events.metrics(values, trained)
        t0 = time.perf_counter()
        published = await self.maybe_publish()
        self._blocked_s = time.perf_counter() - t0
        await self.retire_versions()
        interval = self.cfg.eval.interval
        if interval and self.step % interval == 0:
            await self.evaluate()
        due = self.tcfg.save_interval and self.step % self.tcfg.save_interval == 0
        if due or self._best_at == self.step:
            await self.checkpoint()
        for name, size in self.view.sizes().items():
            self.counters.set(name, size)
        if not published or self.cfg.synchronizer.style != "dynamic_by_trainer":
            await self.events.status(RunState.RUNNING)

    async def _finish(self) -> None:
        """A last evaluation and checkpoint, the final counters, and a Shutdown for all."""
        assert self.publisher is not None
        await self.publisher.drain(background=False)  # the last version announced first
        await self.retire_versions(final=True)
        if not self.cfg.eval.interval or self.step % self.cfg.eval.interval:
            await self.evaluate()
        await self.checkpoint()
        # a signal may be a scheduler's with a deadline; a Shutdown (`streamrft stop`) has none
        signalled = self.stop.is_set() and not self.view.shutdown.is_set()
        drains: list[Awaitable[object]] = []
        if self.uploads is not None:  # the last checkpoint complete in the store
            drains.append(self.uploads.drain(stopping=signalled))
        if self.shared_record is not None:  # the poison record's last copy, briefly
            drains.append(self.shared_record.drain(WAIT_S))
        await asyncio.gather(*drains)
        if not signalled:  # its copies for other hosts (auto's store lane) too,
            await self.publisher.drain()  # unless a signal leaves no time for them
        await self.events.metrics(
            {
                "trainer/final_step": float(self.step),
                "trainer/duplicates_dropped": float(self.buffer.duplicates_dropped),
                "trainer/stale_dropped": float(self.buffer.stale_dropped),
                "trainer/zero_variance_dropped": float(self.buffer.zero_variance_dropped),
                **{f"trainer/{k}": float(v) for k, v in self.counters.snapshot().items()},
            }
        )
        await self.events.control(
            Shutdown(reason=f"trainer finished at step {self.step}", created_at=time.time())
        )
        if self.intake.replay is not None:
            drops = {
                "duplicates": self.buffer.duplicates_dropped,
                "stale": self.buffer.stale_dropped,
                "zero-variance": self.buffer.zero_variance_dropped,
            }
            summary = self.intake.replay.summary(
                self.step, self.counters.snapshot(), drops, len(self.buffer)
            )
            log.info(summary)

    async def _report_stopped(self) -> None:
        try:
            await self.events.status(RunState.STOPPED, f"stopped at step {self.step}")
        except StreamRFTError:
            pass

    # -- sync decisions ----------------------------------------------------------------------
    async def maybe_publish(self) -> bool:
        """Publish at a step boundary when the sync style says so (and answer requests)."""
        sync = self.cfg.synchronizer
        pending = self.view.requests_above(self.version)
        clock = self.clock
        if clock <= self.version or not trainer_publishes(
            sync.style, clock, sync.sync_interval, len(pending)
        ):
            return False
        assert self.publisher is not None
        await self.publisher.submit(self.step, clock)
        if sync.style == "dynamic_by_trainer":
            await self.events.status(RunState.REQUIRE_SYNC, f"version {self.version} on its way")
        return True

    async def retire_versions(self, final: bool = False) -> None:
        """Announce retired the versions no explorer needs any more
        (``synchronizer.keep_versions``: :func:`~streamrft.sync.retention.to_retire` over
        every announcement of the versions this trainer numbered, counted per place; a
        version above its own, announced by someone else, counts for nothing; what its
        sender writes in the background, or wrote there last, is pinned), and delete their
        files one call later (an explorer in the middle of fetching one finishes first),
        all of them when ``final``. Files a store failed to delete are tried again at the
        next call; the run goes on either way."""
        assert self.publisher is not None
        if not self._retired:  # first call: what an earlier trainer retired may be left
            self._retired.update(self.view.retired)
            # its last retirements (a long run retired thousands, deleted long ago)
            self._unremoved.update(sorted(self.view.retired)[-REDELETE_ON_START:])
        self._unremoved.update(self._retiring)  # announced one call ago
        self._retiring = set()
        own = {
            v: self.view.announcements(v)
            for v in self.view.versions
            if v <= self.publisher.announced
        }
        last = self.publisher.last_event  # announced just now: the view may not have it yet
        if last is not None:
            own[last.version] = [*own.get(last.version, []), last]
        keep, pinned = self.cfg.synchronizer.keep_versions, self.publisher.sender.pinned()
        retire = [v for v in to_retire(own, keep, pinned) if v not in self._retired]
        if retire:
            await self.events.control(VersionsRetired(versions=retire, created_at=time.time()))
            self._retired.update(retire)
            self._retiring = set(retire)
            log.info("trainer: versions %s retired (synchronizer.keep_versions)", retire)
        if final:
            self._unremoved.update(self._retiring)
            self._retiring = set()
        if not self._unremoved:
            return
        todo = sorted(self._unremoved)
        try:
            await asyncio.to_thread(self.publisher.sender.retire, todo)
        except SyncError as exc:
            self.counters.add("retire_failures")
            log.warning("trainer: deleting retired versions %s failed (%s); later", todo, exc)
            return
        self._unremoved.clear()
        self.counters.add("versions_retired", len(todo))

    async def _answer_requests(self) -> None:
        """While waiting for data: an explorer that waits on a version waits on us (it
        asked for one, or cannot load the one out: it joined after its broadcast)."""
        self.view.check()
        assert self.publisher is not None
        self.publisher.check()
        if self.view.requests_above(self.version):
            await self.maybe_publish()
        waiting = self.view.waiting_peers(3 * HEARTBEAT_S)
        if waiting:
            await self.publisher.reach(waiting)

    # -- evaluation and checkpoints ----------------------------------------------------------
    async def evaluate(self) -> None:
        """The trainer's own evaluation of its weights, when it was handed an evaluator
        (``eval.in_trainer``; an evaluator process evaluates the versions otherwise)."""
        if self._evaluate is None:
            return
        try:
            values = await asyncio.to_thread(self.engine.evaluate, self._evaluate)
        except RewardServiceError as exc:  # a judge down: this step goes unevaluated
            self.counters.add("evaluations_failed")
            log.warning("trainer: step %d not evaluated: %s", self.step, exc)
            return
        await self.events.metrics(values)
        self._note_best(values)
        log.info(
            "trainer: step %d eval %s",
            self.step,
            ", ".join(f"{k} {v:.3f}" for k, v in values.items()),
        )

    async def checkpoint(self) -> None:
        """Save a checkpoint; its offsets are committed once it is durable: at once on the
        local disk, or once its upload to the store is complete (it goes on in the
        background)."""
        # the last version announced: a checkpoint never names one still on its way
        announced = self.publisher.announced if self.publisher is not None else -1
        best, before = self._best_at == self.step, int(self.counters.get("keep_best_step", -1))
        if best:  # in the checkpoint's own counters: a resumed run knows which one it kept
            self.counters.set("keep_best_step", self.step)
        self._best_at = None
        state = self.buffer.state(
            step=self.step, version=announced, counters=self.counters.snapshot()
        )
        path = await asyncio.to_thread(self.engine.save, state)
        self.counters.add("checkpoints")
        log.info("trainer: checkpoint %s", path)
        if best:
            await self._keep_best(path, before)
        if self.uploads is None:
            await self.intake.commit(state.resume_offsets())
        else:
            self.uploads.submit(path, state)

    def _note_best(self, values: dict[str, float]) -> None:
        """``trainer.keep_best``: an evaluation with a new best value of its metric makes the
        checkpoint of this step the one to keep (saved after this step)."""
        name = self.tcfg.keep_best
        if not name or not self._trained_here:  # the weights it started from: no new one
            return
        if name not in values:
            if not self._best_missing_said:
                self._best_missing_said = True
                log.warning(
                    "trainer: trainer.keep_best %r is not among the evaluation's metrics (%s)",
                    name,
                    ", ".join(sorted(values)),
                )
            return
        if not math.isfinite(values[name]):
            return
        if values[name] > self.counters.get("keep_best_value", float("-inf")):
            self.counters.set("keep_best_value", values[name])
            self._best_at = self.step

    async def _keep_best(self, path: Path, before: int) -> None:
        """Mark ``path`` (this step's checkpoint) ``keep`` before it is uploaded, and take the
        mark off the best before it, step ``before`` (on disk and in the store)."""
        mark_keep(path)
        log.info(
            "trainer: checkpoint %s kept as the best %s (%.4f)",
            path.name,
            self.tcfg.keep_best,
            self.counters.get("keep_best_value", 0.0),
        )
        if before < 0 or before == self.step:
            return
        unmark_keep(path.parent / f"step_{before:08d}")
        if self.uploads is not None:
            await self.uploads.unmark(before)

    async def _open_checkpoint_store(self) -> CheckpointStore:
        """The run's checkpoints in the store, and the newest of them fetched when it is
        newer than the local one (a trainer on another host than the last). A store that
        does not answer is waited for up to ``run.outage_timeout_s``, then an error: a
        trainer that went on from its own disk could start the run over."""
        if not self.cfg.object_store.endpoint:
            raise ConfigError(
                "trainer.checkpoint_store: object_store, but the run has no object store "
                "(object_store.endpoint); use local"
            )
        root = self.cfg.run_dir / "checkpoints"
        for staged in root.glob(f"{STAGING}*") if root.is_dir() else ():
            shutil.rmtree(staged, ignore_errors=True)  # an upload a crash cut short
        deadline = time.monotonic() + self.cfg.run.outage_timeout_s
        while True:
            try:
                store = await asyncio.to_thread(CheckpointStore, self.cfg)
                if self.tcfg.resume:
                    await asyncio.to_thread(store.fetch_newer, root)
                break
            except (SyncError, ServiceError) as exc:
                if time.monotonic() > deadline or self.stop.is_set():
                    raise ServiceError(
                        f"trainer: the object store holding the run's checkpoints cannot be "
                        f"read ({exc}); bring it back, or set trainer.checkpoint_store: local "
                        "to resume from this host's checkpoints only"
                    ) from exc
                log.warning("trainer: the checkpoint store does not answer (%s); retrying", exc)
                await asyncio.sleep(5.0)
        try:
            await asyncio.to_thread(store.remove_unfinished)
        except SyncError as exc:
            log.warning("trainer: unfinished uploads in the store not removed (%s)", exc)
        self.uploads = CheckpointUploads(store, self._checkpoint_durable, self.counters)
        return store

    async def _checkpoint_durable(self, state: TrainerState) -> None:
        await self.intake.commit(state.resume_offsets())

    def _restore(self, state: TrainerState, path) -> None:
        self.step = state.step
        self.buffer.restore(state)
        self.counters.restore(state.counters)
        log.info("trainer: resumed from %s at step %d", path, self.step)


def _log_step(step: int, values: dict[str, float]) -> None:
    log.info(
        "trainer: step %d reward %.3f loss %.4f grad_norm %.3f clip_frac %.3f "
        "logp_diff %.2e staleness %.2f wait %.2fs step %.2fs",
        step,
        values["train/reward_mean"],
        values["train/loss"],
        values["train/grad_norm"],
        values.get("train/clip_frac", 0.0),  # not every policy loss clips
        values["train/logprob_max_abs_diff"],
        values["train/staleness_mean"],
        values["train/wait_seconds"],
        values["train/step_seconds"],
    )


def main(cfg: Config, evaluate: Evaluator | None, replay: ReplayCursor | None = None) -> None:
    asyncio.run(Trainer(cfg, evaluate, replay).run())
