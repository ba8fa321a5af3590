"""The trainer process: consume experience groups, learn, publish versions, checkpoint.

The step loop:
  collect ``batch_size`` fresh groups (decode -> dead letters, dedup, staleness filter)
  -> GRPO step -> publish a version every ``sync_interval`` steps -> eval / checkpoint
  -> metrics with the ledger of groups trained.
Offsets are committed only after a checkpoint, so a crash neither loses nor double-counts
an experience: the restarted trainer reloads weights, optimizer, seen ids and offsets
together.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from streamrft.consumers.grpo import grpo_step
from streamrft.consumers.warmup import sft_warmup
from streamrft.infra import kafka
from streamrft.infra.bus import HEARTBEAT_S, EventBus, read_history
from streamrft.infra.config import Config
from streamrft.infra.modeling import load_policy
from streamrft.infra.retry import retrying
from streamrft.infra.shutdown import install_stop_handlers
from streamrft.infra.taskset import read_taskset
from streamrft.schemas.codec import CONTROL, EXPERIENCE_GROUP
from streamrft.schemas.errors import SchemaError, StreamRFTError, SyncError
from streamrft.schemas.events import ModelVersionReady, RunState, Shutdown, TrainedGroup
from streamrft.schemas.experience import ExperienceGroup, check_token_ids
from streamrft.sync.methods import make_publisher
from streamrft.sync.styles import trainer_publishes
from streamrft.sync.weights import unique_state_dict

log = logging.getLogger(__name__)

STARVED_AFTER_S = 2 * HEARTBEAT_S
"""No experience at all for this long, with no batch to train, marks the trainer starved
on its status (see StatusEvent)."""


class _SeekOnAssign(ConsumerRebalanceListener):
    def __init__(self, consumer, offsets: dict[tuple[str, int], int]) -> None:
        self.consumer = consumer
        self.offsets = offsets

    async def on_partitions_revoked(self, revoked) -> None:
        pass

    async def on_partitions_assigned(self, assigned) -> None:
        for tp in assigned:
            offset = self.offsets.get((tp.topic, tp.partition))
            if offset is not None:
                self.consumer.seek(tp, offset)


Evaluator = Callable[[torch.nn.Module, object], dict[str, float]]
"""``evaluate(model, tokenizer) -> {"eval/accuracy": ...}``: handed to the trainer by the
application layer (``producers.evaluation.GreedyEvaluator``)."""


class Trainer:
    def __init__(self, cfg: Config, evaluate: Evaluator) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.topics = cfg.topics()
        self.bus = EventBus(cfg, "trainer", "trainer")
        self.stop = asyncio.Event()
        torch.set_num_threads(self.tcfg.threads)
        torch.manual_seed(cfg.run.seed)
        self.model, self.tokenizer = load_policy(cfg.model)
        self._evaluate = evaluate
        self.lora = cfg.model.lora.enabled
        self.optimizer: torch.optim.Optimizer | None = None  # made once the model is final
        self.ref_model = None
        self.base_version = -1
        """Last version published in full (LoRA runs publish adapters on top of it)."""
        self.sender = None  # a CollectiveSender when synchronizer.method is nccl
        self.members: list[str] = []
        if cfg.synchronizer.method == "nccl":
            from streamrft.sync.collective import CollectiveSender

            sync = cfg.synchronizer
            self.sender = CollectiveSender(
                sync.nccl_host, sync.nccl_port, sync.sync_timeout, sync.nccl_bucket_mb
            )
        self.train_tasks = read_taskset(cfg.taskset.path, cfg.taskset)
        self.buffer = ExperienceBuffer(self.tcfg.max_staleness)
        self.ckpt_root = cfg.run_dir / "checkpoints"
        self.publisher = make_publisher(cfg)
        self.step = 0
        self.version = -1
        self.resume_offsets: dict[tuple[str, int], int] = {}
        self.version_floor = -1

    # -- state -----------------------------------------------------------------------------
    def _state(self) -> dict:
        queued = {e.id for item in self.buffer.queue for e in item.group.experiences}
        return {
            "version": self.version,
            "offsets": [[t, p, o] for (t, p), o in self.buffer.resume_offsets().items()],
            "seen": sorted(self.buffer.seen - queued),
            "counters": self.bus.counters,
            "duplicates_dropped": self.buffer.duplicates_dropped,
            "stale_dropped": self.buffer.stale_dropped,
        }

    def _restore(self, path: Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step = self.bus.step = int(state["step"])
        self.version = int(state["version"])
        self.resume_offsets = {(t, int(p)): int(o) for t, p, o in state["offsets"]}
        self.buffer.seen = set(state["seen"])
        self.buffer.duplicates_dropped = int(state["duplicates_dropped"])
        self.buffer.stale_dropped = int(state["stale_dropped"])
        self.bus.counters.update(state["counters"])
        log.info("trainer: resumed from %s at step %d", path, self.step)

    async def checkpoint(self, consumer) -> None:
        path = await asyncio.to_thread(
            save_checkpoint, self.ckpt_root, self.step, self.model, self.optimizer, self._state()
        )
        offsets = {
            TopicPartition(t, p): OffsetAndMetadata(o, "")
            for (t, p), o in self.buffer.resume_offsets().items()
        }
        if offsets:
            try:
                await consumer.commit(offsets)
            except KafkaError as exc:  # the checkpoint holds the offsets; resume seeks to them
                log.warning("trainer: offset commit failed (%s); the checkpoint has them", exc)
        self.bus.count("checkpoints")
        log.info("trainer: checkpoint %s", path)

    # -- versions --------------------------------------------------------------------------
    async def published_versions_floor(self) -> int:
        """Highest version already announced on this run's control topic (-1: none).

        A resumed trainer may restart from a checkpoint older than the last version it
        announced; new versions continue above it so a version number never names two
        different sets of weights.
        """
        history = await read_history(self.cfg, self.topics.control, CONTROL, "trainer-resume")
        return max((ev.version for ev in history if isinstance(ev, ModelVersionReady)), default=-1)

    def _prepare_model(self) -> None:
        """After the warm-up: attach the LoRA adapter, then the optimizer and reference."""
        if self.lora:
            from streamrft.sync.lora import BaseModelView, attach_lora

            self.model = attach_lora(self.model, self.cfg.model.lora)
            if self.tcfg.kl_coef > 0:  # the base with the adapter off, no second copy
                self.ref_model = BaseModelView(self.model)
        elif self.tcfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.tcfg.lr,
            weight_decay=self.tcfg.weight_decay,
            betas=self.tcfg.betas,
        )

    async def publish_version(self) -> None:
        """Publish the current weights as the next version and announce it.

        LoRA runs publish the full model once per trainer process (the warmed-up base, so
        explorers that join later can build it) and only the adapter after that.
        """
        t0 = time.perf_counter()
        version = max(self.step, self.version_floor + 1, self.version + 1)
        members = self.bus.live_peers("explorer", 3 * HEARTBEAT_S) if self.sender else []
        new_group = bool(members) and (members != self.members or not self.sender.usable)
        # a new broadcast group starts with a full version: a LoRA member that joined late
        # has no base to put an adapter on
        adapter_only = self.lora and self.base_version >= 0 and not new_group
        if adapter_only:
            from streamrft.sync.lora import adapter_config_json, adapter_state_dict

            tensors = adapter_state_dict(self.model)
            extra = {"adapter_config.json": adapter_config_json(self.model)}
        else:
            tensors, extra = unique_state_dict(self.model), None
        if not adapter_only:
            self.base_version = version
        self.version_floor = version
        event = None
        if members:
            event = await self.broadcast(tensors, version, adapter_only, members, new_group)
        if event is None:  # the store method, or the fallback of a failed broadcast
            # an object store outage holds the step here (retried with backoff) rather
            # than failing the run; explorers keep exploring on their current version
            publish = functools.partial(
                self.publisher.publish,
                tensors,
                version,
                self.step,
                lora=adapter_only,
                extra_files=extra,
            )
            event = await retrying(
                f"trainer: publishing version {version}",
                lambda: asyncio.to_thread(publish),
                self.cfg.run.outage_timeout_s,
                lambda _exc: self.bus.count("publish_retries"),
            )
            event = msgspec.structs.replace(event, base_version=self.base_version)
            await self.bus.control(event)
        self.version = self.bus.version = event.version
        self.bus.count("versions_published")
        self.bus.counters["publish_seconds"] = (
            self.bus.counters.get("publish_seconds", 0) + time.perf_counter() - t0
        )

    async def broadcast(
        self, tensors, version: int, adapter_only: bool, members: list[str], new_group: bool
    ) -> ModelVersionReady | None:
        """Announce and broadcast a version to ``members``; None when the group failed."""
        from streamrft.sync.collective import spec_digest, tensor_specs

        uri = self.sender.open_epoch(members) if new_group else self.sender.uri
        self.members = members
        event = ModelVersionReady(
            version=version,
            method="nccl",
            uri=uri,
            manifest_sha256=spec_digest(tensor_specs(tensors)).hex(),
            bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            step=self.step,
            lora=adapter_only,
            created_at=time.time(),
            base_version=self.base_version,
        )
        await self.bus.control(event)
        try:
            await asyncio.to_thread(self.sender.broadcast, tensors, version)
        except SyncError as exc:
            self.bus.count("broadcast_failures")
            log.warning(
                "trainer: broadcast of version %d failed (%s); object store fallback", version, exc
            )
            self.members = []  # the next version forms a new group
            return None
        self.bus.count("versions_broadcast")
        return event

    async def maybe_publish(self) -> bool:
        """Publish at a step boundary when the sync style says so (and answer requests)."""
        sync = self.cfg.synchronizer
        pending = [r for r in self.bus.sync_requests if r.min_version > self.version]
        self.bus.sync_requests = pending
        if self.step <= self.version or not trainer_publishes(
            sync.style, self.step, sync.sync_interval, len(pending)
        ):
            return False
        await self.publish_version()
        self.bus.sync_requests = [r for r in pending if r.min_version > self.version]
        if sync.style == "dynamic_by_trainer":
            await self.bus.status(RunState.REQUIRE_SYNC, f"version {self.version} ready")
        return True

    async def evaluate(self) -> None:
        values = await asyncio.to_thread(self._evaluate, self.model, self.tokenizer)
        await self.bus.metrics(values)
        log.info(
            "trainer: step %d eval %s",
            self.step,
            ", ".join(f"{k} {v:.3f}" for k, v in values.items()),
        )

    # -- consuming -------------------------------------------------------------------------
    async def collect(self, consumer) -> list[ExperienceGroup] | None:
        """``batch_size`` fresh groups, or None on stop / when the stream stays idle."""
        loop = asyncio.get_running_loop()
        last_data = loop.time()
        while not self.stop.is_set():
            dropped = self.buffer.drop_stale(self.version)
            if dropped:
                log.info(
                    "trainer: dropped %d stale groups (version %d)", len(dropped), self.version
                )
            groups = self.buffer.take(self.tcfg.batch_size)
            if groups is not None:
                return groups
            if not self.bus.starved and loop.time() - last_data > STARVED_AFTER_S:
                self.bus.starved = True  # explorers waiting on a version go on
                await self.bus.status(detail="waiting for experiences")
            if self.bus.sync_requests:  # an explorer waits on us while we wait on data
                await self.maybe_publish()
            batches = await consumer.getmany(timeout_ms=200)
            for tp, records in batches.items():
                for rec in records:
                    try:
                        group = EXPERIENCE_GROUP.decode(rec.value, rec.headers)
                        check_token_ids(group, self.model.get_input_embeddings().num_embeddings)
                    except SchemaError as exc:
                        await self.bus.dead_letter(
                            tp.topic, tp.partition, rec.offset, rec.key, rec.value, exc
                        )
                        self.buffer.next_offsets[(tp.topic, tp.partition)] = rec.offset + 1
                        continue
                    if self.buffer.offer(group, (tp.topic, tp.partition), rec.offset):
                        self.bus.count("experiences_consumed", len(group.experiences))
            if batches:
                last_data = loop.time()
                if self.bus.starved:
                    self.bus.starved = False
                    await self.bus.status()
            elif loop.time() - last_data > self.tcfg.idle_timeout_s:
                log.warning(
                    "trainer: no experiences for %.0fs; finishing", self.tcfg.idle_timeout_s
                )
                return None
        return None

    # -- main loop -------------------------------------------------------------------------
    async def run(self) -> None:
        install_stop_handlers(self.stop, "trainer")
        tcfg = self.tcfg
        await self.bus.start(
            listen_control=True, listen_status=self.sender is not None, heartbeat_s=HEARTBEAT_S
        )
        consumer = kafka.experience_consumer(
            self.cfg.kafka,
            self.topics.experiences,
            f"{self.topics.prefix}.{self.topics.run}.trainer",
            "trainer",
        )
        try:
            ckpt = latest_checkpoint(self.ckpt_root) if tcfg.resume else None
            if ckpt is None and tcfg.warmup_sft_steps:
                await self.bus.status(
                    RunState.RUNNING, f"SFT warm-up, {tcfg.warmup_sft_steps} steps"
                )
                losses = await asyncio.to_thread(
                    sft_warmup,
                    self.model,
                    self.tokenizer,
                    self.train_tasks,
                    tcfg.warmup_sft_steps,
                    tcfg.warmup_sft_batch,
                    tcfg.warmup_sft_lr,
                    self.cfg.run.seed,
                )
                await self.bus.metrics(
                    {"warmup/sft_loss_first": losses[0], "warmup/sft_loss_last": losses[-1]}
                )
            self._prepare_model()
            if ckpt is not None:
                self._restore(ckpt)
            self.version_floor = await self.published_versions_floor()
            await self.publish_version()
            await self.evaluate()
            consumer.subscribe(
                [self.topics.experiences], listener=_SeekOnAssign(consumer, self.resume_offsets)
            )
            await kafka.start_client(consumer, "trainer experience consumer")
            await self.bus.status(RunState.RUNNING, "training")
            while not self.stop.is_set() and (tcfg.max_steps == 0 or self.step < tcfg.max_steps):
                t_wait = time.perf_counter()
                groups = await self.collect(consumer)
                if groups is None:
                    break
                wait_s = time.perf_counter() - t_wait
                t0 = time.perf_counter()
                values = await asyncio.to_thread(
                    grpo_step,
                    self.model,
                    self.optimizer,
                    groups,
                    tcfg,
                    self.tokenizer.pad_token_id,
                    self.cfg.explorer.temperature,
                    self.ref_model,
                )
                staleness = [self.version - g.model_version for g in groups]
                self.step = self.bus.step = self.step + 1
                self.bus.count("groups_trained", len(groups))
                self.bus.count("experiences_trained", sum(len(g.experiences) for g in groups))
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
                    }
                )
                trained = [TrainedGroup(g.id, g.model_version) for g in groups]
                if self.step % 10 == 0 or self.step == 1:
                    log.info(
                        "trainer: step %d reward %.3f loss %.4f grad_norm %.3f clip_frac %.3f "
                        "logp_diff %.2e staleness %.2f wait %.2fs step %.2fs",
                        self.step,
                        values["train/reward_mean"],
                        values["train/loss"],
                        values["train/grad_norm"],
                        values["train/clip_frac"],
                        values["train/logprob_max_abs_diff"],
                        values["train/staleness_mean"],
                        wait_s,
                        values["train/step_seconds"],
                    )
                await self.bus.metrics(values, trained)
                published = await self.maybe_publish()
                if tcfg.eval_interval and self.step % tcfg.eval_interval == 0:
                    await self.evaluate()
                if tcfg.save_interval and self.step % tcfg.save_interval == 0:
                    await self.checkpoint(consumer)
                if not published or self.cfg.synchronizer.style != "dynamic_by_trainer":
                    await self.bus.status(RunState.RUNNING)
            if not tcfg.eval_interval or self.step % tcfg.eval_interval:
                await self.evaluate()
            await self.checkpoint(consumer)
            await self.bus.metrics(
                {
                    "trainer/final_step": float(self.step),
                    "trainer/duplicates_dropped": float(self.buffer.duplicates_dropped),
                    "trainer/stale_dropped": float(self.buffer.stale_dropped),
                    **{f"trainer/{k}": float(v) for k, v in self.bus.counters.items()},
                }
            )
            await self.bus.control(
                Shutdown(reason=f"trainer finished at step {self.step}", created_at=time.time())
            )
        finally:
            try:
                await self.bus.status(RunState.STOPPED, f"stopped at step {self.step}")
            except StreamRFTError:
                pass
            await consumer.stop()
            await self.bus.stop()
            if self.sender is not None:
                self.sender.close()


def main(cfg: Config, evaluate: Evaluator) -> None:
    asyncio.run(Trainer(cfg, evaluate).run())
