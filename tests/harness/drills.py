"""Fault drills: run a real job, break something on purpose, then audit the books.

Each drill starts its own local services, runs ``streamrft run`` (feeder, two explorers,
trainer as OS processes) on a small job whose step budget trains every fed task exactly
once, injects one fault while the trainer is mid-run, and then reads the run's topics
back to check that nothing was lost or trained twice:

- **tasks fed** = distinct (task, epoch) pairs on the ``tasks`` topic;
- **trained** = distinct groups in the trainer's ledger (the ``trained`` rows of its
  metrics, the last attempt of each step; a step redone after a resume replaces the
  attempt whose update was lost with the crash);
- **tasks lost** = fed - trained - dropped for a stated reason (stale groups, counted by
  the trainer);
- **duplicates trained** = groups in the ledger of more than one step;
- **dead letters unaccounted** = dead letters whose source offset is not one the drill
  injected as invalid.

The drills: ``explorer_kill`` (SIGKILL an explorer mid-step; the supervisor restarts it),
``trainer_kill`` (SIGKILL the trainer mid-step; it resumes from its checkpoint),
``store_outage`` (the object store down for 20 s), ``broker_restart`` (SIGKILL the broker
on ``s3://`` storage and start it again), ``corrupt_shard`` (weight shards stored with
other bytes than the trainer sent, before explorers fetch them), ``fuzz`` (1,000+ malformed
messages into ``experiences`` and ``control``), ``poison_batch`` (groups no trainer can take: over its
limits, or killing it), ``hostile`` (schema-valid records no process may act on: groups
past the trainer's limits, version announcements pointing where the run does not allow).
``bench/reliability.py`` runs them all; the e2e tests run them one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from streamrft.infra import kafka
from streamrft.infra.config import (
    S3_BROKER_FETCH_WAIT_MS,
    Config,
    load_config,
    with_endpoints,
    with_run_id,
    with_store_credentials,
)
from streamrft.infra.consume import Record, consume, read_topic
from streamrft.infra.local.services import BROKER, OBJECT_STORE, LocalServices
from streamrft.infra.pids import port_open
from streamrft.schemas.codec import CONTROL, DEAD_LETTER, EXPERIENCE_GROUP, METRICS, STATUS, TASK
from streamrft.schemas.events import (
    MetricsEvent,
    ModelVersionReady,
    Shutdown,
    StatusEvent,
    SyncRequest,
)
from tests.harness.store_relay import BitRotRelay, RequestRelay, VersionGate
from tests.helpers.cli import env, overrides, streamrft_cmd
from tests.helpers.groups import make_group
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import child_pid, frozen

EPOCHS = 2
TASKS = 100 * EPOCHS  # examples/data/addition.jsonl has 100 tasks
GROUPS_PER_STEP = 20
STEPS = TASKS // GROUPS_PER_STEP
FAULT_AT_STEP = 3
RUN_TIMEOUT_S = 420.0

DRILL_OVERRIDES = [
    f"taskset.total_epochs={EPOCHS}",
    "explorer.count=2",
    "explorer.batch_size=10",
    "explorer.repeat_times=4",
    f"trainer.batch_size={GROUPS_PER_STEP}",
    f"trainer.max_steps={STEPS}",
    "trainer.ppo_epochs=1",
    "trainer.warmup_sft_steps=0",
    "eval.interval=0",
    "trainer.save_interval=2",
    "trainer.idle_timeout_s=60",
    # reliability, not learning: nothing is dropped as stale, so every fed task must train
    "trainer.max_staleness=1000",
    "synchronizer.sync_offset=4",
    "synchronizer.sync_timeout=120",
    # the drills test the store path (a store down, a corrupted shard): no shared memory
    "synchronizer.method=object_store",
    "monitor.progress=false",
    "monitor.log_level=DEBUG",
]


@dataclass
class DrillResult:
    drill: str
    recovered: bool
    recover_s: float | None
    tasks_fed: int
    tasks_trained: int
    tasks_dropped: int
    tasks_lost: int
    duplicates_trained: int
    dead_letters: int
    dead_letters_unaccounted: int
    wall_s: float
    exit_code: int | None
    detail: dict = field(default_factory=dict)

    def row(self) -> dict:
        return asdict(self)


@dataclass
class _Watch:
    """What the drill has seen of the run so far (from its metrics and control topics)."""

    step: int = 0
    step_times: list[tuple[float, int]] = field(default_factory=list)
    versions: dict[int, ModelVersionReady] = field(default_factory=dict)
    explorer_versions: dict[str, int] = field(default_factory=dict)


async def _read_topic(cfg: Config, topic: str, codec) -> list[tuple[int, int, object | None]]:
    """(partition, offset, decoded or None) of every message of a topic."""
    records = await read_topic(cfg.kafka, topic, codec, "drill-books")
    return [(r.partition, r.offset, r.obj) for r in records]


async def audit_run(
    cfg: Config, run_id: str, injected_invalid: frozenset | set = frozenset()
) -> tuple[dict, dict]:
    """The books of run ``run_id`` read back from its topics (module docstring), and the
    retries its components counted (their newest status counters)."""
    topics = cfg.topics()
    tasks = await _read_topic(cfg, topics.tasks, TASK)
    fed = {f"{run_id}/{t.id}@{t.epoch}" for _, _, t in tasks if t is not None}
    ledger: dict[int, object] = {}
    final: dict[str, float] = {}
    for _, _, ev in await _read_topic(cfg, topics.metrics, METRICS):
        if ev is None or ev.component != "trainer":
            continue
        if ev.trained:
            ledger[ev.step] = ev  # the last attempt of each step
        if "trainer/final_step" in ev.values:
            final = dict(ev.values)
    times: dict[str, int] = {}
    for ev in ledger.values():
        for row in ev.trained:
            times[row.group_id] = times.get(row.group_id, 0) + 1
    dead = [d for _, _, d in await _read_topic(cfg, topics.dead_letters, DEAD_LETTER)]
    sources = {(d.source_topic, d.partition, d.offset) for d in dead if d is not None}
    counters: dict[str, dict[str, float]] = {}
    for _, _, ev in await _read_topic(cfg, topics.status, STATUS):
        if ev is not None:
            counters[ev.component] = ev.counters  # the newest of each component
    retries = {
        name: int(sum(c.get(name, 0) for c in counters.values()))
        for name in ("send_retries", "publish_retries", "store_unavailable")
    }
    stale = int(final.get("trainer/stale_dropped", 0))
    trained = set(times) & fed
    return {
        "tasks_fed": len(fed),
        "tasks_trained": len(trained),
        "tasks_dropped": stale,
        "tasks_lost": max(0, len(fed - trained) - stale),
        "duplicates_trained": sum(1 for n in times.values() if n > 1),
        "foreign_trained": len(set(times) - fed),
        "dead_letters": len(sources),
        "dead_letters_unaccounted": len(sources - set(injected_invalid))
        + sum(1 for d in dead if d is None),
        "dead_letters_missing": len(set(injected_invalid) - sources),
        "duplicates_dropped": int(final.get("trainer/duplicates_dropped", 0)),
        "final_step": int(final.get("trainer/final_step", 0)),
    }, retries


async def explorer_rejections(cfg: Config) -> dict[int, tuple[str, str]]:
    """Version -> (kind, reason) of every rejection the explorers' status reported."""
    said: dict[int, tuple[str, str]] = {}
    for _, _, ev in await _read_topic(cfg, cfg.topics().status, STATUS):
        if ev is not None and ev.role == "explorer":
            for r in ev.rejected:
                said[r.version] = (r.kind, r.reason)
    return said


