"""Running one arm of ``bench/vs_trl.py`` as its user would, and what it left behind.

- streamrft: ``streamrft run CONFIG --explorers N -o synchronizer.style=...`` (it starts its
  own broker and object store, feeder, explorers and trainer); its figures come from the
  run folder's ``metrics.jsonl`` (every metrics event, written by the run itself) and the
  ``--summary`` file. A crash: SIGKILL to the trainer process once the run reports the
  step; the run restarts it by itself.
- TRL: ``python bench/vs_trl_arm.py CONFIG`` (``GRPOTrainer.train()``); its figures come
  from the events file the arm writes. A crash: SIGKILL to the process once it reports the
  step, then the same command with ``--resume`` (``resume_from_checkpoint``).

Each arm's processes are measured while it runs (:class:`TreeMeter`): the peak of the sum
of their resident memory (RSS, and PSS: shared pages counted once), their CPU time
(user + system, the larger of what the samples saw and what ``getrusage`` reports for the
reaped children) and how many there were. Each arm's environment is the bench's own
without ``OMP_NUM_THREADS`` (each tool's own default thread counts).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_explorers import run_to_end  # bench/, beside us

from streamrft.app.watch.metrics_log import read_metrics
from tests.helpers.cli import streamrft_cmd

ARM = Path(__file__).resolve().parent / "vs_trl_arm.py"
RUN_TIMEOUT_S = 1800.0
SAMPLE_S = 0.25
POLL_S = 0.05


def arm_env(threads: int = 0) -> dict[str, str]:
    """The bench's environment without its thread limits: each tool as a user starts it;
    ``threads`` > 0: that many (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


class TreeMeter:
    """Samples the processes under the roots it watches every ``SAMPLE_S`` on a thread."""

    def __init__(self) -> None:
        self.roots: list[int] = []
        self.cpu: dict[int, float] = {}
        self.role: dict[int, str] = {}
        self.peak_rss = self.peak_pss = 0
        self.processes = 0
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.rusage_before = _children_cpu()

    def watch(self, pid: int) -> None:
        self.roots.append(pid)
        if not self.thread.is_alive():
            self.thread.start()

    def _loop(self) -> None:
        while not self.stop_flag.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        procs: list[psutil.Process] = []
        for pid in self.roots:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                procs += [root, *root.children(recursive=True)]
        rss = pss = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                mem = p.memory_full_info()
                rss += mem.rss
                pss += getattr(mem, "pss", mem.rss)
                if p.pid not in self.role:  # first: a process may end between the calls
                    self.role[p.pid] = role_of(p.cmdline())
                times = p.cpu_times()
                self.cpu[p.pid] = times.user + times.system
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.processes = max(self.processes, len(procs))

    def stop(self) -> dict:
        self.stop_flag.set()
        if self.thread.is_alive():
            self.thread.join()
        reaped = _children_cpu() - self.rusage_before
        by_role: dict[str, float] = {}
        for pid, cpu in self.cpu.items():
            by_role[self.role[pid]] = by_role.get(self.role[pid], 0.0) + cpu
        return {
            "peak_rss_mb": round(self.peak_rss / 2**20, 1),
            "peak_pss_mb": round(self.peak_pss / 2**20, 1),
            "cpu_s": round(max(reaped, sum(self.cpu.values())), 1),
            "processes": self.processes,
            "cpu_s_by_process": {k: round(v, 1) for k, v in sorted(by_role.items())},
        }


def role_of(argv: list[str]) -> str:
    """A process's name in the figures: the ``streamrft`` command it runs (``run`` is the
    supervisor; ``explore`` the explorers, together), ``trl`` for the TRL arm, the local
    services' ``tansu`` (the broker) and ``juicefs`` (the object store), else its
    program's name."""
    if "streamrft.app.cli" in argv:
        i = argv.index("streamrft.app.cli")
        return argv[i + 1] if i + 1 < len(argv) else "streamrft"
    line = " ".join(argv)
    if "vs_trl_arm.py" in line:
        return "trl"
    for service in ("tansu", "juicefs"):
        if service in line:
            return service
    return Path(argv[0]).name if argv else "?"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Timeline:
    """What one arm did, in Unix times: when it was launched and ended, every trainer step
    completed (repeats after a crash included), every evaluation, every batch generated."""

    t0: float
    end: float = 0.0
    exit_code: int | None = None
    timed_out: bool = False
    steps: list[tuple[float, int]] = field(default_factory=list)
    step_tokens: dict[int, int] = field(default_factory=dict)
    """Completion tokens trained per step (its last attempt)."""
    evals: list[tuple[float, int, float]] = field(default_factory=list)
    gens: list[tuple[float, str, int, int]] = field(default_factory=list)
    """(time, who, batch, rollouts): each generation of (a share of) a batch."""
    kills: list[tuple[float, int]] = field(default_factory=list)
    """(time, last step reported before it) of each SIGKILL."""
    meter: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def _wait(proc: subprocess.Popen, deadline: float, until=None) -> bool:
    """Until ``until()`` is true (True), or ``proc`` ends or the deadline passes (False)."""
    while proc.poll() is None and time.time() < deadline:
        if until is not None and until():
            return True
        time.sleep(POLL_S)
    return False


# -- streamrft --------------------------------------------------------------------------------
def streamrft_argv(
    config: Path,
    run_id: str,
    runs: Path,
    explorers: int,
    style: str,
    summary: Path,
    save_every: int,
) -> list[str]:
    """``streamrft run`` of ``config`` as a user types it, with the arm's settings (its run
    folder under ``runs``)."""
    staleness = 1 if style == "fixed" else 2
    settings = [
        f"run.dir={runs}",
        f"synchronizer.style={style}",
        f"trainer.max_staleness={staleness}",
    ]
    if save_every:
        settings.append(f"trainer.save_interval={save_every}")
    args = ["run", str(config), "--run-id", run_id, "--explorers", str(explorers)]
    args += ["--no-progress", "--summary", str(summary)]
    return streamrft_cmd(*args, *(a for s in settings for a in ("-o", s)))


class StepWatch:
    """The newest step a growing JSON-lines file reports, read a new line at a time;
    ``is_step(obj)`` says which lines report a step."""

    def __init__(self, path: Path, is_step) -> None:
        self.path, self.is_step = path, is_step
        self.offset, self.rest, self.step = 0, b"", 0

    def __call__(self) -> int:
        if self.path.is_file():
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
            self.offset += len(chunk)
            *lines, self.rest = (self.rest + chunk).split(b"\n")
            for raw in lines:
                obj = json.loads(raw) if raw.strip() else None
                if obj is not None and self.is_step(obj):
                    self.step = max(self.step, obj["step"])
        return self.step


def _is_trainer_step(ev: dict) -> bool:
    return ev.get("component") == "trainer" and "train/step_seconds" in ev.get("values", {})


def _trainer_pid(root: int) -> int | None:
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(root).children(recursive=True):
            args = p.cmdline()
            if "streamrft.app.cli" in args and "train" in args:
                return p.pid
    return None


def run_streamrft(
    config: Path,
    folder: Path,
    run_id: str,
    explorers: int,
    style: str,
    repeat: int,
    kill_at: int = 0,
    save_every: int = 0,
) -> Timeline:
    """One ``streamrft run`` to its end (SIGKILL to its trainer after step ``kill_at``)."""
    folder.mkdir(parents=True, exist_ok=True)
    runs = folder / "runs"
    summary = folder / "summary.json"
    metrics = runs / run_id / "metrics.jsonl"
    argv = streamrft_argv(config, run_id, runs, explorers, style, summary, save_every)
    meter = TreeMeter()
    watch = StepWatch(metrics, _is_trainer_step)
    line = Timeline(t0=time.time())

    def started(proc: subprocess.Popen) -> None:
        meter.watch(proc.pid)
        if kill_at and _wait(proc, line.t0 + RUN_TIMEOUT_S, lambda: watch() >= kill_at):
            pid = _trainer_pid(proc.pid)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                line.kills.append((time.time(), watch()))

    proc, finished = run_to_end(
        argv,
        folder,
        runs,
        RUN_TIMEOUT_S,
        lambda s: f"{run_id}: {s:.0f} s, trainer step {watch()}",
        arm_env(),
        started,
    )
    line.timed_out = not finished
    line.end, line.exit_code, line.meter = time.time(), proc.returncode, meter.stop()
    line.summary = json.loads(summary.read_text()) if summary.is_file() else {}
    if metrics.is_file():
        _read_streamrft(line, metrics, repeat)
    return line


def _read_streamrft(line: Timeline, path: Path, repeat: int) -> None:
    for ev in read_metrics(path, ledgers=False):
        v = ev.values
        if ev.component == "trainer" and "train/step_seconds" in v:
            line.steps.append((ev.created_at, ev.step))
            rows = v.get("train/groups", 0.0) * repeat
            line.step_tokens[ev.step] = round(v.get("train/response_length", 0.0) * rows)
        if ev.component == "trainer" and "eval/accuracy" in v:
            line.evals.append((ev.created_at, ev.step, v["eval/accuracy"]))
        if "explorer/groups" in v and v["explorer/groups"] > 0:
            line.gens.append(
                (ev.created_at, ev.component, ev.step, round(v["explorer/groups"] * repeat))
            )
    for items in (line.steps, line.evals, line.gens):
        items.sort(key=lambda x: x[0])


# -- TRL ------------------------------------------------------------------------------------
def run_trl(
    config: Path, folder: Path, kill_at: int = 0, save_every: int = 0, threads: int = 0
) -> Timeline:
    """``bench/vs_trl_arm.py CONFIG`` to its end (SIGKILL after step ``kill_at``, then the
    same with ``--resume``); ``threads``: its torch threads (0: torch's default)."""
    folder.mkdir(parents=True, exist_ok=True)
    events = folder / "events.jsonl"
    argv = [
        sys.executable,
        str(ARM),
        str(config),
        "--out",
        str(folder / "trl"),
        "--events",
        str(events),
    ]
    if save_every:
        argv += ["--save-every", str(save_every)]
    meter = TreeMeter()
    watch = StepWatch(events, lambda ev: ev["kind"] == "step")
    line = Timeline(t0=time.time())
    deadline = line.t0 + RUN_TIMEOUT_S
    with (folder / "run.log").open("ab") as out:
        for attempt in ("first", "resumed"):
            extra = ["--resume"] if attempt == "resumed" else []
            proc = subprocess.Popen(
                argv + extra,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=arm_env(threads),
                cwd=folder,
            )
            try:
                meter.watch(proc.pid)
                if (
                    kill_at
                    and attempt == "first"
                    and _wait(proc, deadline, lambda: watch() >= kill_at)
                ):
                    proc.kill()
                    line.kills.append((time.time(), watch()))
                    continue  # started again at once, as its user would
                _wait(proc, deadline)
                line.timed_out = proc.poll() is None
                break
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    line.end, line.exit_code, line.meter = time.time(), proc.returncode, meter.stop()
    if events.is_file():
        _read_trl(line, events)
    return line


def _read_trl(line: Timeline, path: Path) -> None:
    for raw in path.read_text().splitlines():
        ev = json.loads(raw)
        if ev["kind"] == "step":
            line.steps.append((ev["t"], ev["step"]))
        elif ev["kind"] == "eval":
            line.evals.append((ev["t"], ev["step"], ev["accuracy"]))
        elif ev["kind"] == "gen":
            line.gens.append((ev["t"], "trl", ev["batch"], ev["rollouts"]))
            line.step_tokens[ev["batch"]] = ev["tokens"]
        elif ev["kind"] == "ready":
            line.summary["threads"] = ev["threads"]
