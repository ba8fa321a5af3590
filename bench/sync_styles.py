"""Sync styles bench: reward against wall time, ``fully_async`` against ``fixed`` one-step-off.

    python bench/sync_styles.py [--quick] [--steps 40] [--seeds 0,1] [--explorers 2]
                                [--simulated-steps 30] [--seconds-per-token 0.002]
                                [--kinds tiny,simulated,uneven] [--slow 4]
                                [--max-staleness 2]

Kinds of run, each under ``synchronizer.style: fixed`` (``sync_offset: 1``,
``sync_interval: 1``) and ``fully_async`` (same interval), ``trainer.max_staleness: 2``
(``--max-staleness``),
each on its own local services (``LocalServices``: a Tansu broker and a JuiceFS S3
gateway), the real ``streamrft run`` of ``examples/arithmetic.yaml`` with ``--explorers
N``:

- **tiny**, per seed: the default example's tiny model (its SFT warm-up, evaluation every
  10 steps), ``--steps`` trainer steps. Figures: ``wall_s`` (first trainer step to last),
  ``reward_first5`` / ``reward_last5`` (mean ``train/reward_mean`` of the first and last 5
  steps), ``eval_last`` (the last ``eval/accuracy``), ``reward_at_t`` (the mean of the
  ``train/reward_mean`` of the steps that ended within the fixed run's wall time, to
  compare at equal time), ``staleness_mean`` (mean ``train/staleness_mean``),
  ``stale_dropped``, ``explorer_busy`` (the explorers' rollout seconds over N x the
  span of the trainer's steps).
- **simulated**: ``explorer.engine=simulated`` (random tokens, a sleep per token: slow
  explorers whatever the CPU), no warm-up or evaluation, ``--simulated-steps`` steps:
  ``step_s`` (median interval between trainer steps), ``explorer_busy``, ``wait_s``
  (median ``train/wait_seconds``), ``stale_dropped``.
- **uneven** (``--kinds uneven``, not run by default): the simulated engine with an uneven
  fleet: ``--explorers`` minus one explorers of the run at ``--seconds-per-token``, and one
  more started by hand (``streamrft explore --run-id``) ``--slow`` times slower. Figures as
  for ``simulated``.

The baseline is ``fixed``, measured in the same run: ``ratios`` gives ``fully_async``'s
``wall_s`` and ``step_s`` over ``fixed``'s (below 1: faster), and its reward and
evaluation minus ``fixed``'s, per kind (and seed). A figure, not a test: nothing is
asserted. Human-readable lines first, then one JSON line on stdout; progress on stderr.
Absolute times are of the machine it runs on (the docs name it).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import asyncio
import itertools
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

# the run's command line comes from the test helpers (tests/), not part of the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale_explorers import _endpoint_settings, read_back, run_to_end  # bench/, beside us

from streamrft.infra.config import load_config, with_run_id
from streamrft.infra.local.services import LocalServices
from streamrft.schemas.events import MetricsEvent
from tests.helpers.cli import env, explore_argv, run_argv
from tests.helpers.paths import EXAMPLE

STYLES = ("fixed", "fully_async")
RUN_TIMEOUT_S = 900.0


def settings(style: str, kind: str, seed: int, cost: float, staleness: int = 2) -> list[str]:
    """The ``-o`` settings of one run."""
    common = [
        f"synchronizer.style={style}",
        "synchronizer.sync_interval=1",
        "synchronizer.sync_offset=1",
        f"trainer.max_staleness={staleness}",
        "trainer.save_interval=0",
        f"run.seed={seed}",
        f"model.seed={seed}",
        "kafka.partitions=4",
    ]
    if kind in ("simulated", "uneven"):
        return [
            *common,
            "explorer.engine=simulated",
            f"explorer.simulated_seconds_per_token={cost}",
            "trainer.warmup_sft_steps=0",
            "eval.interval=0",
        ]
    return [*common, "eval.interval=10"]


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def figures(metrics: list[MetricsEvent], explorers: int) -> dict:
    """The run's figures (see the module docstring), and its trainer steps' times."""
    steps: dict[int, MetricsEvent] = {}
    for ev in metrics:
        if ev.component == "trainer" and "train/step_seconds" in ev.values:
            steps[ev.step] = ev
    ordered = [steps[s] for s in sorted(steps)]
    evals = [ev.values["eval/accuracy"] for ev in metrics if "eval/accuracy" in ev.values]
    rewards = [ev.values["train/reward_mean"] for ev in ordered]
    rollouts = [
        (ev.created_at, ev.values["explorer/rollout_seconds"])
        for ev in metrics
        if "explorer/rollout_seconds" in ev.values
    ]
    start, end = (ordered[0].created_at, ordered[-1].created_at) if ordered else (0.0, 0.0)
    busy = sum(s for at, s in rollouts if start < at <= end)
    gaps = [b.created_at - a.created_at for a, b in itertools.pairwise(ordered)]
    return {
        "trainer_steps": len(ordered),
        "wall_s": round(end - start, 2),
        "step_s": round(statistics.median(gaps), 3) if gaps else None,
        "wait_s": _mean([ev.values["train/wait_seconds"] for ev in ordered]),
        "reward_first5": _mean(rewards[:5]),
        "reward_last5": _mean(rewards[-5:]),
        "eval_last": round(evals[-1], 4) if evals else None,
        "staleness_mean": _mean([ev.values["train/staleness_mean"] for ev in ordered]),
        "explorer_busy": round(busy / (explorers * (end - start)), 3) if end > start else None,
        "_times": [(ev.created_at - start, ev.values["train/reward_mean"]) for ev in ordered],
    }


class SlowExplorer:
    """``streamrft explore`` (``argv``) started once the run's ``config.yaml`` exists, on a
    thread of its own, and stopped (SIGTERM) with the run."""

    def __init__(self, argv: list[str], ready: Path, folder: Path) -> None:
        self.argv, self.ready, self.folder = argv, ready, folder
        self.proc: subprocess.Popen | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.ready.is_file():
            if self.done.wait(0.5):
                return
        with (self.folder / "slow-explorer.log").open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=self.folder
            )

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(5)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_point(style: str, kind: str, seed: int, args, workdir: Path) -> dict:
    """One ``streamrft run`` on its own services; its figures."""
    folder = workdir / f"{kind}-{style}-{seed}"
    runs, summary_path = folder / "runs", folder / "summary.json"
    run_id = f"styles-{kind}-{style.replace('_', '-')}-{seed}-{os.getpid()}"
    steps = args.simulated_steps if kind in ("simulated", "uneven") else args.steps
    extra = settings(style, kind, seed, args.seconds_per_token, args.max_staleness)
    uneven = kind == "uneven"  # the run's explorers, and one more, slower, joining by hand
    folder.mkdir(parents=True, exist_ok=True)
    with LocalServices(folder / "services") as services:
        eps = services.endpoints
        argv = run_argv(
            EXAMPLE,
            run_id,
            steps,
            runs,
            eps,
            *extra,
            explorers=args.explorers - uneven,
            summary=summary_path,
        )
        slow = SlowExplorer(
            explore_argv(
                EXAMPLE,
                run_id,
                runs,
                eps,
                *extra,
                f"explorer.simulated_seconds_per_token={args.seconds_per_token * args.slow}",
            ),
            runs / run_id / "config.yaml",
            folder,
        )
        if uneven:
            slow.start()
        try:
            proc, finished = run_to_end(
                argv,
                folder,
                runs,
                RUN_TIMEOUT_S,
                lambda s: f"{kind} {style} seed {seed}: {s:.0f} s",
            )
        finally:
            slow.stop()
        cfg = load_config(EXAMPLE, [*extra, *_endpoint_settings(eps)])
        metrics, _ = asyncio.run(read_back(with_run_id(cfg, run_id)))
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {
        "kind": kind,
        "style": style,
        "seed": seed,
        **figures(metrics, args.explorers),
        "stale_dropped": summary.get("stale_dropped"),
        "exit_code": proc.returncode,
        "timed_out": not finished,
    }


def reward_at(times: list[tuple[float, float]], limit: float) -> float | None:
    """Mean reward of the last 5 steps that ended within ``limit`` seconds."""
    within = [r for t, r in times if t <= limit][-5:]
    return _mean(within)


def compare(points: list[dict]) -> list[dict]:
    """``fully_async`` against ``fixed`` (the baseline) per kind and seed."""
    out = []
    by = {(p["kind"], p["seed"], p["style"]): p for p in points}
    for (kind, seed, style), fixed in by.items():
        if style != "fixed" or (kind, seed, "fully_async") not in by:
            continue
        fast = by[(kind, seed, "fully_async")]
        row: dict = {"kind": kind, "seed": seed}
        for key in ("wall_s", "step_s"):
            if fixed.get(key) and fast.get(key):
                row[f"{key}_ratio"] = round(fast[key] / fixed[key], 3)
        for key in ("reward_last5", "eval_last"):
            if fixed.get(key) is not None and fast.get(key) is not None:
                row[f"{key}_diff"] = round(fast[key] - fixed[key], 4)
        limit = fixed["wall_s"]  # the same wall time for both
        fixed_at, fast_at = reward_at(fixed["_times"], limit), reward_at(fast["_times"], limit)
        if fixed_at is not None and fast_at is not None:
            row["reward_at_fixed_wall_diff"] = round(fast_at - fixed_at, 4)
        out.append(row)
    return out


def ab_parser(doc: str, steps: int, simulated_steps: int, cost: float, quick: str):
    """The options an A/B bench of whole runs shares (``--quick``: ``quick`` says what)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--simulated-steps", type=int, default=simulated_steps)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--seconds-per-token", type=float, default=cost)
    parser.add_argument("--kinds", default="tiny,simulated")
    return parser