class Drill(ABC):
    """One drill: services, the run as a subprocess, a fault, the books.

    A drill states its fault (:meth:`fault`) and its own evidence that the fault really
    happened and was handled (:meth:`check`); balanced books alone would also balance
    after a fault that never came.
    """

    fault_at_step = FAULT_AT_STEP
    """The fault comes once the trainer has finished this many steps."""
    steps = STEPS
    """The steps the run ends with (fewer when the drill makes a batch untrainable)."""

    def __init__(self, name: str, workdir: Path, broker_storage: str = "memory") -> None:
        self.name = name
        self.workdir = Path(workdir)
        self.services = LocalServices(self.workdir / "services", broker_storage=broker_storage)
        self.run_id = f"drill-{name.replace('_', '-')}-{os.getpid()}-{int(time.time())}"
        self.watch = _Watch()
        self.fault_started: float | None = None
        self.fault_ended: float | None = None
        self.injected_invalid: set[tuple[str, int, int]] = set()
        self.detail: dict = {}
        self.cfg: Config | None = None
        self.proc: subprocess.Popen | None = None
        self.relay: RequestRelay | None = None

    # -- the run ---------------------------------------------------------------------------
    def overrides(self) -> list[str]:
        eps = self.services.endpoints
        return [
            *DRILL_OVERRIDES,
            f"run.dir={self.workdir / 'runs'}",
            f"kafka.bootstrap_servers={eps.bootstrap_servers}",
            f"object_store.endpoint={self.store_endpoint()}",
            f"object_store.access_key={eps.access_key}",
        ]

    def make_relay(self, target: tuple[str, int]) -> RequestRelay | None:
        """A relay this drill puts between the run and the object store (None: none)."""
        return None

    def store_endpoint(self) -> str:
        """Where the run's processes reach the object store: the store, or this drill's
        relay in front of it (made before the run starts: every request goes through it)."""
        direct = self.services.endpoints.s3_endpoint or ""
        if self.relay is None:
            host, port = direct.rsplit(":", 1)
            self.relay = self.make_relay((host, int(port)))
            if self.relay is None:
                return direct
            self.relay.start()
        return self.relay.endpoint

    def _start_run(self) -> None:
        # every setting is an override (the drill's own config is built from the same list),
        # the secret key comes from the environment only
        argv = streamrft_cmd("run", str(EXAMPLE), "--run-id", self.run_id, "--no-progress")
        argv += overrides(*self.overrides())
        secret = {"STREAMRFT_S3_SECRET_KEY": self.services.endpoints.secret_key or ""}
        log = (self.workdir / f"{self.name}.log").open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env() | secret, cwd=self.workdir
        )

    def _kill_leftovers(self) -> None:
        """After a failed drill: nothing of the run may outlive it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for role in ("train", "explore", "feed"):
            while (pid := self.pid_of(role)) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)

    def pid_of(self, role: str, name: str | None = None) -> int | None:
        """Pid of a child of this run: ``role`` is train/explore/feed."""
        return child_pid(self.run_id, role, name)

    async def _follow(self, stop: asyncio.Event) -> None:
        topics = self.cfg.topics()
        codecs = {topics.metrics: METRICS, topics.control: CONTROL, topics.status: STATUS}
        reader = kafka.event_reader(self.cfg.kafka, list(codecs), "drill")
        await kafka.start_client(reader, "drill watch")
        try:  # undecodable records are the fuzz drill's own messages: skipped here
            await consume(reader, codecs, self._watch, stop=stop)
        finally:
            await reader.stop()

    def _watch(self, rec: Record) -> None:
        ev = rec.obj
        if isinstance(ev, MetricsEvent):
            if ev.component == "trainer" and "train/loss" in ev.values:
                self.watch.step = max(self.watch.step, ev.step)
                self.watch.step_times.append((time.time(), ev.step))
        elif isinstance(ev, StatusEvent):
            if ev.role == "explorer":
                self.watch.explorer_versions[ev.component] = ev.version
        elif isinstance(ev, ModelVersionReady):
            self.watch.versions[ev.version] = ev

    async def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: the run ended before {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: timed out waiting for {what}")
            await asyncio.sleep(0.05)

    @abstractmethod
    async def fault(self) -> None:
        """Inject this drill's fault; sets ``fault_started`` and ``fault_ended``."""

    async def _drive(self) -> None:
        stop = asyncio.Event()
        follower = asyncio.create_task(self._follow(stop))
        try:
            await self._wait(lambda: self.watch.step >= self.fault_at_step, 240, "the fault step")
            self.detail["step_at_fault"] = self.watch.step
            await self.fault()
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                self.detail["timed_out"] = True
                await asyncio.to_thread(self.proc.wait, 60)
        finally:
            stop.set()
            await follower

    # -- the books -------------------------------------------------------------------------
    async def books(self) -> dict:
        books, self.detail["retries"] = await audit_run(
            self.cfg, self.run_id, self.injected_invalid
        )
        return books

    def _recover_s(self) -> float | None:
        if self.fault_ended is None:
            return None
        base = max((s for t, s in self.watch.step_times if t <= self.fault_started), default=0)
        after = [t for t, s in self.watch.step_times if t >= self.fault_ended and s > base]
        return round(min(after) - self.fault_ended, 2) if after else None

    # -- the whole drill -------------------------------------------------------------------
    def run(self) -> DrillResult:
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.services:
            eps = self.services.endpoints
            self.cfg = with_store_credentials(
                with_endpoints(
                    with_run_id(load_config(EXAMPLE, self.overrides()), self.run_id),
                    eps.bootstrap_servers,
                    eps.s3_endpoint,
                ),
                eps.access_key,
                eps.secret_key,
            )
            self._start_run()
            try:
                asyncio.run(self._drive())
            finally:
                self._kill_leftovers()
                if self.relay is not None:
                    self.relay.release()  # nothing held may outlive the run
                    self.relay.close()
            books = asyncio.run(self.books())
        summary_path = self.workdir / "runs" / self.run_id / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        self.detail.update(
            restarts=summary.get("restarts"),
            versions_rejected=summary.get("versions_rejected"),
            duplicates_dropped=books.pop("duplicates_dropped"),
            foreign_trained=books.pop("foreign_trained"),
            dead_letters_missing=books.pop("dead_letters_missing"),
            final_step=books.pop("final_step"),
        )
        finished = self.proc.returncode == 0 and self.detail["final_step"] == self.steps
        balanced = (
            books["tasks_lost"] == 0
            and books["duplicates_trained"] == 0
            and books["dead_letters_unaccounted"] == 0
            and self.detail["dead_letters_missing"] == 0  # every injected one was caught
            and books["tasks_fed"] == TASKS
        )
        return DrillResult(
            drill=self.name,
            recovered=finished and balanced and self.check(books),
            recover_s=self._recover_s(),
            wall_s=round(time.monotonic() - started, 1),
            exit_code=self.proc.returncode,
            detail=self.detail,
            **books,
        )

    @abstractmethod
    def check(self, books: dict) -> bool:
        """This drill's own evidence that the fault really happened and was handled: from
        ``self.detail`` (the run's summary and status counters, what the fault recorded)
        and ``books`` (what :meth:`books` counted)."""


