"""The multi-host drill: one run over four simulated hosts (``tests/harness/hosts.py``), with
nothing shared but the broker and the object store, losing two hosts on the way.

    python -m tests.harness.multihost [--keep DIR]    (root; prints the timeline and figures)

- the broker and the object store listen on the bridge (the machine's own namespace);
- host A: ``streamrft run --explorers 0`` (supervisor, trainer, feeder), weights by the
  ``nccl`` method (gloo on the CPU) from ``synchronizer.nccl_host`` = A's address;
- hosts B and C: an explorer each, started with ``--run-id`` and ``--bootstrap`` only;
- host C is lost (every process SIGKILLed) after step ``KILL_C_AT``; host D joins late with a
  third explorer;
- host A is lost after step ``KILL_A_AT`` (its trainer mid-run, its run folder gone with it
  as far as the others know); a trainer started on host B from the run's record resumes
  from the newest checkpoint in the object store, broadcasting from B's address, and
  finishes the run.

Every wait is for a state of the run, never for a time: the steps are read from the run's
metrics topic, and the store behind host A refuses its checkpoints from step ``KILL_A_AT``
on (``tests/harness/store_relay.py`` :class:`CheckpointGate`, lifted once A is lost), so the
newest checkpoint in the store is one from before the step A is lost at, however fast A's
trainer goes while the drill looks. The first checkpoint it refuses freezes host A (every
process SIGSTOPped) before it is answered: the tiny model trains ten steps a second once
the explorers are ahead, faster than the drill reads the metrics topic, so A is lost
mid-run, a step or two past ``KILL_A_AT``, on a fast machine as on a busy one. The
explorers, started by hand, wait for versions as long as a trainer takes to start again
on a busy machine (``EXPLORER_SYNC_TIMEOUT_S``).

The books are then read back from the run's topics (``tests/harness/drills.py``
:func:`audit_run`): every fed task trained once, none lost; the greedy accuracy of the
first and the last evaluation. :func:`run_drill` returns the timeline and the figures;
``tests/e2e/test_multihost_drill.py`` asserts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamrft.infra.config import Config, load_config, with_run_id
from streamrft.infra.consume import read_topic
from streamrft.infra.local.services import LocalServices
from streamrft.schemas.codec import CONTROL, METRICS, STATUS
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.collective import parse_rendezvous
from tests.harness.drills import audit_run
from tests.harness.hosts import Host, SimulatedHosts
from tests.harness.store_relay import CheckpointGate
from tests.helpers.cli import env, overrides, service_overrides, streamrft_cmd
from tests.helpers.paths import EXAMPLE

EPOCHS = 4
GROUPS_PER_STEP = 20
STEPS = 100 * EPOCHS // GROUPS_PER_STEP  # examples/data/addition.jsonl: 100 tasks
KILL_C_AT = 3
JOIN_D_AT = 5
KILL_A_AT = 9
"""Host A is lost after this step, between two checkpoints (the newest one in the store
is from before it: the steps after it are trained again on host B)."""
TIMEOUT_S = 600.0
EXPLORER_SYNC_TIMEOUT_S = 300
"""``synchronizer.sync_timeout`` of the explorers started by hand: a broadcast cut by host
A's loss is sent again by the store only once the trainer has started on host B (a new
process: its imports, the run's record, the checkpoint; well past the run's 20 s on a busy
2-core machine). The trainer keeps the run's 20 s for a member that never joins."""

RUN_OVERRIDES = [
    f"taskset.total_epochs={EPOCHS}",
    "explorer.batch_size=10",
    "explorer.repeat_times=4",
    f"trainer.batch_size={GROUPS_PER_STEP}",
    "trainer.ppo_epochs=1",
    "trainer.save_interval=2",
    "trainer.idle_timeout_s=120",
    "eval.interval=0",  # the first and the last step
    # every fed task must train: nothing dropped as stale
    "trainer.max_staleness=1000",
    "synchronizer.method=nccl",
    "synchronizer.sync_timeout=20",
    "monitor.progress=false",
]

STORED = re.compile(r"checkpoint step_(\d+) in the store")
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")
NCCL_APPLIED = re.compile(r"applied version (\d+) \(nccl\)")


@dataclass
class Timeline:
    started: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str]] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.events.append((round(time.monotonic() - self.started, 1), what))


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _newest(pattern: re.Pattern, path: Path) -> int:
    """The largest number ``pattern`` finds in the file (-1 when none, or no file)."""
    return max((int(n) for n in pattern.findall(_text(path))), default=-1)


