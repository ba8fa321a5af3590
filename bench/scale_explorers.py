"""Scaling bench: does adding explorers shorten the trainer's step?

    python bench/scale_explorers.py [--quick] [--explorers 1,2,4,8] [--steps 50]
                                    [--seconds-per-token 0.002] [--keep] [--note TEXT]

For each explorer count N the bench starts its own local services (a Tansu broker in
memory and a JuiceFS S3 gateway, ``LocalServices``) and runs the real ``streamrft run``
(supervisor, feeder, N explorers and the trainer as OS processes) on
``examples/arithmetic.yaml`` pointed at them, with ``explorer.engine=simulated`` (no model
forward: random tokens and a sleep of ``--seconds-per-token`` per generated token, so
rollouts cost the same whatever the CPU count; 32 tasks x 8 rollouts x 4 tokens = 1,024
tokens per batch, 2.05 s at 2 ms), ``trainer.warmup_sft_steps=0``,
``eval.interval=0``, ``kafka.partitions=max(4, N)`` and ``--explorers N``. After
the run it reads the run's ``metrics`` and ``status`` topics back (the services are still
up) and its ``--summary`` JSON. Everything goes under a temporary folder that is removed
at the end; every process started is gone when the bench ends, on Ctrl-C too.

Figures per N (steady part: the trainer steps after the first ``WARMUP_STEPS``):

- ``step_s``: median interval between successive trainer steps (``created_at`` of the
  trainer's metrics events), over the steady steps;
- ``train_s``: median ``train/step_seconds`` (the trainer's own compute for a step) and
  ``wait_s`` median ``train/wait_seconds`` (waiting for a batch), same steps;
- ``rollout_s``: one explorer's rollout of a full batch: the median over all explorer
  steps of ``explorer/rollout_seconds`` x ``explorer.batch_size`` / ``explorer/groups``
  (a step that rolled out part of a batch is scaled up; the engine's cost is per token);
  ``step_rollout_s``: the median ``explorer/rollout_seconds`` as it is, per explorer step;
- ``rollout_share``: ``rollout_s / N / step_s``, the part of a trainer step the rollout
  of its batch fills if the N explorers split the work evenly; ``explorer_busy``: the
  explorers' rollout seconds (steps that ended between the first and last steady trainer
  step) / (N x that time): 1.0 when they never stop rolling out, whether the trainer
  uses their groups or not;
- ``trained_fraction``: experiences trained / experiences published (the summary);
  ``stale_dropped`` and ``duplicates_dropped``: groups the trainer dropped (the summary);
  ``unconsumed_groups``: groups published but neither trained nor dropped (left on the
  topic when the trainer stopped: each explorer may have a batch in flight then, so even
  with nothing dropped ``trained_fraction`` is at most about steps / (steps + N) in a run
  this short); ``trained_of_consumed``: experiences trained / experiences the trainer
  consumed, the same without that tail;
- ``rebalances``: the explorers' ``rebalances`` counters summed (their newest status): how
  many partition assignments of the tasks group they went through; ``settle_s``: seconds
  from the first explorer's "started" status to the last explorer's partition report
  (how long the tasks group took to settle); ``first_step_s``: seconds from the start of
  ``streamrft run`` to the trainer's first step;
- ``speedup``: ``step_s`` of the N=1 point (the baseline, measured in the same run) /
  ``step_s``;
- issue 9's goal: ``bound_s = 1.25 * (rollout_s(N=1) / N + train_s)``, ``meets_bound`` =
  ``step_s <= bound_s``; ``meets_trained`` = ``trained_fraction >= 0.95``.

A figure, not a test: nothing is asserted. Human-readable lines first, then one JSON line
on stdout; progress on stderr.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import asyncio
import contextlib
import itertools
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# the run's command line comes from the test helpers (tests/), not part of the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrft.infra.config import Config, load_config, with_run_id
from streamrft.infra.consume import read_history
from streamrft.infra.local.services import Endpoints, LocalServices
from streamrft.schemas.codec import METRICS, STATUS
from streamrft.schemas.events import MetricsEvent, StatusEvent
from tests.helpers.cli import env, run_argv, service_overrides
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import processes_mentioning

FULL = (1, 2, 4, 8)
QUICK = (1, 2)
STEPS, QUICK_STEPS = 50, 10
WARMUP_STEPS = 3
"""Trainer steps left out of the steady figures (start-up, first versions, rebalances)."""
SECONDS_PER_TOKEN = 0.002
RUN_TIMEOUT_S = 900.0
STOP_GRACE_S = 40.0
BOUND_FACTOR = 1.25
TRAINED_GOAL = 0.95
PROGRESS_EVERY_S = 15.0
FIRST_KEYS = (
    "explorers",
    "step_s",
    "speedup",
    "rollout_s",
    "train_s",
    "bound_s",
    "trained_fraction",
    "stale_dropped",
    "rebalances",
)
"""The keys every point of the JSON line starts with, in this order; more follow."""

COLUMNS = (
    ("explorers", 9),
    ("step_s", 7),
    ("speedup", 7),
    ("rollout_s", 9),
    ("train_s", 7),
    ("wait_s", 7),
    ("rollout_share", 13),
    ("explorer_busy", 13),
    ("bound_s", 7),
    ("meets_bound", 11),
    ("trained_fraction", 16),
    ("stale_dropped", 13),
    ("unconsumed_groups", 17),
    ("rebalances", 10),
    ("settle_s", 8),
    ("wall_s", 7),
)


def settings(n: int, cost: float) -> list[str]:
    """The ``-o`` settings of the run with ``n`` explorers."""
    return [
        "explorer.engine=simulated",
        f"explorer.simulated_seconds_per_token={cost}",
        "trainer.warmup_sft_steps=0",
        "eval.interval=0",
        f"kafka.partitions={max(4, n)}",
    ]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


# -- the figures, from what the run left on its topics -----------------------------------------


def trainer_figures(metrics: list[MetricsEvent]) -> dict:
    """step_s, train_s, wait_s over the steady steps, and when the first step came."""
    steps: dict[int, MetricsEvent] = {}
    for ev in metrics:
        if ev.component == "trainer" and "train/step_seconds" in ev.values:
            steps[ev.step] = ev  # the last attempt of each step
    ordered = [steps[s] for s in sorted(steps)]
    steady = ordered[WARMUP_STEPS:]
    gaps = [b.created_at - a.created_at for a, b in itertools.pairwise(steady)]
    return {
        "trainer_steps": len(ordered),
        "step_s": _median(gaps),
        "train_s": _median([e.values["train/step_seconds"] for e in steady]),
        "wait_s": _median([e.values["train/wait_seconds"] for e in steady]),
        "first_step_at": ordered[0].created_at if ordered else None,
        "steady": (steady[0].created_at, steady[-1].created_at) if len(steady) > 1 else None,
    }


def rollout_figures(
    metrics: list[MetricsEvent], batch_size: int, n: int, steady: tuple[float, float] | None
) -> dict:
    """One explorer's rollout of a full batch, of one of its steps, and how busy rolling out
    the N explorers were over the trainer's steady steps."""
    steps = [
        (ev.created_at, ev.values["explorer/rollout_seconds"], ev.values["explorer/groups"])
        for ev in metrics
        if "explorer/rollout_seconds" in ev.values and ev.values.get("explorer/groups", 0) > 0
    ]
    busy = None
    if steady is not None:
        start, end = steady
        spent = sum(s for at, s, _ in steps if start < at <= end)
        busy = round(spent / (n * (end - start)), 3)
    return {
        "rollout_s": _median([s * batch_size / groups for _, s, groups in steps]),
        "step_rollout_s": _median([s for _, s, _ in steps]),
        "explorer_busy": busy,
    }