class ExplorerKill(Drill):
    async def fault(self) -> None:
        pid = self.pid_of("explore", "--index 0")
        self.fault_started = time.time()
        os.kill(pid, signal.SIGKILL)
        self.detail["killed_pid"] = pid
        self.fault_ended = time.time()

    def check(self, books: dict) -> bool:  # the supervisor restarted the killed explorer
        return (self.detail.get("restarts") or {}).get("explorer-0", 0) >= 1


class TrainerKill(Drill):
    async def fault(self) -> None:
        await self._wait(lambda: self.watch.step >= 5, 120, "trainer step 5")
        pid = self.pid_of("train")
        self.fault_started = time.time()
        os.kill(pid, signal.SIGKILL)
        self.detail["killed_at_step"] = self.watch.step
        self.fault_ended = time.time()

    def check(self, books: dict) -> bool:  # the supervisor restarted the killed trainer
        return (self.detail.get("restarts") or {}).get("trainer", 0) >= 1


class ServiceDown(Drill):
    """SIGKILL one local service, keep it down ``DOWN_S``, start it again on its port.

    Records what it saw: ``service_pids`` (the process before and after),
    ``service_was_down`` (the old process was gone and nothing answered on the service's
    port, both right after the kill and at the end of the outage) and ``service_back`` (a
    new process of the service is alive).
    """

    SERVICE = OBJECT_STORE
    DOWN_S = 20.0

    def _service_process(self) -> tuple[int, Callable[[], bool], int]:
        """(pid, whether it is alive, port) of the service as LocalServices holds it now."""
        svc = self.services._service(self.SERVICE)  # a drill reads it; never changes it
        return svc.pid, svc.alive, svc.port

    def _down(self, alive: Callable[[], bool], port: int) -> bool:
        return not alive() and not port_open(port)

    async def fault(self) -> None:
        old_pid, old_alive, port = self._service_process()
        self.fault_started = time.time()
        await asyncio.to_thread(self.services.kill, self.SERVICE)
        down_at_kill = await asyncio.to_thread(self._down, old_alive, port)
        await asyncio.sleep(self.DOWN_S)
        down_at_end = await asyncio.to_thread(self._down, old_alive, port)
        await asyncio.to_thread(self.services.restart, self.SERVICE)
        self.fault_ended = time.time()
        new_pid, new_alive, _ = self._service_process()
        self.detail.update(
            down_s=self.DOWN_S,
            service_pids=[old_pid, new_pid],
            service_was_down=down_at_kill and down_at_end,
            service_back=new_alive() and new_pid != old_pid,
        )


