"""The explorer process: tasks in, experience groups out, new weights applied at sync points.

One explorer step:
  sync point -> take up to ``batch_size`` tasks -> roll out -> publish groups (acks=all)
  -> commit the tasks' offsets -> status + metrics.
A task's offset is committed only after its group is acknowledged by the broker, so an
explorer that dies mid-step loses nothing: its tasks are explored again (at-least-once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

import torch
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from streamrft.infra import kafka
from streamrft.infra.bus import HEARTBEAT_S, EventBus
from streamrft.infra.config import Config
from streamrft.infra.modeling import load_policy
from streamrft.infra.retry import retrying
from streamrft.infra.shutdown import install_stop_handlers
from streamrft.producers.engine import make_engine
from streamrft.producers.rewards import get_reward
from streamrft.producers.workflows import check_workflow, run_math_workflow
from streamrft.schemas.codec import EXPERIENCE_GROUP, TASK
from streamrft.schemas.errors import SchemaError, ServiceError, StreamRFTError, SyncError
from streamrft.schemas.events import ModelVersionReady, RunState, SyncRequest
from streamrft.schemas.experience import ExperienceGroup, Task
from streamrft.sync.methods import Loaders
from streamrft.sync.styles import choose_version, explorer_sync, is_sync_point, required_version
from streamrft.sync.weights import apply_state_dict, unique_state_dict

log = logging.getLogger(__name__)

__all__ = ["Explorer", "is_sync_point", "main", "required_version", "tasks_group"]


def tasks_group(topics) -> str:
    """The consumer group the explorers of one run share (``<prefix>.<run id>.explorers``).

    One group per run: runs sharing a cluster never rebalance each other's explorers.
    """
    return f"{topics.prefix}.{topics.run}.explorers"


class Explorer:
    def __init__(self, cfg: Config, index: int | None = None) -> None:
        """``index``: the supervisor's numbering (id ``explorer-<index>``); None for an
        explorer started by hand, whose id ``explorer-<pid>-<4 hex>`` no numbered one has
        (its groups carry it in their ``explorer`` field; group ids do not, so a task that
        two explorers explored is trained once)."""
        self.cfg = cfg
        if index is None:
            tag = secrets.token_hex(2)
            self.name = f"explorer-{os.getpid()}-{tag}"
            index = (os.getpid() << 16) + int(tag, 16)
        else:
            self.name = f"explorer-{index}"
        self.index = index
        self.topics = cfg.topics()
        self.bus = EventBus(cfg, self.name, "explorer")
        self.stop = asyncio.Event()
        torch.set_num_threads(cfg.explorer.threads)
        model, tokenizer = load_policy(cfg.model)
        if cfg.model.lora.enabled:
            from streamrft.sync.lora import attach_lora

            model = attach_lora(model, cfg.model.lora)
        self.engine = make_engine(cfg.explorer.engine, model, tokenizer)
        self.receiver = None  # a CollectiveReceiver, made on the first broadcast
        self.base_version = -1
        """Full version the model was last built from (LoRA adapters apply on top of it)."""
        self.reward = get_reward(cfg.explorer.reward)
        self.loader = Loaders(cfg)
        self.version = -1
        self.step_lag = 0
        """Steps the fixed style's schedule was shifted by after a wait the trainer could not
        end (see :meth:`sync`)."""
        self.rejected: set[tuple[int, str]] = set()
        """(version, manifest sha256) of versions that failed verification here."""
        self.pending: list[tuple[TopicPartition, int, Task]] = []
        self.partitions: tuple[int, ...] = ()
        """Tasks partitions this explorer holds (from the newest rebalance)."""
        self._assignment_to_report = False

    # -- weights ---------------------------------------------------------------------------
    def usable_versions(self) -> dict[int, ModelVersionReady]:
        """Announced versions this explorer can load: every stored one, and broadcasts
        whose group it is a member of."""
        return {
            v: ev
            for v, ev in self.bus.versions.items()
            if self._can_load(ev) and (v, ev.manifest_sha256) not in self.rejected
        }

    def _can_load(self, event: ModelVersionReady) -> bool:
        if event.method != "nccl":
            return True
        from streamrft.sync.collective import parse_rendezvous

        try:
            return self.name in parse_rendezvous(event.uri).members
        except SyncError:
            return False

    def _deadlocked(self, waiting_since: float) -> bool:
        """Fixed style, with weights: the trainer has said, since this explorer began
        waiting, that it starves for experiences, so the version it waits for cannot
        come until it explores on."""
        return (
            self.cfg.synchronizer.style == "fixed"
            and self.version >= 0
            and self.bus.peer_starved("trainer", waiting_since)
        )

    def broadcast_pending(self) -> bool:
        """A newer broadcast this explorer is a member of is waiting for it."""
        usable = self.usable_versions()
        newest = max(usable, default=-1)
        return newest > self.version and usable[newest].method == "nccl"

    async def sync(self, step: int) -> bool:
        """At a step boundary: ask, wait and apply as the sync style says. False: stop."""
        sync = self.cfg.synchronizer
        started = time.monotonic()
        plan = explorer_sync(
            sync.style, step - self.step_lag, self.version, sync.sync_interval, sync.sync_offset
        )
        if plan.request is not None:
            await self.bus.control(
                SyncRequest(explorer=self.name, min_version=plan.request, created_at=time.time())
            )
        need = plan.wait_for
        if need is not None and max(self.usable_versions(), default=-1) < need:
            await self.bus.status(RunState.WAITING_SYNC, f"needs version >= {need}")
            log.info("%s: step %d waits for version >= %d", self.name, step, need)
            since = time.time()
            ready = await self.bus.wait_until(
                lambda: max(self.usable_versions(), default=-1) >= need or self._deadlocked(since),
                sync.sync_timeout,
                self.stop,
                f"no usable model version >= {need}",
            )
            if not ready:
                return False
            have = max(max(self.usable_versions(), default=-1), self.version)
            if have < need:
                # The trainer starves while this explorer waits for a version only more
                # data can make (this explorer ran ahead, e.g. re-exploring tasks after a
                # rebalance): explore on with the newest version, and count later steps
                # from here so the next ones do not wait for the same version again.
                self.step_lag += need - have
                self.bus.count("sync_waits_cut")
                log.warning(
                    "%s: the trainer waits for experiences and this explorer for version "
                    "%d; going on with version %d",
                    self.name,
                    need,
                    have,
                )
        while True:
            usable = self.usable_versions()
            chosen = choose_version(
                list(usable), plan, self.version, self.cfg.trainer.max_staleness
            )
            newest = max(usable, default=-1)
            if newest > self.version and usable[newest].method == "nccl":
                chosen = newest  # a broadcast waits for every member of its group
            if chosen is None:
                break
            event = usable[chosen]
            t0 = time.perf_counter()
            try:
                await asyncio.to_thread(self.load_version, event)
            except SyncError as exc:
                if exc.retriable and event.method != "nccl":
                    # the store is down: keep exploring on the current weights, try again
                    # at the next sync point (an explorer with no weights yet waits)
                    self.bus.count("store_unavailable")
                    if self.version < 0:  # nothing to explore with: wait, within limits
                        log.warning("%s: no weights yet, store unavailable: %s", self.name, exc)
                        if self.stop.is_set() or self.bus.shutdown_event.is_set():
                            return False
                        if time.monotonic() - started > self.cfg.run.outage_timeout_s:
                            raise ServiceError(
                                f"{self.name}: object store unavailable for "
                                f"{self.cfg.run.outage_timeout_s:.0f}s: {exc}"
                            ) from exc
                        await asyncio.sleep(1.0)
                        continue
                    log.warning(
                        "%s: version %d unavailable (%s); staying on version %d for now",
                        self.name,
                        chosen,
                        exc,
                        self.version,
                    )
                    break
                if event.method == "nccl":
                    # the trainer announces the same version again through the object store
                    self.bus.count("broadcast_failures")
                    log.warning("%s: broadcast of version %d failed (%s)", self.name, chosen, exc)
                    if not await self.bus.wait_until(
                        lambda v=chosen: (
                            self.bus.versions[v].method != "nccl" or max(self.usable_versions()) > v
                        ),
                        sync.sync_timeout,
                        self.stop,
                        f"no fallback for version {chosen}",
                    ):
                        return False
                    continue
                # a version that failed verification is never tried again; an explorer
                # that has no weights yet, or needs a newer version, waits for the next
                self.rejected.add((chosen, event.manifest_sha256))
                self.bus.count("versions_rejected")
                log.error(
                    "%s: version %d rejected, staying on %d: %s",
                    self.name,
                    chosen,
                    self.version,
                    exc,
                )
                if self.version < 0 or (need is not None and self.version < need):
                    floor = max(need or 0, 0)
                    if plan.request is not None:  # ask again: the answer was bad
                        await self.bus.control(
                            SyncRequest(
                                explorer=self.name, min_version=chosen + 1, created_at=time.time()
                            )
                        )
                    since = time.time()
                    if not await self.bus.wait_until(
                        lambda f=floor, t=since: (
                            max(self.usable_versions(), default=-1) >= f or self._deadlocked(t)
                        ),
                        sync.sync_timeout,
                        self.stop,
                        f"no usable model version >= {floor} (version {chosen} was rejected)",
                    ):
                        return False
                    if max(self.usable_versions(), default=-1) < floor:  # starved: go on
                        self.step_lag += floor - max(self.version, 0)
                        self.bus.count("sync_waits_cut")
                        break
                    continue
                break
            self.version = self.bus.version = chosen
            self.bus.count("versions_applied")
            self.bus.counters["sync_seconds"] = (
                self.bus.counters.get("sync_seconds", 0) + time.perf_counter() - t0
            )
            log.info("%s: applied version %d (%s)", self.name, self.version, event.method)
            break
        if self.bus.state != RunState.RUNNING:
            await self.bus.status(RunState.RUNNING)
        return True

    def load_version(self, event: ModelVersionReady) -> None:
        """Fetch, verify and apply one version in place (its full base first, for adapters).

        Everything is fetched and verified before the model is touched.
        """
        if event.method == "nccl":
            self._receive(event)
            return
        if not event.lora:
            tensors = self.loader.fetch(event)
            apply_state_dict(self.engine.model, tensors)
            self.base_version = event.version
            return
        from streamrft.sync.lora import apply_adapter

        base = None
        if event.base_version != self.base_version:
            base_event = self.bus.versions.get(event.base_version)
            if base_event is None:
                raise SyncError(
                    f"adapter version {event.version} needs full version {event.base_version}, "
                    "which was never announced"
                )
            base = self.loader.fetch(base_event)
        adapter = self.loader.fetch(event)
        if base is not None:
            apply_state_dict(self.engine.model, base)
            self.base_version = event.base_version
        apply_adapter(self.engine.model, adapter)

    def _receive(self, event: ModelVersionReady) -> None:
        """Take part in a broadcast: receive into staging tensors, then apply them."""
        from streamrft.sync.collective import CollectiveReceiver

        if self.receiver is None:
            self.receiver = CollectiveReceiver(self.name, self.cfg.synchronizer.sync_timeout)
        model = self.engine.model
        if event.lora:
            from streamrft.sync.lora import adapter_state_dict, apply_adapter

            if event.base_version != self.base_version:
                raise SyncError(
                    f"broadcast adapter version {event.version} is on base {event.base_version}, "
                    f"this explorer holds base {self.base_version}"
                )
            staging = {k: torch.empty_like(v) for k, v in adapter_state_dict(model).items()}
            self.receiver.receive(event.uri, staging, event.version)
            apply_adapter(model, staging)
            return
        staging = {k: torch.empty_like(v) for k, v in unique_state_dict(model).items()}
        self.receiver.receive(event.uri, staging, event.version)
        apply_state_dict(model, staging)
        self.base_version = event.version

    # -- tasks -----------------------------------------------------------------------------
    def _on_assign(self, partitions: tuple[int, ...]) -> None:
        """A rebalance gave this explorer ``partitions``: counted now, reported on status
        at the next poll (counters ``tasks_partitions`` and ``rebalances``)."""
        self.partitions = partitions
        self.bus.counters["tasks_partitions"] = len(partitions)
        self.bus.count("rebalances")
        self._assignment_to_report = True

    async def _report_assignment(self) -> None:
        if not self._assignment_to_report:
            return
        self._assignment_to_report = False
        if self.partitions:
            detail = "tasks partitions " + ",".join(map(str, self.partitions))
        else:
            detail = "no tasks partition: idle (more explorers than tasks partitions)"
        await self.bus.status(detail=detail)

    async def take_tasks(self, consumer, n: int) -> list[tuple[TopicPartition, int, Task]]:
        """Up to ``n`` tasks; returns early with fewer when the topic is idle for a while."""
        taken: list[tuple[TopicPartition, int, Task]] = []
        idle_since = time.monotonic()
        while len(taken) < n and not self.stop.is_set() and not self.bus.shutdown_event.is_set():
            await self._report_assignment()
            batches = await consumer.getmany(timeout_ms=200, max_records=n - len(taken))
            for tp, records in batches.items():
                for rec in records:
                    try:
                        task = TASK.decode(rec.value, rec.headers)
                        check_workflow(task.workflow)
                    except (SchemaError, StreamRFTError) as exc:
                        await self.bus.dead_letter(
                            tp.topic, tp.partition, rec.offset, rec.key, rec.value, exc
                        )
                        taken.append((tp, rec.offset, None))  # committed past, kept in dead letters
                        continue
                    taken.append((tp, rec.offset, task))
            if batches:
                idle_since = time.monotonic()
            elif taken and time.monotonic() - idle_since > 1.0:
                break
            elif not taken and self.broadcast_pending():
                break  # no tasks for us right now, but a broadcast group waits on us
        return taken

    async def publish(self, producer, groups: list[ExperienceGroup]) -> None:
        """Publish a step's groups (acks=all), all of them again after a broker outage.

        A group sent twice is harmless: the trainer deduplicates by experience id.
        """
        values = [EXPERIENCE_GROUP.encode(g) for g in groups]

        async def attempt() -> None:
            futures = [
                await producer.send(
                    self.topics.experiences,
                    value,
                    key=g.task_id.encode(),
                    headers=EXPERIENCE_GROUP.headers(),
                )
                for g, value in zip(groups, values, strict=True)
            ]
            await asyncio.gather(*futures)

        await retrying(
            f"{self.name}: publishing {len(groups)} experience groups",
            attempt,
            self.cfg.run.outage_timeout_s,
            lambda _exc: self.bus.count("publish_retries"),
        )

    async def commit(self, consumer, taken) -> None:
        offsets: dict[TopicPartition, int] = {}
        for tp, offset, _ in taken:
            offsets[tp] = max(offsets.get(tp, -1), offset + 1)
        if not offsets:
            return
        log.debug(
            "%s: took %s; committing %s",
            self.name,
            {f"{tp.partition}": sorted(o for t, o, _ in taken if t == tp) for tp in offsets},
            {tp.partition: o for tp, o in offsets.items()},
        )
        try:
            await consumer.commit({tp: OffsetAndMetadata(o, "") for tp, o in offsets.items()})
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance moved the partition: another explorer will redo these tasks, and
            # the trainer deduplicates by experience id. Nothing is lost.
            self.bus.count("commit_failures")
            log.warning(
                "%s: commit failed after rebalance (%s); tasks may be explored twice",
                self.name,
                exc,
            )

    # -- main loop -------------------------------------------------------------------------
    async def run(self) -> None:
        install_stop_handlers(self.stop, self.name)
        cfg = self.cfg
        await self.bus.start(listen_control=True, listen_status=True, heartbeat_s=HEARTBEAT_S)
        producer = kafka.data_producer(cfg.kafka, f"{self.name}-data")
        consumer = kafka.task_consumer(
            cfg.kafka, self.topics.tasks, tasks_group(self.topics), self.name, self._on_assign
        )
        try:
            await kafka.start_client(producer, f"{self.name} producer")
            await consumer.start()
            await self.bus.status(RunState.RUNNING, "started")
            step, synced = 0, -1
            while not self.stop.is_set() and not self.bus.shutdown_event.is_set():
                if cfg.explorer.max_steps and step >= cfg.explorer.max_steps:
                    break
                # one sync per step: a take that came back empty must not ask again (under
                # dynamic_by_explorer that is an unasked-for request and a version
                # published for nothing), unless a broadcast group waits for this explorer
                if step != synced or self.broadcast_pending():
                    if not await self.sync(step):
                        break
                    synced = step
                log.debug("%s: step %d on version %d: taking tasks", self.name, step, self.version)
                taken = await self.take_tasks(consumer, cfg.explorer.batch_size)
                tasks = [t for _, _, t in taken if t is not None]
                if not tasks:
                    await self.commit(consumer, taken)
                    continue
                t0 = time.perf_counter()
                groups = await asyncio.to_thread(
                    run_math_workflow,
                    self.engine,
                    tasks,
                    reward=self.reward,
                    repeat_times=cfg.explorer.repeat_times,
                    temperature=cfg.explorer.temperature,
                    max_new_tokens=cfg.explorer.max_new_tokens,
                    seed=cfg.run.seed * 1_000_003 + self.index * 10_007 + step,
                    run=self.topics.run,
                    explorer=self.name,
                    model_version=self.version,
                    explorer_step=step,
                )
                rollout_s = time.perf_counter() - t0
                await self.publish(producer, groups)
                await self.commit(consumer, taken)
                rewards = [e.reward for g in groups for e in g.experiences]
                lengths = [e.response_length for g in groups for e in g.experiences]
                self.bus.count("groups_published", len(groups))
                self.bus.count("experiences_published", len(rewards))
                step += 1
                self.bus.step = step
                await self.bus.metrics(
                    {
                        "explorer/reward_mean": sum(rewards) / len(rewards),
                        "explorer/response_length": sum(lengths) / len(lengths),
                        "explorer/rollout_seconds": rollout_s,
                        "explorer/groups": float(len(groups)),
                    }
                )
                await self.bus.status()
        finally:
            try:
                await self.bus.status(RunState.STOPPED, "stopped")
            except StreamRFTError:
                pass
            await consumer.stop()
            await producer.stop()
            await self.bus.stop()
            if self.receiver is not None:
                self.receiver.close()


def main(cfg: Config, index: int | None = None) -> None:
    asyncio.run(Explorer(cfg, index).run())