def explorer_figures(statuses: list[StatusEvent]) -> dict:
    """Rebalances (newest counters of each explorer) and how long the tasks group took to
    settle (first "started" to the last partition report)."""
    newest: dict[str, StatusEvent] = {}
    started, assigned = [], []
    for ev in statuses:
        if ev.role != "explorer":
            continue
        newest[ev.component] = ev
        if ev.detail == "started":
            started.append(ev.created_at)
        elif "partition" in ev.detail:
            assigned.append(ev.created_at)
    rebalances = sum(int(ev.counters.get("rebalances", 0)) for ev in newest.values())
    settle = round(max(assigned) - min(started), 2) if started and assigned else None
    return {"rebalances": rebalances, "settle_s": settle}


def summary_figures(summary: dict) -> dict:
    """trained_fraction, drops and the groups left over, from the run's summary."""
    published = summary.get("experiences_published", 0)
    consumed = summary.get("experiences_consumed", 0)
    trained = summary.get("experiences_trained", 0)
    stale = summary.get("stale_dropped", 0)
    dups = summary.get("duplicates_dropped", 0)
    groups_left = summary.get("groups_published", 0) - summary.get("groups_trained", 0)
    return {
        "trained_fraction": round(trained / published, 3) if published else None,
        "trained_of_consumed": round(trained / consumed, 3) if consumed else None,
        "experiences_published": published,
        "experiences_trained": trained,
        "stale_dropped": stale,
        "duplicates_dropped": dups,
        "unconsumed_groups": groups_left - stale - dups,
        "restarts": sum((summary.get("restarts") or {}).values()),
    }