class StoreOutage(ServiceDown):
    def check(self, books: dict) -> bool:  # the outage was felt: a publish or a fetch was retried
        retries = self.detail.get("retries", {})
        return retries.get("publish_retries", 0) + retries.get("store_unavailable", 0) >= 1


class BrokerRestart(ServiceDown):
    SERVICE = BROKER
    DOWN_S = 5.0

    def __init__(self, name: str, workdir: Path) -> None:
        super().__init__(name, workdir, broker_storage="s3")

    def overrides(self) -> list[str]:  # what `streamrft run` sets for its own s3 broker
        wait = S3_BROKER_FETCH_WAIT_MS
        return [
            *super().overrides(),
            f"kafka.control_fetch_max_wait_ms={wait}",
            f"kafka.data_fetch_max_wait_ms={wait}",
        ]

    def check(self, books: dict) -> bool:
        """The broker really went down mid-run, and the run rode it out.

        Down: its process was gone and its port refused connections for the whole outage,
        while the trainer was short of its last step; then a new broker process answered.
        Rode it out: the trainer's metrics (read back from the restarted broker) show a
        step finished after the broker was back. The clients' retry counters are kept in
        ``detail["retries"]`` but not required: a short outage can be bridged inside
        aiokafka (its own reconnects) without an error reaching the retry loop.
        """
        return (
            self.detail.get("service_was_down") is True
            and self.detail.get("service_back") is True
            and self.detail.get("step_at_fault", STEPS) < STEPS
            and self._recover_s() is not None
        )


