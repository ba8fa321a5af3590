"""Weight sync inside the real training loop: what each sync method costs a trainer step.

    python bench/sync_in_loop.py [--quick] [--steps N] [--device cpu|cuda] [--dtype D]
        [--hidden-size H] [--intermediate-size I] [--layers L] [--heads A]
        [--batch-size G] [--points object_store,filesystem,nccl,shared,auto,no_sync] [--timeout S] [--keep]

The bench starts one set of local services (a Tansu broker in memory and a JuiceFS S3
gateway, ``LocalServices``: the ones ``streamrft run`` starts for itself when no
``kafka.bootstrap_servers`` / ``object_store.endpoint`` is set, started here by the bench
so that they outlive each run and the run's status topic can be read back), then one real
``streamrft run`` of ``examples/arithmetic.yaml`` per point (supervisor, feeder, ONE
explorer and the trainer as OS processes, ``OMP_NUM_THREADS=1``), one after the other, each
with its own run id:

- ``object_store``, ``filesystem``, ``nccl`` (a torch.distributed broadcast: gloo on CPU,
  NCCL on GPUs), ``shared`` (``/dev/shm`` on this host), ``auto`` (shared memory, and the
  object store written in the background): ``synchronizer.method`` set to it, the example's schedule otherwise (a new
  version after every step, ``sync_offset`` 1: the explorer samples batch b with version
  b - 1, so it waits for the version the trainer published one step earlier);
- ``no_sync``, the baseline: ``object_store`` with ``synchronizer.sync_interval`` = steps + 1
  (and ``trainer.max_staleness`` raised to match, as the config check requires): only
  version 0 is ever published, the explorer samples every batch with it and never waits.

Every run: ``--max-steps`` trainer steps, the model shape of the command line (default a
~50M-parameter tiny Llama; ``--quick``: the example's own tiny shape, about 1.5 min in all
on 2 cores, most of it the start of each run's processes),
``model.device`` / ``model.dtype`` from ``--device`` / ``--dtype``, ``--batch-size`` groups
of 8 rollouts per step (``explorer.batch_size`` and ``trainer.batch_size``; default the
example's 32, but 4 for the full-size model on the CPU, where 32 makes a 40 s trainer step
on 2 cores and the sync a rounding error), ``trainer.warmup_sft_steps=0``,
``eval.interval=0``, ``trainer.save_interval=0`` (the trainer still evaluates and
checkpoints once after its last step: outside the figures).

Figures per point, from the run's ``runs/<id>/metrics.jsonl`` (the trainer's per-step
metrics and its final ``trainer/*`` counters, the explorer's per-step metrics) and the
explorer's newest status counters (its status topic, read after the run):

- ``step_s``: the trainer's step period, the median interval between the ``created_at`` of
  successive trainer step metrics, the first ``WARMUP_STEPS`` steps left out (start-up,
  version 0, the explorer's first batches). This is the real period: it holds the wait for
  a batch, the step, the version snapshot (``publish_blocked_seconds``) and the sends of the
  metrics and status; ``train/step_seconds`` + ``train/wait_seconds`` leaves the last two out;
- ``step_over_ideal``: ``step_s`` / the ``no_sync`` point's ``step_s`` (null without it);
- ``train_s``, ``wait_s``: median ``train/step_seconds``, ``train/wait_seconds``, same steps;
  ``rollout_s``: median ``explorer/rollout_seconds`` over the explorer's steps;
- ``publish_s``: ``trainer/publish_seconds`` / ``trainer/versions_published``: the publisher's
  background worker per version (payload made, sent, announced; under ``nccl`` the
  broadcast returns once the explorer has the bytes). Version 0 counts (for ``no_sync`` it is
  the only one); under ``nccl`` it goes through the object store when the trainer has not
  heard from the explorer yet (``versions_broadcast`` says how many did not);
- ``blocked_s``: median of the per-step metric ``trainer/publish_blocked_seconds``, what
  publishing cost the trainer's loop (the snapshot of the weights), same steps;
- ``bytes``: ``trainer/published_bytes`` / ``trainer/versions_published``;
- ``sync_s``: the explorer's ``sync_seconds`` / ``versions_applied`` counters: receiving one
  version (fetch and verify, or the broadcast) and applying it, together;
- ``fetch_s``, ``apply_s``: null today: the explorer's weight follower
  (``sync/follower.py``) reports only their sum, ``sync_seconds``. Counters named
  ``fetch_seconds`` and ``apply_seconds``, if it ever reports them, are used;
- ``versions_published``, ``versions_broadcast`` (``nccl``: versions that went by the
  broadcast, not its object-store fallback), ``versions_applied``, ``steps``, ``exit_code``,
  ``timed_out``, ``wall_s``.

What ``step_over_ideal`` holds besides the sync: the baseline's explorer never waits for a
version, so it runs ahead of the trainer (as far as the backpressure of ``max_staleness``
lets it) and then idles, and its trainer has the machine to itself; at the sync points the
explorer rolls out batch b + 1 and applies its version while the trainer trains batch b. On
a box with few cores that contention shows in ``train_s`` (seen on 2 cores: the tiny model's
``train_s`` 1.5-1.8x the baseline's, ``wait_s`` and ``blocked_s`` near 0); with the
~50M model the ratio is 1.0-1.2. On one GPU the ``nccl`` point puts both NCCL ranks on the
same device, which NCCL does not support: expect its versions to go through the object-store
fallback (``versions_broadcast`` 0; untested, no GPU was lent to this work).

A figure, not a test: nothing is asserted. Progress on stderr; the last line on stdout is
one JSON object ``{"bench": "sync_in_loop", "device", "params", "points": [...]}``. Every
run goes under a temporary folder removed at the end, and every process a run started is
killed (its process group and whatever names its folder) on an error, a timeout or Ctrl-C.
The bench exits 1 when a run failed or timed out (its JSON line is printed all the same).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import asyncio
import itertools
import json
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# the run's command line comes from the test helpers (tests/), not part of the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale_explorers import _endpoint_settings, run_to_end  # bench/, beside us

from streamrft.app.watch.metrics_log import read_metrics
from streamrft.infra.config import ModelConfig, load_config, with_run_id
from streamrft.infra.consume import read_history
from streamrft.infra.local.services import Endpoints, LocalServices
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas.codec import STATUS
from streamrft.schemas.events import MetricsEvent, StatusEvent
from tests.helpers.cli import run_argv
from tests.helpers.paths import EXAMPLE

SYNC_METHODS = ("object_store", "filesystem", "nccl", "shared", "auto")
BASELINE = "no_sync"
POINTS = (*SYNC_METHODS, BASELINE)
SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_layers": 7, "num_heads": 12}
"""The default model shape: 49.6M parameters with the example's tokenizer."""
STEPS = 8
CPU_BATCH = 4
"""Groups per step of the full-size model on the CPU (the example's 32 elsewhere)."""
WARMUP_STEPS = 2
"""Trainer steps before the first one whose period counts (start-up, version 0)."""
RUN_TIMEOUT_S, QUICK_TIMEOUT_S = 900.0, 240.0
FIRST_KEYS = (
    "method",
    "step_over_ideal",
    "publish_s",
    "fetch_s",
    "apply_s",
    "blocked_s",
    "bytes",
    "step_s",
)
"""The keys every point of the JSON line starts with, in this order; more follow."""