def add_bounds(points: list[dict]) -> None:
    """Issue 9's goal and the rollout share for each point; the bound needs the N=1
    point's rollout (None without one)."""
    one = next((p for p in points if p["explorers"] == 1), None)
    base = one["rollout_s"] if one else None
    for p in points:
        bound = None
        if base is not None and p["train_s"] is not None:
            bound = round(BOUND_FACTOR * (base / p["explorers"] + p["train_s"]), 3)
        p["bound_s"] = bound
        p["speedup"] = (
            round(one["step_s"] / p["step_s"], 2) if one and one["step_s"] and p["step_s"] else None
        )
        p["meets_bound"] = None if bound is None or p["step_s"] is None else p["step_s"] <= bound
        tf = p["trained_fraction"]
        p["meets_trained"] = None if tf is None else tf >= TRAINED_GOAL
        p["rollout_share"] = (
            round(p["rollout_s"] / p["explorers"] / p["step_s"], 3)
            if p["rollout_s"] and p["step_s"]
            else None
        )


# -- one point: services, the run, the figures -------------------------------------------------


def stop_run(proc: subprocess.Popen, runs: Path) -> None:
    """The run stopped: SIGINT to the supervisor (it shuts its children down), then
    SIGKILL to whatever of the run is still there (the processes whose command line names
    its ``runs`` folder: the supervisor and its children, not the services)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_GRACE_S)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for _ in range(50):
        pids = processes_mentioning(str(runs))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def run_to_end(
    argv: list[str],
    folder: Path,
    runs: Path,
    timeout: float,
    progress: Callable[[float], str],
    environ: dict[str, str] | None = None,
    started: Callable[[subprocess.Popen], None] | None = None,
) -> tuple[subprocess.Popen, bool]:
    """``streamrft run`` (``argv``) in ``folder``, its output in ``folder/run.log``, in a
    process group of its own (Ctrl-C reaches the bench, which stops the run itself), until
    it ends or ``timeout`` passes (:func:`wait_for_run`); then stopped (:func:`stop_run`)
    and whatever is left of its process group killed. ``environ``: its environment
    (default :func:`env`); ``started(proc)``: called once it runs, before the wait (to
    watch or signal it; its time counts in ``timeout``). The process, and whether it ended
    by itself; also the other benches' that run ``streamrft run``."""
    with (folder / "run.log").open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ or env(),
            cwd=folder,
            start_new_session=True,
        )
        try:
            began = time.monotonic()
            if started is not None:
                started(proc)
            finished = wait_for_run(proc, timeout - (time.monotonic() - began), progress)
        finally:
            with _no_interrupts():
                try:
                    stop_run(proc, runs)
                finally:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
    return proc, finished


@contextlib.contextmanager
def _no_interrupts():
    """Ctrl-C ignored while a run is being stopped (the stop has its own time limits)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _trainer_version(log: Path) -> int:
    """The newest version the trainer's log says it published (one per step here)."""
    try:
        found = re.findall(r"version (\d+) published", log.read_text(errors="replace"))
    except OSError:
        return -1
    return int(found[-1]) if found else -1


def wait_for_run(proc: subprocess.Popen, timeout: float, progress: Callable[[float], str]) -> bool:
    """Until the run ends (True) or ``timeout`` passes (False), with ``progress(seconds)``
    on stderr every ``PROGRESS_EVERY_S``; also bench/sync_in_loop.py's."""
    started = time.monotonic()
    next_report = started + PROGRESS_EVERY_S
    while proc.poll() is None:
        now = time.monotonic()
        if now - started > timeout:
            return False
        if now >= next_report:
            print(f"#   {progress(now - started)}", file=sys.stderr, flush=True)
            next_report = now + PROGRESS_EVERY_S
        time.sleep(0.5)
    return True


