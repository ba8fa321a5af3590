"""Partial rollouts bench: long multi-turn episodes with and without
``explorer.partial_rollout``, under ``fully_async``.

    python bench/partial_rollout.py [--quick] [--steps 20] [--seeds 0,1] [--turns 4]
                                    [--simulated-steps 12] [--seconds-per-token 0.0015]

Each run is the real ``streamrft run`` of ``examples/arithmetic.yaml`` on its own local
services (Tansu broker, JuiceFS S3 gateway) with one explorer, ``synchronizer.style:
fully_async``, ``trainer.max_staleness: 4``, the ``multi_turn`` workflow on addition tasks
whose conversation asks ``--turns - 1`` more times (``--turns`` policy turns per episode;
the reward: the last turn's answer), once with ``explorer.partial_rollout: false`` (the
baseline) and once with ``true``:

- **tiny**, per seed: the example's tiny model (its SFT warm-up), ``--steps`` trainer steps.
- **simulated**: ``explorer.engine=simulated`` (a sleep per token: slow turns whatever the
  CPU), ``--simulated-steps`` steps, no warm-up or evaluation.

Figures per run: ``step_s`` (median interval between trainer steps), ``explorer_idle``
(1 - the explorer's rollout seconds over the span of the trainer's steps), ``wait_s``
(median ``train/wait_seconds``: the trainer waiting for experiences),
``reward_first5`` / ``reward_last5``, ``staleness_mean`` (``train/staleness_mean``: groups
counted by their oldest segment), ``token_lag`` (per trained policy token: the version the
trainer held when it trained the token's group minus the version that sampled the token),
``partial_share`` (experiences sampled by more than one version) and
``versions_mid_step`` (versions the explorer applied between two turns).

``ratios``: the partial run's ``step_s`` and ``token_lag`` over the baseline's and its
reward minus the baseline's, per kind and seed. A figure, not a test: nothing is asserted.
Human-readable lines first, then one JSON line on stdout; progress on stderr. Absolute
times are of the machine it runs on (the docs name it).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale_explorers import _endpoint_settings, run_to_end  # bench/, beside us
from sync_styles import ab_parser, figures, report, run_points  # bench/, beside us

from streamrft.infra.config import load_config, with_run_id
from streamrft.infra.consume import read_history
from streamrft.infra.local.services import LocalServices
from streamrft.schemas import EXPERIENCE_GROUP, METRICS, STATUS
from tests.helpers.cli import run_argv
from tests.helpers.paths import EXAMPLE

RUN_TIMEOUT_S = 900.0
MODES = (False, True)


def write_tasks(path: Path, turns: int) -> None:
    """Addition tasks (0..9 + 0..9) whose user asks ``turns - 1`` more times."""
    asks = ["Sure?", "Again?", "Once more?", "Final answer?"]
    follow = [asks[i % len(asks)] for i in range(turns - 1)]
    with path.open("w") as f:
        for a in range(10):
            for b in range(10):
                row = {"id": f"add-{a}-{b}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
                f.write(json.dumps({**row, "turns": follow}) + "\n")


def settings(partial: bool, kind: str, seed: int, tasks: Path, cost: float) -> list[str]:
    common = [
        "synchronizer.style=fully_async",
        "synchronizer.sync_interval=1",
        "trainer.max_staleness=4",
        "trainer.save_interval=0",
        f"run.seed={seed}",
        f"model.seed={seed}",
        f"taskset.path={tasks}",
        "taskset.workflow=multi_turn",
        f"explorer.partial_rollout={str(partial).lower()}",
        "explorer.max_new_tokens=6",
    ]
    if kind == "simulated":
        return [
            *common,
            "explorer.engine=simulated",
            f"explorer.simulated_seconds_per_token={cost}",
            "trainer.warmup_sft_steps=0",
            "eval.interval=0",
        ]
    return [*common, "eval.interval=0"]


async def read_back(cfg) -> tuple[list, list, list]:
    topics = cfg.topics()
    metrics = await read_history(cfg.kafka, topics.metrics, METRICS, "partial-bench")
    status = await read_history(cfg.kafka, topics.status, STATUS, "partial-bench")
    groups = await read_history(cfg.kafka, topics.experiences, EXPERIENCE_GROUP, "partial-bench")
    return metrics, status, groups


def token_figures(groups: list, metrics: list) -> dict:
    """``token_lag`` and ``partial_share`` of the groups the trainer trained."""
    trained_at: dict[str, int] = {}
    for ev in metrics:
        if ev.component == "trainer":
            for row in ev.trained:
                trained_at.setdefault(row.group_id, ev.step - 1)  # the version it held
    lags: list[int] = []
    partial = total = 0
    for g in groups:
        held = trained_at.get(g.id)
        if held is None:
            continue
        for e in g.experiences:
            total += 1
            partial += bool(e.segments)
            mask = e.action_mask
            bounds = [(s.start, s.version) for s in e.segments] or [(0, e.model_version)]
            for (start, version), (end, _) in zip(
                bounds, [*bounds[1:], (len(mask), 0)], strict=True
            ):
                lags += [held - version] * sum(mask[start:end])
    return {
        "token_lag": round(statistics.fmean(lags), 3) if lags else None,
        "partial_share": round(partial / total, 3) if total else None,
    }


def run_point(partial: bool, kind: str, seed: int, args, workdir: Path, tasks: Path) -> dict:
    mode = "partial" if partial else "whole"
    folder = workdir / f"{kind}-{mode}-{seed}"
    runs = folder / "runs"
    run_id = f"partial-{kind}-{mode}-{seed}-{os.getpid()}"
    steps = args.simulated_steps if kind == "simulated" else args.steps
    extra = settings(partial, kind, seed, tasks, args.seconds_per_token)
    with LocalServices(folder / "services") as services:
        eps = services.endpoints
        argv = run_argv(EXAMPLE, run_id, steps, runs, eps, *extra, explorers=1)
        proc, finished = run_to_end(
            argv, folder, runs, RUN_TIMEOUT_S, lambda s: f"{kind} {mode} seed {seed}: {s:.0f} s"
        )
        cfg = load_config(EXAMPLE, [*extra, *_endpoint_settings(eps)])
        metrics, status, groups = asyncio.run(read_back(with_run_id(cfg, run_id)))
    base = figures(metrics, 1)
    mid = [s.counters.get("versions_applied_mid_step", 0) for s in status]
    busy = base.pop("explorer_busy")
    return {
        "kind": kind,
        "partial": partial,
        "seed": seed,
        **{k: v for k, v in base.items() if k not in ("eval_last", "wall_s")},
        "explorer_idle": round(1 - busy, 3) if busy is not None else None,
        **token_figures(groups, metrics),
        "versions_mid_step": int(max(mid, default=0)),
        "exit_code": proc.returncode,
        "timed_out": not finished,
    }


def compare(points: list[dict]) -> list[dict]:
    out = []
    by = {(p["kind"], p["seed"], p["partial"]): p for p in points}
    for (kind, seed, partial), whole in by.items():
        if partial or (kind, seed, True) not in by:
            continue
        part = by[(kind, seed, True)]
        row: dict = {"kind": kind, "seed": seed}
        for key in ("step_s", "token_lag"):
            if whole.get(key) and part.get(key) is not None:
                row[f"{key}_ratio"] = round(part[key] / whole[key], 3)
        for key in ("reward_last5", "explorer_idle"):
            if whole.get(key) is not None and part.get(key) is not None:
                row[f"{key}_diff"] = round(part[key] - whole[key], 4)
        out.append(row)
    return out


def main() -> int:
    parser = ab_parser(__doc__, 20, 12, 0.0015, "seed 0, 8 + 6 steps")
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.simulated_steps, args.seeds = 8, 6, "0"
    seeds = [int(s) for s in args.seeds.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="partial-bench-"))
    tasks = workdir / "turns.jsonl"
    write_tasks(tasks, args.turns)
    try:
        points = run_points(
            args.kinds.split(","),
            seeds,
            MODES,
            lambda partial, kind, seed: run_point(partial, kind, seed, args, workdir, tasks),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report("partial_rollout", points, compare(points), "partial vs whole", turns=args.turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