def say(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _per(total: float | None, count: float | None) -> float | None:
    """``total / count`` rounded, None when either is missing or the count is 0."""
    if total is None or not count:
        return None
    return round(total / count, 4)


# -- what each point runs --------------------------------------------------------------------


def common_settings(args: argparse.Namespace) -> list[str]:
    """The ``-o`` settings of every point: device, dtype, shape, no warm-up, no evaluation,
    no checkpoint but the last."""
    shape = [] if args.quick else [f"model.{k}={getattr(args, k)}" for k in SHAPE]
    batch = []
    if args.batch_size is not None:  # the feeder numbers batches by trainer.batch_size
        batch = [f"{role}.batch_size={args.batch_size}" for role in ("explorer", "trainer")]
    return [
        f"model.device={args.device}",
        f"model.dtype={args.dtype}",
        *shape,
        *batch,
        "trainer.warmup_sft_steps=0",
        "eval.interval=0",
        "trainer.save_interval=0",
    ]


def point_settings(point: str, steps: int) -> list[str]:
    """The ``-o`` settings of one point: its sync method, or the no-sync baseline's schedule."""
    if point != BASELINE:
        return [f"synchronizer.method={point}"]
    never = steps + 1  # the trainer publishes at steps that are multiples of the interval
    return [
        "synchronizer.method=object_store",
        f"synchronizer.sync_interval={never}",
        # the config check: max_staleness >= sync_offset + sync_interval - 1 (offset 1)
        f"trainer.max_staleness={never}",
    ]


def count_params(model_cfg: ModelConfig) -> int:
    """Parameters of the tiny model ``model_cfg`` describes (built on the meta device)."""
    with torch.device("meta"):
        model = build_tiny_model(model_cfg, build_char_tokenizer(model_cfg.charset))
    return sum(p.numel() for p in model.parameters())


# -- the figures -------------------------------------------------------------------------------


def trainer_figures(events: list[MetricsEvent]) -> dict:
    """The step period and the per-step medians (steady steps), and the final counters."""
    steps: dict[int, MetricsEvent] = {}
    final: dict[str, float] = {}
    for ev in events:
        if ev.component != "trainer":
            continue
        if "train/step_seconds" in ev.values:
            steps[ev.step] = ev  # the last attempt of each step
        if "trainer/final_step" in ev.values:
            final = ev.values
    steady = [steps[s] for s in sorted(steps)][WARMUP_STEPS:]
    gaps = [b.created_at - a.created_at for a, b in itertools.pairwise(steady)]

    def median_of(key: str) -> float | None:
        return _median([e.values[key] for e in steady if key in e.values])

    published = final.get("trainer/versions_published")
    return {
        "steps": len(steps),
        "step_s": _median(gaps),
        "train_s": median_of("train/step_seconds"),
        "wait_s": median_of("train/wait_seconds"),
        "blocked_s": median_of("trainer/publish_blocked_seconds"),
        "publish_s": _per(final.get("trainer/publish_seconds"), published),
        "bytes": int(final["trainer/published_bytes"] / published) if published else None,
        "versions_published": int(published) if published is not None else None,
        "versions_broadcast": int(final.get("trainer/versions_broadcast", 0)),
    }


def explorer_figures(events: list[MetricsEvent], statuses: list[StatusEvent]) -> dict:
    """Rollout (its metrics) and sync per version (its newest status counters)."""
    rollouts = [
        ev.values["explorer/rollout_seconds"]
        for ev in events
        if "explorer/rollout_seconds" in ev.values and ev.values.get("explorer/groups", 0) > 0
    ]
    newest = [ev for ev in statuses if ev.role == "explorer"]
    counters = newest[-1].counters if newest else {}
    applied = counters.get("versions_applied")
    return {
        "rollout_s": _median(rollouts),
        "sync_s": _per(counters.get("sync_seconds"), applied),
        "fetch_s": _per(counters.get("fetch_seconds"), applied),
        "apply_s": _per(counters.get("apply_seconds"), applied),
        "versions_applied": int(applied) if applied is not None else None,
    }


def add_ratios(points: list[dict]) -> None:
    """``step_over_ideal`` of every point against the no-sync baseline's step period."""
    base = next((p["step_s"] for p in points if p["method"] == BASELINE), None)
    for p in points:
        ok = base and p["step_s"] is not None and math.isfinite(p["step_s"])
        p["step_over_ideal"] = round(p["step_s"] / base, 3) if ok else None


# -- one point: the run, then its figures --------------------------------------------------


def _trainer_steps(metrics_file: Path) -> int:
    """Trainer steps in the run's metrics file so far (for the progress lines)."""
    try:
        with metrics_file.open("rb") as fh:
            return sum(1 for line in fh if b'"train/step_seconds"' in line)
    except OSError:
        return 0


async def read_statuses(settings: list[str], run_id: str) -> list[StatusEvent]:
    cfg = with_run_id(load_config(EXAMPLE, settings), run_id)
    return await read_history(cfg.kafka, cfg.topics().status, STATUS, "sync-in-loop-bench")


def run_point(
    point: str, steps: int, common: list[str], eps: Endpoints, workdir: Path, timeout: float
) -> dict:
    """One ``streamrft run`` with one explorer on the shared services; its figures."""
    folder = workdir / point
    folder.mkdir()
    runs = folder / "runs"
    run_id = f"sync-{point.replace('_', '-')}-{os.getpid()}"
    settings = [*common, *point_settings(point, steps)]
    argv = run_argv(EXAMPLE, run_id, steps, runs, eps, *settings, explorers=1)
    metrics_file = runs / run_id / "metrics.jsonl"
    wall = time.monotonic()
    proc, finished = run_to_end(
        argv,
        folder,
        runs,
        timeout,
        lambda s: f"{point}: {s:.0f} s, trainer step {_trainer_steps(metrics_file)}",
    )
    if proc.returncode != 0 or not finished:
        tail = (folder / "run.log").read_text(errors="replace").splitlines()[-15:]
        what = "timed out" if not finished else f"exited {proc.returncode}"
        say(f"  {point}: streamrft run {what}:\n#     " + "\n#     ".join(tail))
    events = read_metrics(metrics_file) if metrics_file.is_file() else []
    statuses = asyncio.run(read_statuses([*settings, *_endpoint_settings(eps)], run_id))
    return {
        "method": point,
        **trainer_figures(events),
        **explorer_figures(events, statuses),
        "exit_code": proc.returncode,
        "timed_out": not finished,
        "wall_s": round(time.monotonic() - wall, 1),
    }


# -- the command line ----------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the example's own tiny shape and batch")
    p.add_argument("--steps", type=int, help=f"trainer steps per run (default {STEPS})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="model.dtype (default float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument("--hidden-size", dest="hidden_size", type=int, default=SHAPE["hidden_size"])
    p.add_argument(
        "--intermediate-size",
        dest="intermediate_size",
        type=int,
        default=SHAPE["intermediate_size"],
    )
    p.add_argument("--layers", dest="num_layers", type=int, default=SHAPE["num_layers"])
    p.add_argument("--heads", dest="num_heads", type=int, default=SHAPE["num_heads"])
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"groups per step (default the example's; {CPU_BATCH} full-size on the cpu)",
    )
    p.add_argument("--points", default=",".join(POINTS), help="comma-separated, in order")
    p.add_argument("--timeout", type=float, help="seconds per run before it is killed")
    p.add_argument("--keep", action="store_true", help="keep the work folder (run logs)")
    args = p.parse_args()
    args.steps = args.steps or STEPS
    if args.steps < WARMUP_STEPS + 3:
        p.error(f"--steps must be at least {WARMUP_STEPS + 3}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.batch_size is None and not args.quick and args.device == "cpu":
        args.batch_size = CPU_BATCH
    args.timeout = args.timeout or (QUICK_TIMEOUT_S if args.quick else RUN_TIMEOUT_S)
    args.points = list(dict.fromkeys(x for x in args.points.split(",") if x))
    unknown = set(args.points) - set(POINTS)
    if unknown or not args.points:
        p.error(f"--points: {sorted(unknown)} not in {POINTS}")
    return args


def run_points(args: argparse.Namespace, common: list[str], workdir: Path) -> list[dict]:
    """Every point, one after the other, on one set of local services."""
    points = []
    with LocalServices(workdir / "services") as services:
        for point in args.points:
            say(f"{point}: streamrft run, {args.steps} steps")
            points.append(
                run_point(point, args.steps, common, services.endpoints, workdir, args.timeout)
            )
            say(f"  {point}: {json.dumps(points[-1])}")
    return points


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    common = common_settings(args)
    cfg = load_config(EXAMPLE, common)
    params = count_params(cfg.model)
    workdir = Path(tempfile.mkdtemp(prefix="sync-in-loop-"))
    say(f"work folder {workdir}; {params:,} parameters, {args.device} {args.dtype}")
    try:
        points = run_points(args, common, workdir)
    finally:
        if args.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    add_ratios(points)
    points = [{k: point.get(k) for k in FIRST_KEYS} | point for point in points]
    result = {
        "bench": "sync_in_loop",
        "device": args.device,
        "dtype": args.dtype,
        "params": params,
        "steps": args.steps,
        "batch_size": cfg.trainer.batch_size,
        "warmup_steps": WARMUP_STEPS,
        "points": points,
    }
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return 0 if all(p["exit_code"] == 0 and not p["timed_out"] for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