async def read_back(cfg: Config) -> tuple[list[MetricsEvent], list[StatusEvent]]:
    topics = cfg.topics()
    metrics = await read_history(cfg.kafka, topics.metrics, METRICS, "scale-bench")
    status = await read_history(cfg.kafka, topics.status, STATUS, "scale-bench")
    return metrics, status


def run_point(n: int, steps: int, cost: float, workdir: Path) -> dict:
    """One ``streamrft run`` with ``n`` explorers on its own services; its figures."""
    folder = workdir / f"explorers-{n}"
    runs, summary_path = folder / "runs", folder / "summary.json"
    run_id = f"scale-{n}-{os.getpid()}"
    wall = time.monotonic()
    with LocalServices(folder / "services") as services:
        eps: Endpoints = services.endpoints
        argv = run_argv(
            EXAMPLE, run_id, steps, runs, eps, *settings(n, cost), explorers=n, summary=summary_path
        )
        started = time.time()
        log = runs / run_id / "logs" / "trainer.log"
        proc, finished = run_to_end(
            argv,
            folder,
            runs,
            RUN_TIMEOUT_S,
            lambda s: f"N={n}: {s:.0f} s, trainer version {_trainer_version(log)}",
        )
        cfg = load_config(EXAMPLE, [*settings(n, cost), *_endpoint_settings(eps)])
        metrics, statuses = asyncio.run(read_back(with_run_id(cfg, run_id)))
    if proc.returncode != 0:
        tail = (folder / "run.log").read_text(errors="replace").splitlines()[-15:]
        print(
            f"#   N={n}: streamrft run exited {proc.returncode}:",
            *tail,
            sep="\n#     ",
            file=sys.stderr,
        )
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    trainer = trainer_figures(metrics)
    first_at, steady = trainer.pop("first_step_at"), trainer.pop("steady")
    return {
        "explorers": n,
        **trainer,
        **rollout_figures(metrics, cfg.explorer.batch_size, n, steady),
        **summary_figures(summary),
        **explorer_figures(statuses),
        "first_step_s": round(first_at - started, 2) if first_at else None,
        "exit_code": proc.returncode,
        "timed_out": not finished,
        "wall_s": round(time.monotonic() - wall, 1),
    }


def _endpoint_settings(eps: Endpoints) -> list[str]:
    """``service_overrides`` as plain ``key=value`` settings (without the ``-o``)."""
    return [arg for arg in service_overrides(eps) if arg != "-o"]


# -- the table -------------------------------------------------------------------------------


def _cell(point: dict, key: str) -> str:
    value = point.get(key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "y" if value else "n"
    return str(value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"N in {QUICK}, {QUICK_STEPS} steps")
    p.add_argument("--explorers", help=f"comma-separated explorer counts (default {FULL})")
    p.add_argument("--steps", type=int, help=f"trainer steps per run (default {STEPS})")
    p.add_argument("--seconds-per-token", type=float, default=SECONDS_PER_TOKEN)
    p.add_argument("--keep", action="store_true", help="keep the work folder (run logs)")
    p.add_argument("--note", help='a note for the JSON line, e.g. "baseline: before ..."')
    args = p.parse_args()
    counts = QUICK if args.quick else FULL
    if args.explorers:
        counts = tuple(int(x) for x in args.explorers.split(",") if x)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if steps < WARMUP_STEPS + 3:
        p.error(f"--steps must be at least {WARMUP_STEPS + 3}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    workdir = Path(tempfile.mkdtemp(prefix="scale-explorers-"))
    print(f"# work folder {workdir}", file=sys.stderr)
    points, started = [], time.monotonic()
    try:
        for n in counts:
            print(f"# N={n}: streamrft run, {steps} steps", file=sys.stderr)
            points.append(run_point(n, steps, args.seconds_per_token, workdir))
            print(f"#   N={n}: {json.dumps(points[-1])}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"# kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    add_bounds(points)
    points = [{k: point[k] for k in FIRST_KEYS} | point for point in points]
    header = " | ".join(k.ljust(w) for k, w in COLUMNS)
    print(header)
    print("-" * len(header))
    for point in points:
        print(" | ".join(_cell(point, k).ljust(w) for k, w in COLUMNS))
    result = {
        "bench": "scale_explorers",
        "seconds_per_token": args.seconds_per_token,
        "steps": steps,
        "warmup_steps": WARMUP_STEPS,
        "wall_s": round(time.monotonic() - started, 1),
        **({"note": args.note} if args.note else {}),
        "points": points,
    }
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
