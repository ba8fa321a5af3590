"""Weight sync inside the real training loop: what each sync method costs a trainer step.

    python bench/sync_in_loop.py [--quick] [--steps N] [--device cpu|cuda] [--dtype D]
        [--shape 50m|268m|qwen2.5-1.5b] [--hidden-size H] [--intermediate-size I]
        [--layers L] [--heads A] [--batch-size G]
        [--points object_store,filesystem,nccl,shared,auto,cuda_ipc,ideal,no_sync]
        [--timeout S] [--keep]

The bench starts one set of local services (a Tansu broker in memory and a JuiceFS S3
gateway, ``LocalServices``: the ones ``streamrft run`` starts for itself when no
``kafka.bootstrap_servers`` / ``object_store.endpoint`` is set, started here by the bench
so that they outlive each run and the run's status topic can be read back), then one real
``streamrft run`` of ``examples/arithmetic.yaml`` per point (supervisor, feeder, ONE
explorer and the trainer as OS processes, ``OMP_NUM_THREADS=1``), one after the other, each
with its own run id:

- ``object_store``, ``filesystem``, ``nccl`` (a torch.distributed broadcast: gloo on CPU,
  NCCL on GPUs), ``shared`` (``/dev/shm`` on this host), ``auto`` (shared memory, and the
  object store written in the background; from a trainer on a GPU the device path first),
  ``cuda_ipc`` (the device path alone: the trainer on a GPU only; not in the default points
  on a CPU): ``synchronizer.method`` set to it, the example's schedule otherwise (a new
  version after every step, ``sync_offset`` 1: the explorer samples batch b with version
  b - 1, so it waits for the version the trainer published one step earlier);
- ``ideal``: the same schedule and staleness bound, ``shared`` on the trainer's side, and
  ``synchronizer.load_versions: false``: the explorer waits for every version the others
  wait for but loads none. Its ``max(train_s, rollout_s)`` is ``ideal_s``, the step period
  of a one-step-off run whose weights cost nothing to move;
- ``no_sync``, the older baseline: ``object_store`` with ``synchronizer.sync_interval`` =
  steps + 1 (and ``trainer.max_staleness`` raised to match, as the config check requires):
  only version 0 is ever published, the explorer samples every batch with it, never waits,
  and runs ahead of the trainer as far as that bound lets it.

Every run: ``--max-steps`` trainer steps, the model shape of the command line (``--shape``:
``50m``, the default, a 49.6M-parameter tiny Llama; ``268m``, hidden 1024 x 16 layers, the
GPU figures' shape; ``qwen2.5-1.5b``, Qwen2.5-1.5B's hidden size, MLP width, layers and
heads, random init, with the tiny builder's character vocabulary and as many key/value
heads as heads: 1.42B parameters, 2.84 GB a version in bf16, where Qwen2.5-1.5B has 1.54B,
most of the difference its 151,936-token embedding; ``--hidden-size`` etc. override a
shape's field; ``--quick``: the example's own tiny shape, about 2 min in all on 2 cores,
most of it the start of each run's processes), ``model.device`` / ``model.dtype`` from
``--device`` / ``--dtype``, ``--batch-size`` groups of 8 rollouts per step
(``explorer.batch_size`` and ``trainer.batch_size``; default the example's 32, but 4 for
the full-size model on the CPU, where 32 makes a 40 s trainer step on 2 cores and the sync
a rounding error), ``trainer.warmup_sft_steps=0``, ``eval.interval=0``,
``trainer.save_interval=0`` (the trainer still evaluates and checkpoints once after its
last step: outside the figures).

Figures per point, from the run's ``runs/<id>/metrics.jsonl`` (the trainer's per-step
metrics and its final ``trainer/*`` counters, the explorer's per-step metrics) and the
explorer's newest status counters (its status topic, read after the run):

- ``step_s``: the trainer's step period, the median interval between the ``created_at`` of
  successive trainer step metrics, the first ``WARMUP_STEPS`` steps left out (start-up,
  version 0, the explorer's first batches). This is the real period: it holds the wait for
  a batch, the step, the version snapshot (``publish_blocked_seconds``) and the sends of the
  metrics and status; ``train/step_seconds`` + ``train/wait_seconds`` leaves the last two out;
- ``step_over_ideal``: ``step_s`` / ``ideal_s`` (null without the ``ideal`` point);
  ``step_over_no_sync``: ``step_s`` / the ``no_sync`` point's ``step_s`` (null without it);
- ``train_s``, ``wait_s``: median ``train/step_seconds``, ``train/wait_seconds``, same steps;
  ``rollout_s``: median ``explorer/rollout_seconds`` over the explorer's steps;
- ``sync_wait_s``, ``receive_s``, ``apply_s``: per version applied (the explorer's counters
  ``sync_wait_seconds``, ``receive_seconds``, ``apply_seconds`` / ``versions_applied``;
  null when it does not report them): what sampling waited from the choice of a version to
  its apply, the receives (in the background with a staging copy) and the copies into the
  model; ``step_sync_wait_s``, ``step_receive_s``, ``step_apply_s``: the medians of the
  per-step metrics ``explorer/sync_wait_s``, ``explorer/receive_s``, ``explorer/apply_s``;
  ``sync_s``: ``sync_seconds`` / ``versions_applied`` (receive and apply together);
- ``publish_s``: ``trainer/publish_seconds`` / ``trainer/versions_published``: the publisher's
  background worker per version (payload made, sent, announced; under ``nccl`` the
  broadcast returns once the explorer has the bytes). Version 0 counts (for ``no_sync`` it is
  the only one); under ``nccl`` it goes through the object store when the trainer has not
  heard from the explorer yet (``versions_broadcast`` says how many did not);
- ``blocked_s``: median of the per-step metric ``trainer/publish_blocked_seconds``, what
  publishing cost the trainer's loop (the snapshot of the weights), same steps;
- ``bytes``: ``trainer/published_bytes`` / ``trainer/versions_published``;
- ``versions_published``, ``versions_broadcast`` (``nccl``: versions that went by the
  broadcast, not its object-store fallback), ``versions_applied``, ``versions_by`` (the
  explorer's ``versions_applied_<method>`` counters: which announcement each version came
  through), ``steps``, ``exit_code``, ``timed_out``, ``wall_s``.

What the ratios hold: ``ideal_s`` comes from a run as busy as the others but for the
weights' transfer (its trainer still snapshots each version and writes it to shared memory,
its explorer waits at the same points); ``no_sync``'s explorer runs ahead and then idles,
so its trainer has the machine to itself near the end (on 2 cores its ``train_s`` was
seen at 0.6-0.75 of the synced points'). On one GPU the ``nccl`` point puts both NCCL
ranks on the same device, which NCCL does not support: expect its versions to go through
the object-store fallback (``versions_broadcast`` 0). The device path (``cuda_ipc``, and
``auto`` on a GPU) has not run on a GPU yet.

A figure, not a test: nothing is asserted. Progress and a table of the main figures on
stderr; the last line on stdout is one JSON object ``{"bench": "sync_in_loop", "device",
"params", "ideal_s", "points": [...]}``. Every run goes under a temporary folder removed at
the end, and every process a run started is killed (its process group and whatever names
its folder) on an error, a timeout or Ctrl-C. The bench exits 1 when a run failed or timed
out (its JSON line is printed all the same).
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
from tests.helpers.qwen_shape import QWEN2_5_1_5B

SYNC_METHODS = ("object_store", "filesystem", "nccl", "shared", "auto", "cuda_ipc")
IDEAL = "ideal"
BASELINE = "no_sync"
POINTS = (*SYNC_METHODS, IDEAL, BASELINE)
DEVICE_ONLY = ("cuda_ipc",)
"""Points only a trainer on a GPU can run (left out of the default points on a CPU)."""
SHAPES = {
    "50m": {"hidden_size": 768, "intermediate_size": 2048, "num_layers": 7, "num_heads": 12},
    "268m": {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 16, "num_heads": 16},
    "qwen2.5-1.5b": {
        "hidden_size": QWEN2_5_1_5B["hidden_size"],
        "intermediate_size": QWEN2_5_1_5B["intermediate_size"],
        "num_layers": QWEN2_5_1_5B["num_hidden_layers"],
        "num_heads": QWEN2_5_1_5B["num_attention_heads"],
    },
}
"""Model shapes by name (``--shape``); parameters with the example's tokenizer: 49.6M,
268.5M, 1.42B."""
DEFAULT_SHAPE = "50m"
STEPS = 8
CPU_BATCH = 4
"""Groups per step of the full-size model on the CPU (the example's 32 elsewhere)."""
WARMUP_STEPS = 2
"""Trainer steps before the first one whose period counts (start-up, version 0)."""
RUN_TIMEOUT_S, QUICK_TIMEOUT_S = 900.0, 240.0
FIRST_KEYS = (
    "method",
    "step_over_ideal",
    "step_over_no_sync",
    "sync_wait_s",
    "receive_s",
    "apply_s",
    "publish_s",
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
    shape = [] if args.quick else [f"model.{k}={getattr(args, k)}" for k in SHAPES[args.shape]]
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
    """The ``-o`` settings of one point: its sync method, the ideal's (the same schedule,
    nothing loaded), or the no-sync baseline's schedule."""
    if point == IDEAL:
        return ["synchronizer.method=shared", "synchronizer.load_versions=false"]
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


STEP_TIMES = {
    "step_sync_wait_s": "explorer/sync_wait_s",
    "step_receive_s": "explorer/receive_s",
    "step_apply_s": "explorer/apply_s",
}
"""Figure -> the explorer's per-step metric it is the median of."""
VERSION_TIMES = {
    "sync_wait_s": "sync_wait_seconds",
    "receive_s": "receive_seconds",
    "apply_s": "apply_seconds",
    "sync_s": "sync_seconds",
}
"""Figure -> the explorer's counter it is the per-version share of."""


def explorer_figures(events: list[MetricsEvent], statuses: list[StatusEvent]) -> dict:
    """Rollout and the per-step sync times (its metrics), sync per version (its newest
    status counters)."""
    steps = [
        ev.values
        for ev in events
        if ev.component.startswith("explorer") and ev.values.get("explorer/groups", 0) > 0
    ]

    def median_of(key: str) -> float | None:
        return _median([v[key] for v in steps if key in v])

    newest = [ev for ev in statuses if ev.role == "explorer"]
    counters = newest[-1].counters if newest else {}
    applied = counters.get("versions_applied")
    by = {
        k.removeprefix("versions_applied_"): int(v)
        for k, v in counters.items()
        if k.startswith("versions_applied_")
    }
    return {
        "rollout_s": median_of("explorer/rollout_seconds"),
        **{name: _per(counters.get(key), applied) for name, key in VERSION_TIMES.items()},
        **{name: median_of(key) for name, key in STEP_TIMES.items()},
        "versions_applied": int(applied) if applied is not None else None,
        "versions_by": by,
    }


def ideal_seconds(points: list[dict]) -> float | None:
    """max(train_s, rollout_s) of the ``ideal`` point (None without it or its figures)."""
    ideal = next((p for p in points if p["method"] == IDEAL), None)
    if ideal is None or ideal["train_s"] is None or ideal["rollout_s"] is None:
        return None
    return max(ideal["train_s"], ideal["rollout_s"])


def add_ratios(points: list[dict]) -> float | None:
    """``step_over_ideal`` (against :func:`ideal_seconds`) and ``step_over_no_sync``
    (against the no-sync baseline's step period) of every point; the ideal's seconds."""
    ideal = ideal_seconds(points)
    base = next((p["step_s"] for p in points if p["method"] == BASELINE), None)

    def ratio(step_s: float | None, against: float | None) -> float | None:
        ok = against and step_s is not None and math.isfinite(step_s)
        return round(step_s / against, 3) if ok and step_s is not None and against else None

    for p in points:
        p["step_over_ideal"] = ratio(p["step_s"], ideal)
        p["step_over_no_sync"] = ratio(p["step_s"], base)
    return ideal


TABLE = (
    ("method", "{}", 12),
    ("step_s", "{:.3f}", 8),
    ("step_over_ideal", "{:.2f}", 9),
    ("step_over_no_sync", "{:.2f}", 9),
    ("train_s", "{:.3f}", 8),
    ("rollout_s", "{:.3f}", 9),
    ("sync_wait_s", "{:.4f}", 11),
    ("receive_s", "{:.4f}", 9),
    ("apply_s", "{:.4f}", 8),
    ("publish_s", "{:.3f}", 9),
)
"""The columns of the table on stderr: figure, format, width."""


def table(points: list[dict], ideal: float | None) -> list[str]:
    """The main figures of every point as aligned text lines (``-``: none)."""
    lines = ["  ".join(f"{name:>{width}}" for name, _, width in TABLE)]
    for p in points:
        cells = []
        for name, fmt, width in TABLE:
            value = p.get(name)
            cells.append(f"{'-' if value is None else fmt.format(value):>{width}}")
        lines.append("  ".join(cells))
    lines.append(f"ideal_s = max(train_s, rollout_s) of the ideal point = {ideal}")
    return lines


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
    # the trainer's last checkpoint is no figure, and a 1.5B model's fills a GPU box's
    # disk in a few points: gone now, the logs stay until the end
    shutil.rmtree(runs / run_id / "checkpoints", ignore_errors=True)
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
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=DEFAULT_SHAPE,
        help=f"the model's dimensions (default {DEFAULT_SHAPE}); the options below override",
    )
    p.add_argument("--hidden-size", dest="hidden_size", type=int)
    p.add_argument("--intermediate-size", dest="intermediate_size", type=int)
    p.add_argument("--layers", dest="num_layers", type=int)
    p.add_argument("--heads", dest="num_heads", type=int)
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"groups per step (default the example's; {CPU_BATCH} full-size on the cpu)",
    )
    p.add_argument(
        "--points",
        help="comma-separated, in order (default: all but "
        f"{', '.join(DEVICE_ONLY)} on the cpu, all on cuda)",
    )
    p.add_argument("--timeout", type=float, help="seconds per run before it is killed")
    p.add_argument("--keep", action="store_true", help="keep the work folder (run logs)")
    args = p.parse_args()
    for field, value in SHAPES[args.shape].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    args.steps = args.steps or STEPS
    if args.steps < WARMUP_STEPS + 3:
        p.error(f"--steps must be at least {WARMUP_STEPS + 3}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.batch_size is None and not args.quick and args.device == "cpu":
        args.batch_size = CPU_BATCH
    args.timeout = args.timeout or (QUICK_TIMEOUT_S if args.quick else RUN_TIMEOUT_S)
    default = [x for x in POINTS if args.device == "cuda" or x not in DEVICE_ONLY]
    args.points = list(dict.fromkeys(x for x in (args.points or ",".join(default)).split(",") if x))
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
    ideal = add_ratios(points)
    for line in table(points, ideal):
        say(line)
    points = [{k: point.get(k) for k in FIRST_KEYS} | point for point in points]
    result = {
        "bench": "sync_in_loop",
        "device": args.device,
        "dtype": args.dtype,
        "shape": "example" if args.quick else args.shape,
        "params": params,
        "ideal_s": ideal,
        "steps": args.steps,
        "batch_size": cfg.trainer.batch_size,
        "warmup_steps": WARMUP_STEPS,
        "points": points,
    }
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return 0 if all(p["exit_code"] == 0 and not p["timed_out"] for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