def _trained(cfg: Config, until_quiet: int = 1) -> int:
    """The newest step a trainer reported on the run's metrics topic (-1: none): read from
    the broker, not from a supervisor's ``metrics.jsonl`` (which lags it on a busy machine),
    until ``until_quiet`` polls of 200 ms come back empty (more: all there is, once nothing
    writes any more)."""
    topic = cfg.topics().metrics
    records = asyncio.run(read_topic(cfg.kafka, topic, METRICS, "drill-watch", until_quiet, 200))
    steps = [
        r.obj.step
        for r in records
        if r.obj is not None and r.obj.component == "trainer" and r.obj.trained
    ]
    return max(steps, default=-1)


def _wait(ready, procs: list[subprocess.Popen], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process ended first ({p.args[-12:]})")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Drill:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.timeline = Timeline()
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, host: Host, name: str, args: list[str], secrets: bool = True) -> None:
        environ = {**env(), **host.env}
        if secrets:
            environ["STREAMRFT_S3_ACCESS_KEY"] = self.services.access_key
            environ["STREAMRFT_S3_SECRET_KEY"] = self.services.secret_key
        with (host.folder / f"{name}.log").open("w") as out:
            self.procs[name] = subprocess.Popen(
                host.argv(streamrft_cmd(*args)),
                env=environ,
                cwd=host.folder,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def run(self) -> dict:
        with SimulatedHosts(self.root / "hosts") as hosts:
            services = LocalServices(self.root / "services", host=hosts.address)
            self.gate: CheckpointGate | None = None
            try:
                self.services = services.start()
                return self._run(hosts)
            finally:
                for p in self.procs.values():
                    if p.poll() is None:
                        p.kill()
                if self.gate is not None:
                    self.gate.close()
                services.stop()

    def _config(self, run_id: str) -> Config:
        """The drill's own view of the run (the broker and the store themselves)."""
        return with_run_id(
            load_config(EXAMPLE, [*RUN_OVERRIDES, *service_overrides(self.services)[1::2]]),
            run_id,
        )

    def _run(self, hosts: SimulatedHosts) -> dict:
        tl = self.timeline
        a, b, c, d = (hosts.add(f"host-{x}") for x in "abcd")
        tl.add(f"broker and object store on the bridge, {hosts.address}")
        self.addresses = {h.name.removeprefix("host-"): h.address for h in (a, b, c, d)}
        run_id = f"multihost-{hosts.tag}"
        cfg = self._config(run_id)
        store_host, store_port = (self.services.s3_endpoint or "").rsplit(":", 1)
        self.gate = CheckpointGate(
            (store_host, int(store_port)),
            run_id,
            first=KILL_A_AT,
            host=hosts.address,
            on_first=lambda: tl.add(
                f"host A frozen at its first checkpoint refused ({a.freeze()} processes)"
            ),
        ).start()
        join = ["--run-id", run_id, "--bootstrap", self.services.bootstrap_servers]
        explore = ["explore", *join, "-o", f"synchronizer.sync_timeout={EXPLORER_SYNC_TIMEOUT_S}"]
        run_args = ["run", str(EXAMPLE), "--run-id", run_id, "--explorers", "0"]
        run_args += ["--max-steps", str(STEPS), "--no-progress"]
        run_args += overrides(
            *RUN_OVERRIDES,
            "run.dir=runs",
            "run.host_id=host-a",
            f"synchronizer.nccl_host={a.address}",
            f"synchronizer.nccl_hosts=[{b.address}]",  # where the trainer may move
        )
        through_gate = ["-o", f"object_store.endpoint={self.gate.endpoint}"]
        a_args = [*run_args, *service_overrides(self.services), *through_gate]
        self.start(a, "run", a_args, secrets=False)
        trainer_a = a.folder / "runs" / run_id / "logs" / "trainer.log"
        _wait(
            lambda: "defined on its control topic" in _text(trainer_a),
            [self.procs["run"]],
            "the run's record",
        )
        tl.add(f"host A ({a.address}): run {run_id} defined; trainer and feeder up")
        for host, index in ((b, 0), (c, 1)):
            self.start(
                host,
                f"explorer-{index}",
                [*explore, "--index", str(index), "-o", f"run.host_id={host.name}"],
            )
        tl.add(f"hosts B ({b.address}), C ({c.address}): explorer-0, explorer-1 started")
        self.explorer0_log = b.folder / "explorer-0.log"
        live = [self.procs["run"]]
        _wait(lambda: _trained(cfg) >= KILL_C_AT, live, f"step {KILL_C_AT}")
        killed = c.kill()
        tl.add(f"host C lost at step {_trained(cfg)} ({killed} processes killed)")
        _wait(lambda: _trained(cfg) >= JOIN_D_AT, live, f"step {JOIN_D_AT}")
        self.start(d, "explorer-2", [*explore, "--index", "2", "-o", "run.host_id=host-d"])
        tl.add(f"host D ({d.address}) joins late: explorer-2 at step {_trained(cfg)}")
        # the store holds none of A's checkpoints from KILL_A_AT on: any step past it will do
        _wait(
            lambda: _newest(STORED, trainer_a) > 0 and _trained(cfg) >= KILL_A_AT,
            live,
            f"step {KILL_A_AT} with a checkpoint in the store",
        )
        killed = a.kill()
        # what A had done when it was lost, read once nothing of it runs
        at, stored = _trained(cfg, until_quiet=5), _newest(STORED, trainer_a)
        self.gate.release()
        tl.add(
            f"host A lost at step {at} ({killed} processes killed); newest checkpoint in the "
            f"store: step {stored} (its checkpoints of steps {sorted(self.gate.refused)} refused)"
        )
        self.start(
            b,
            "trainer",
            [
                "train",
                *join,
                "-o",
                "run.host_id=host-b",
                "-o",
                f"synchronizer.nccl_host={b.address}",
            ],
        )
        trainer_b = b.folder / "trainer.log"
        tl.add("host B: `streamrft train --run-id --bootstrap` started (no config file)")
        _wait(lambda: _newest(RESUMED, trainer_b) >= 0, [self.procs["trainer"]], "the resume")
        resumed = _newest(RESUMED, trainer_b)
        tl.add(f"host B: trainer resumed from the store's checkpoint at step {resumed}")
        codes = {
            name: self.procs[name].wait(timeout=TIMEOUT_S)
            for name in ("trainer", "explorer-0", "explorer-2")
        }
        tl.add(f"run finished on host B; exit codes {codes}")
        return self._figures(cfg, run_id, at, stored, resumed, codes)

    def _figures(
        self, cfg: Config, run_id: str, lost_at: int, stored: int, resumed: int, codes: dict
    ) -> dict:
        books, retries = asyncio.run(audit_run(cfg, run_id))
        topics = cfg.topics()
        metrics = asyncio.run(read_topic(cfg.kafka, topics.metrics, METRICS, "drill"))
        evals = [
            r.obj.values["eval/accuracy"]
            for r in metrics
            if r.obj is not None and "eval/accuracy" in r.obj.values
        ]
        control = asyncio.run(read_topic(cfg.kafka, topics.control, CONTROL, "drill"))
        methods: dict[str, int] = {}
        broadcast_from: dict[int, str] = {}  # version -> its broadcast's rendezvous host
        for r in control:
            if isinstance(r.obj, ModelVersionReady):
                methods[r.obj.method] = methods.get(r.obj.method, 0) + 1
                if r.obj.method == "nccl":
                    broadcast_from[r.obj.version] = parse_rendezvous(r.obj.uri).host
        status = asyncio.run(read_topic(cfg.kafka, topics.status, STATUS, "drill"))
        applied: dict[str, dict[str, float]] = {}
        for r in status:
            if r.obj is not None and r.obj.component.startswith("explorer"):
                applied[r.obj.component] = {
                    k: v
                    for k, v in r.obj.counters.items()
                    if k.startswith(("versions_applied", "versions_refused"))
                }
        # what explorer-0 (host B) received by broadcast, by the host it came from
        by_broadcast = [int(v) for v in NCCL_APPLIED.findall(_text(self.explorer0_log))]
        received_from: dict[str, int] = {}
        for v in by_broadcast:
            host = broadcast_from.get(v, "?")
            received_from[host] = received_from.get(host, 0) + 1
        return {
            "timeline": self.timeline.events,
            "books": books,
            "retries": retries,
            "lost_at_step": lost_at,
            "stored_checkpoint": stored,
            "resumed_at_step": resumed,
            "exit_codes": codes,
            "eval_first": evals[0] if evals else None,
            "eval_last": evals[-1] if evals else None,
            "announcements": methods,
            "explorer_versions": applied,
            "explorer0_broadcasts_from": received_from,
            "hosts": self.addresses,
            "wall_s": round(time.monotonic() - self.timeline.started, 1),
        }


def run_drill(root: Path) -> dict:
    return Drill(root).run()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", help="work in this folder and keep it (logs of every host)")
    args = p.parse_args()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        result = run_drill(Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="multihost-") as tmp:
            result = run_drill(Path(tmp))
    for t, what in result["timeline"]:
        print(f"{t:7.1f} s  {what}")
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}))


if __name__ == "__main__":
    main()