def run_points(
    kinds: list[str], seeds: list[int], modes: tuple, run: Callable[[object, str, int], dict]
) -> list[dict]:
    """``run(mode, kind, seed)`` of every mode, for each seed of the tiny model and the
    first seed of the simulated engine; progress on stderr."""
    points = []
    for kind in kinds:
        for seed in seeds if kind == "tiny" else seeds[:1]:
            for mode in modes:
                print(f"# {kind} {mode} seed {seed}", file=sys.stderr, flush=True)
                points.append(run(mode, kind, seed))
    return points


def report(bench: str, points: list[dict], ratios: list[dict], versus: str, **extra) -> None:
    """The human-readable lines (``versus``: what the ratios compare), then the one JSON
    line (the points without their ``_`` keys)."""
    shown = [{k: v for k, v in p.items() if not k.startswith("_")} for p in points]
    for p in shown:
        print("  ".join(f"{k}={v}" for k, v in p.items()))
    for r in ratios:
        print(f"{versus}: " + "  ".join(f"{k}={v}" for k, v in r.items()))
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps({"bench": bench, **extra, "ratios": ratios, "points": shown, "at": at}))


def main() -> int:
    parser = ab_parser(__doc__, 40, 30, 0.002, "seed 0, 12 + 10 steps")
    parser.add_argument("--explorers", type=int, default=2)
    parser.add_argument(
        "--slow", type=float, default=4.0, help="uneven: the slow explorer's cost, times"
    )
    parser.add_argument("--max-staleness", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.simulated_steps, args.seeds = 12, 10, "0"
    seeds = [int(s) for s in args.seeds.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="styles-bench-"))
    try:
        points = run_points(
            args.kinds.split(","),
            seeds,
            STYLES,
            lambda style, kind, seed: run_point(style, kind, seed, args, workdir),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(
        "sync_styles",
        points,
        compare(points),
        "fully_async vs fixed",
        explorers=args.explorers,
        max_staleness=args.max_staleness,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