class CorruptShard(Drill):
    """Bit rot in published weight shards, there before explorers fetch them.

    A relay in front of the object store (``tests/harness/store_relay.py``) stores the shards of
    the versions after 0 with other bytes than the trainer sent, until an explorer has
    fetched one; each manifest holds the sha256 of the real bytes. Version 0 stays good:
    explorers need weights to start with (a bad version 0 stops a run, by design).
    Explorers must reject the rotten versions by their sha256, keep their weights, and
    take a later one. The rot is in the store before a version is announced, so no
    explorer can fetch a version ahead of it, however busy the machine; the fault ends
    when an explorer fetches a rotten shard.
    """

    fault_at_step = 0

    def make_relay(self, target: tuple[str, int]) -> RequestRelay:
        return BitRotRelay(target, self.run_id)

    async def fault(self) -> None:
        relay = self.relay
        assert isinstance(relay, BitRotRelay)  # made with the run's overrides
        self.fault_started = time.time()
        await self._wait(relay.fetched.is_set, 240, "an explorer fetching a rotten shard")
        self.fault_ended = time.time()
        self.detail["corrupted_shards"] = [p for paths in relay.rotten.values() for p in paths]
        self.detail["rotten_versions"] = sorted(relay.rotten)

    async def books(self) -> dict:
        books = await super().books()
        said = await explorer_rejections(self.cfg)
        self.detail["rejected_seen"] = {v: kind for v, (kind, _) in said.items()}
        return books

    def check(self, books: dict) -> bool:
        """Explorers rejected a rotten version by its sha256 (an integrity rejection), and
        no version but rotten ones."""
        rejected = self.detail.get("versions_rejected") or {}
        seen = self.detail.get("rejected_seen") or {}
        rotten = set(self.detail.get("rotten_versions") or ())
        return (
            sum(rejected.values()) >= 1
            and bool(seen)
            and set(seen) <= rotten
            and all(kind == "integrity" for kind in seen.values())
        )


class Fuzz(Drill):
    PER_TOPIC = 800  # of which the invalid ones are injected

    async def fault(self) -> None:
        from tests.harness.fuzz import expected_valid, fuzz_messages, inject

        topics = self.cfg.topics()
        self.fault_started = time.time()
        total = 0
        # the trainer is held while the messages go in: they then lie before groups it still
        # needs (the explorers stay within sync_offset of its versions), so it reads every
        # one before its last step however slowly they go in on a busy machine (beside two
        # CPU hogs, 658 lay past its last step)
        with frozen(child_pid(self.run_id, "train")):
            for kind, topic, seed in (
                ("experiences", topics.experiences, 1),
                ("control", topics.control, 2),
            ):
                msgs = [
                    m
                    for m in fuzz_messages(kind, self.PER_TOPIC, seed)
                    if not expected_valid(kind, m)
                ]
                for partition, offset in await inject(self.cfg, topic, msgs):
                    self.injected_invalid.add((topic, partition, offset))
                self.detail[f"injected_{kind}"] = len(msgs)
                total += len(msgs)
        self.detail["injected"] = total
        self.fault_ended = time.time()

    def overrides(self) -> list[str]:  # the trainer is held above for as long as it takes
        return [*super().overrides(), "trainer.idle_timeout_s=600"]

    def check(self, books: dict) -> bool:  # 1,000+ invalid messages, each one dead-lettered
        injected = self.detail.get("injected", 0)
        return injected >= 1000 and books["dead_letters"] == injected


class PoisonBatch(Drill):
    """Groups no trainer can take: two valid but oversized groups from an outside producer
    (more rows than ``trainer.max_group_rows``, an experience past the model's context),
    each dead-lettered at intake; then the trainer SIGKILLed twice while training the same
    batch (what an OOM kill or a device assert does): the third trainer sets that batch's
    groups aside (dead letters with the reason) and the run goes on without them."""

    steps = STEPS - 1  # the batch set aside is never trained

    def overrides(self) -> list[str]:
        # a row per micro-batch: a step lasts long enough to be caught in flight
        return [*super().overrides(), "trainer.micro_batch_size=1", "trainer.idle_timeout_s=20"]

    def _inflight(self) -> tuple[list[str], int] | None:
        """The trainer's batch in flight and how many trainers started it (its poison
        record: the batch, and the crashed batches each group was in before)."""
        path = self.workdir / "runs" / self.run_id / "checkpoints" / "poison.json"
        try:
            data = json.loads(path.read_text())
            batch, crashes = data["batch"], data["crashes"]
        except (OSError, ValueError, KeyError):
            return None
        if not batch:
            return None
        return sorted(batch), 1 + max(crashes.get(gid, 0) for gid in batch)

    async def fault(self) -> None:
        from tests.harness.fuzz import FuzzMessage, inject

        self.fault_started = time.time()
        rows = make_group(self.run_id, "too-many-rows", 0, n=300)
        long_tokens = [[1] + [5] * 198 + [2]]
        long = make_group(
            self.run_id, "too-long", 0, n=1, tokens=long_tokens, logprobs=[[-0.5] * 196],
            masks=[[1] * 196],
        )  # fmt: skip
        msgs = [
            FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers())
            for g in (rows, long)
        ]
        topics = self.cfg.topics()
        for partition, offset in await inject(self.cfg, topics.experiences, msgs):
            self.injected_invalid.add((topics.experiences, partition, offset))
        killed: list[list[str]] = []
        for attempt in (1, 2):  # the same batch, started by two trainers in turn

            def in_flight(attempt: int = attempt) -> bool:
                found = self._inflight()
                alive = self.pid_of("train") is not None
                return found is not None and found[1] == attempt and alive

            await self._wait(in_flight, 240, f"trainer {attempt} training the batch")
            ids, _ = self._inflight() or ([], 0)
            if killed and ids != killed[0]:
                raise RuntimeError(f"{self.name}: the second trainer started another batch")
            killed.append(ids)
            os.kill(self.pid_of("train"), signal.SIGKILL)
            await self._wait(lambda: self.pid_of("train") is None, 30, "the trainer to die")
        self.detail["killed_batch"] = killed[0]
        self.fault_ended = time.time()

    async def books(self) -> dict:
        books = await super().books()
        topics = self.cfg.topics()
        aside = set()
        for _, _, d in await _read_topic(self.cfg, topics.dead_letters, DEAD_LETTER):
            if d is not None and "trainers died" in d.reason and d.value is not None:
                aside.add(EXPERIENCE_GROUP.decode(d.value).id)
                self.injected_invalid.add((d.source_topic, d.partition, d.offset))
        self.detail["set_aside"] = sorted(aside)
        # the batch set aside is dropped with a stated reason, like a stale group
        books["tasks_dropped"] += len(aside)
        books["tasks_lost"] = max(0, books["tasks_lost"] - len(aside))
        books["dead_letters_unaccounted"] -= len(aside)
        return books

    def check(self, books: dict) -> bool:  # the batch killed on twice is the one set aside
        restarts = (self.detail.get("restarts") or {}).get("trainer", 0)
        return restarts >= 2 and self.detail.get("set_aside") == self.detail.get("killed_batch")


class Hostile(Drill):
    """Schema-valid records no process may act on, on the topics the run's processes read:
    experience groups past the trainer's limits or of a kind it does not train, and
    version announcements that point where the run does not allow (a method it does not
    use, another run's prefix, a path out of it), claim a size no version of the model
    has, carry a wrong digest or build on a version never announced; with them an old
    Shutdown replayed and a sync request for a version that never comes. Each group is
    dead-lettered with its reason; each announcement is refused or rejected with its reason
    in the explorers' status; the run finishes with balanced books.

    The store holds the trainer's versions after 0 back until every record is in (a relay
    in front of it, ``tests/harness/store_relay.py`` :class:`VersionGate`): the explorers
    then come to a sync point that waits for version 1 after the hostile announcements
    are there, and version 0, whose manifest one of them copies, is not retired yet,
    however fast the run goes while the drill injects."""

    fault_at_step = 0  # as soon as version 0 is out: every explorer step comes after
    BASE = 1_000_000
    """Hostile announcements carry versions from here: newer than any the trainer makes, so
    every explorer tries (or refuses) each at its next sync point."""

    def make_relay(self, target: tuple[str, int]) -> RequestRelay:
        return VersionGate(target, self.run_id)

    def _groups(self) -> list[tuple[object, str]]:
        """(group, the reason its dead letter must give)."""
        run = self.run_id
        width = 196  # prompt 4 + 196: past the tiny model's 128 positions
        return [
            (
                make_group(run, "hostile-rows", 0, n=300, tokens=[[1, 5, 6, 7, 8, 2]] * 300),
                "more than trainer.max_group_rows",
            ),
            (
                make_group(
                    run,
                    "hostile-long",
                    0,
                    n=1,
                    tokens=[[1] * 4 + [5] * width],
                    logprobs=[[-0.5] * width],
                    masks=[[1] * width],
                ),
                "longer than the model's context",
            ),
            (
                make_group(run, "hostile-vocab", 0, n=2, tokens=[[1, 5, 6, 7, 10**6, 2]] * 2),
                "outside the model's vocabulary",
            ),
            (
                make_group(run, "hostile-pair", 0, n=2, kind="preference"),
                "is trained only by",
            ),
        ]

    def _versions(self, good: ModelVersionReady) -> dict[int, tuple[ModelVersionReady, str]]:
        """version -> (hostile announcement, the kind of rejection it must get)."""
        import msgspec

        bucket = self.cfg.object_store.bucket
        v = self.BASE

        def like(n: int, **fields) -> ModelVersionReady:
            return msgspec.structs.replace(good, version=v + n, step=v + n, **fields)

        return {
            v: (like(0, method="nccl", uri="gloo://10.9.9.9:29500/1?members=explorer-0,explorer-1"), "refused"),
            v + 1: (like(1, method="filesystem", uri="file:///etc/passwd"), "refused"),
            v + 2: (like(2, uri=f"s3://{bucket}/another-run/v00000000/manifest.json"), "integrity"),
            v + 3: (like(3, uri=f"s3://{bucket}/{self.run_id}/../another-run/manifest.json"), "integrity"),
            v + 4: (like(4, bytes=10**15), "integrity"),
            v + 5: (like(5, uri=self._manifest_copy(good, v + 5), manifest_sha256="0" * 64), "integrity"),
            v + 6: (like(6, delta_base=v - 1, state_sha256="0" * 64), "integrity"),
        }  # fmt: skip

    def _manifest_copy(self, good: ModelVersionReady, version: int) -> str:
        """The uri of a copy of ``good``'s manifest where the run keeps ``version``: an
        announcement of it passes every location check and fails on its digest."""
        from streamrft.sync.object_store import make_client, parse_uri

        client = make_client(self.cfg.object_store)
        bucket, key = parse_uri(good.uri)
        blob = client.get_object(bucket, key).read()
        copy = f"{self.run_id}/v{version:08d}/manifest.json"
        client.put_object(bucket, copy, io.BytesIO(blob), len(blob))
        return f"s3://{bucket}/{copy}"

    async def fault(self) -> None:
        from tests.harness.fuzz import FuzzMessage, inject

        await self._wait(lambda: 0 in self.watch.versions, 240, "version 0")
        self.fault_started = time.time()
        topics = self.cfg.topics()
        groups = self._groups()
        data = [
            FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers()) for g, _ in groups
        ]
        expected: dict[str, str] = {}
        for (partition, offset), (_, reason) in zip(
            await inject(self.cfg, topics.experiences, data), groups, strict=True
        ):
            self.injected_invalid.add((topics.experiences, partition, offset))
            expected[f"{partition}@{offset}"] = reason
        self.detail["expected_reasons"] = expected
        versions = self._versions(self.watch.versions[0])
        control = [
            *(event for event, _ in versions.values()),
            Shutdown(reason="replayed from an earlier run", created_at=1.0),
            SyncRequest(explorer="explorer-9", min_version=10**9, created_at=time.time()),
        ]
        await inject(
            self.cfg,
            topics.control,
            [FuzzMessage(CONTROL.encode(e), CONTROL.headers()) for e in control],
        )
        self.detail["expected_kinds"] = {v: kind for v, (_, kind) in versions.items()}
        assert self.relay is not None
        self.relay.release()  # version 1 and the rest may go out now
        self.fault_ended = time.time()

    async def books(self) -> dict:
        books = await super().books()
        topics = self.cfg.topics()
        said = await explorer_rejections(self.cfg)
        self.detail["rejected"] = {v: said.get(v) for v in self.detail.get("expected_kinds", {})}
        reasons = {}
        for _, _, d in await _read_topic(self.cfg, topics.dead_letters, DEAD_LETTER):
            if d is not None and d.source_topic == topics.experiences:
                reasons[f"{d.partition}@{d.offset}"] = d.reason
        self.detail["dead_letter_reasons"] = reasons
        return books

    def check(self, books: dict) -> bool:
        """Every announcement refused or rejected as expected, every group with its reason."""
        kinds = self.detail.get("expected_kinds") or {}
        rejected = self.detail.get("rejected") or {}
        expected = self.detail.get("expected_reasons") or {}
        reasons = self.detail.get("dead_letter_reasons") or {}
        return (
            bool(kinds)
            and all(rejected.get(v) and rejected[v][0] == kind for v, kind in kinds.items())
            and bool(expected)
            and all(why in reasons.get(where, "") for where, why in expected.items())
        )


DRILLS: dict[str, type[Drill]] = {
    "explorer_kill": ExplorerKill,
    "trainer_kill": TrainerKill,
    "store_outage": StoreOutage,
    "broker_restart": BrokerRestart,
    "corrupt_shard": CorruptShard,
    "fuzz": Fuzz,
    "poison_batch": PoisonBatch,
    "hostile": Hostile,
}


def run_drill(name: str, workdir: Path) -> DrillResult:
    """Run one drill in ``workdir`` (services, run folder and logs go there)."""
    if name not in DRILLS:
        raise ValueError(f"unknown drill {name!r}; one of {sorted(DRILLS)}")
    return DRILLS[name](name, Path(workdir) / name).run()
