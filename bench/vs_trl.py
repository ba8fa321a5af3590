"""streamrft against TRL's GRPOTrainer: the same model, tasks and GRPO settings, one machine, one run.

    python bench/vs_trl.py [--quick] [--seeds 0,1,2] [--steps 80] [--eval-interval 5]
                           [--arms trl,fixed-1,fixed-2,async-1,async-2] [--device cpu|cuda]
                           [--check-step] [--crash [--save-every 10] [--crash-at 15]]
                           [--trl-threads N] [--keep]

Needs TRL 1.16.0, the ``bench`` extra (``pip install -e '.[bench]'`` or ``make
bench-trl-setup``); without it the bench says so and exits 2.

Per seed both sides start from one folder: the default example's tiny model
(``examples/arithmetic.yaml``) after the example's supervised warm-up, saved as a Hugging
Face folder (``vs_trl_setup.warm_folder``), and read one config file: the example with that
folder as its model, ``--steps`` trainer steps and an evaluation every ``--eval-interval``
steps (``vs_trl_setup.write_config``). The TRL options that config maps to are printed
first, with why each matches. Then, before any timing, one step of both on the same batch
(``vs_trl_check.check_step``): the same log-probs, advantages (up to TRL's documented
epsilon), loss and update, or the bench stops (``--check-step``: that check alone).

Arms, alternating within each seed:

- ``trl``: TRL's ``GRPOTrainer`` in its own process (``bench/vs_trl_arm.py``);
- ``fixed-N``, ``async-N``: ``streamrft run`` with N explorers and
  ``synchronizer.style`` ``fixed`` (one-step-off, ``trainer.max_staleness`` 1, the
  example's) or ``fully_async`` (``max_staleness`` 2).

Both evaluate with the same code (the streamrft trainer's ``GreedyEvaluator``: greedy
answers to the 100 tasks, exact match) at the start, every ``--eval-interval`` steps and at
the end, inside the training loop. Per arm (``bench/vs_trl_runs.py`` measures): ``t90_s``
and ``t95_s`` (launch of the command to the first evaluation at or above 0.9 / 0.95),
``ready_s`` (launch to the first evaluation, before any step), ``first_step_s`` (launch
to the first trainer step), ``acc_at_equal_wall`` (the last
evaluation within ``equal_wall_s``, the seed's shortest arm's last evaluation),
``steps_per_s`` and ``tokens_per_s`` (trainer steps and completion tokens trained, first
step to last), ``wall_s``, ``peak_rss_mb`` / ``peak_pss_mb`` (summed over the arm's
processes), ``cpu_s`` and ``cpu_s_by_process`` (by command: ``run`` the supervisor,
``feed``, ``explore``, ``train``, ``tansu`` the broker, ``juicefs`` the object store;
``trl``), ``processes``. ``ratios``: each streamrft arm over TRL of the same
seed (below 1: less time or memory; ``steps_per_s`` and ``tokens_per_s`` above 1: faster);
``summary``: their medians over the seeds.

``--crash``: per seed, TRL and ``fixed-1`` with a checkpoint every ``--save-every`` steps
(TRL ``save_steps``), each run once whole and once with a SIGKILL after step
``--crash-at`` (streamrft: the trainer, restarted by ``streamrft run`` itself; TRL: the
process, started again with ``resume_from_checkpoint``): ``steps_redone``,
``rollouts_regenerated`` (batches sampled again), ``rollouts_dropped`` (groups the
restarted streamrft trainer dropped as stale: sampled with versions published after its
checkpoint), ``rollouts_lost`` (both), ``recovery_s`` (kill to the first step past the one
reported before it), ``wall_lost_s`` (last step, against the whole run),
``final_accuracy``.

Threads: each streamrft process takes the config's (``trainer.threads``,
``explorer.threads``: 1), the TRL process torch's default (one per core) unless
``--trl-threads N``. ``--device cuda`` runs both on a GPU (the warm-up stays on the CPU).
``--quick``: seed 0, ``trl`` and ``fixed-1``, 12 steps, TRL on 1 thread (with ``--crash``:
checkpoints every 4, the kill after step 6). A figure, not a test: nothing is asserted but the one-step check. Human-readable
lines, then one JSON line on stdout; progress on stderr.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import contextlib
import json
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sync_styles import report, run_points  # bench/, beside us
from vs_trl_runs import Timeline, run_streamrft, run_trl
from vs_trl_setup import (
    TRL_VERSION,
    check_mappable,
    mapping,
    read_config,
    trl_missing,
    warm_folder,
    write_config,
)

ARMS = ("trl", "fixed-1", "fixed-2", "async-1", "async-2")
QUICK_ARMS = ("trl", "fixed-1")
TARGETS = (0.9, 0.95)
STYLES = {"fixed": "fixed", "async": "fully_async"}


def say(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# -- one seed's folder and config, one arm ------------------------------------------------------
class Seeds:
    """Each seed's warmed folder and config file, made once."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work, self.args = work, args
        self.made: dict[tuple[int, int], Path] = {}

    def config(self, seed: int, save_every: int = 0) -> Path:
        key = (seed, save_every)
        if key not in self.made:
            folder = self.work / f"warm-{seed}"
            if not (folder / "config.json").is_file():
                say(f"seed {seed}: supervised warm-up of the example's model")
                _, losses = warm_folder(seed, folder)
                say(f"seed {seed}: warm-up loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            a = self.args
            path = self.work / f"config-{seed}-{save_every}.yaml"
            self.made[key] = write_config(
                path,
                folder,
                seed,
                a.steps,
                a.eval_interval,
                save_every,
                self.work / "runs",
                a.device,
            )
        return self.made[key]


def run_arm(
    arm: str,
    seed: int,
    config: Path,
    work: Path,
    kill_at: int = 0,
    save_every: int = 0,
    trl_threads: int = 0,
) -> Timeline:
    """One arm's run; its timeline (``trl_threads``: the TRL process's, 0: torch's own)."""
    tag = f"{arm}-{seed}" + (f"-kill{kill_at}" if kill_at else "")
    folder = work / tag
    if arm == "trl":
        return run_trl(config, folder, kill_at, save_every, trl_threads)
    style, n = arm.split("-")
    repeat = read_config(config).explorer.repeat_times
    run_id = f"vs-trl-{tag}-{os.getpid()}"
    return run_streamrft(config, folder, run_id, int(n), STYLES[style], repeat, kill_at, save_every)


# -- figures ---------------------------------------------------------------------------------
def _r(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


def figures(arm: str, seed: int, line: Timeline) -> dict:
    """One arm's figures (module docstring); ``_curve``: (seconds, accuracy) of its
    evaluations, ``_line``: the timeline."""
    t0 = line.t0
    steps = line.steps
    first, last = (steps[0][0], steps[-1][0]) if steps else (None, None)
    span = (last - first) if steps and last > first else None
    trained = sorted({s for _, s in steps})
    tokens = sum(line.step_tokens.get(s, 0) for s in trained[1:])
    out: dict = {"arm": arm, "seed": seed, "steps": len(trained)}
    for target in TARGETS:
        hit = next((t for t, _, acc in line.evals if acc >= target), None)
        out[f"t{round(target * 100)}_s"] = _r(None if hit is None else hit - t0)
    out.update(
        ready_s=_r(line.evals[0][0] - t0 if line.evals else None),
        first_step_s=_r(None if first is None else first - t0),
        acc_start=line.evals[0][2] if line.evals else None,
        acc_final=line.evals[-1][2] if line.evals else None,
        steps_per_s=_r((len(steps) - 1) / span, 3) if span else None,
        tokens_per_s=_r(tokens / span, 1) if span else None,
        wall_s=_r(line.end - t0),
        **line.meter,
        exit_code=line.exit_code,
        timed_out=line.timed_out,
    )
    if arm == "trl":
        out["trl_threads"] = line.summary.get("threads")
    out["_curve"] = [(t - t0, acc) for t, _, acc in line.evals]
    out["_line"] = line
    return out


def equal_wall(points: list[dict]) -> None:
    """Each point's accuracy at its seed's shortest arm's last evaluation (in place): its
    last evaluation by then, or, before its first one, its start's (the folder's model,
    which no step has changed yet)."""
    for seed in {p["seed"] for p in points}:
        same = [p for p in points if p["seed"] == seed and p["_curve"]]
        if not same:
            continue
        limit = min(p["_curve"][-1][0] for p in same)
        for p in same:
            within = [acc for t, acc in p["_curve"] if t <= limit + 1e-6]
            p["equal_wall_s"] = round(limit, 2)
            p["acc_at_equal_wall"] = within[-1] if within else p["acc_start"]


RATIO_KEYS = (
    "t95_s",
    "t90_s",
    "ready_s",
    "first_step_s",
    "wall_s",
    "peak_rss_mb",
    "peak_pss_mb",
    "cpu_s",
)
SPEED_KEYS = ("steps_per_s", "tokens_per_s")


def ratios(points: list[dict]) -> list[dict]:
    """Each streamrft arm over TRL of the same seed."""
    trl = {p["seed"]: p for p in points if p["arm"] == "trl"}
    out = []
    for p in points:
        base = trl.get(p["seed"])
        if p["arm"] == "trl" or base is None:
            continue
        row: dict = {"arm": p["arm"], "seed": p["seed"]}
        for key in (*RATIO_KEYS, *SPEED_KEYS):
            if p.get(key) and base.get(key):
                row[f"{key}_ratio"] = round(p[key] / base[key], 3)
        if p.get("acc_at_equal_wall") is not None and base.get("acc_at_equal_wall") is not None:
            row["acc_at_equal_wall_diff"] = round(
                p["acc_at_equal_wall"] - base["acc_at_equal_wall"], 4
            )
        out.append(row)
    return out


def summary(rows: list[dict]) -> dict:
    """Per arm: the median of each ratio over the seeds; whether the goals hold."""
    out: dict = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        keys = dict.fromkeys(k for r in mine for k in r if k not in ("arm", "seed"))
        out[arm] = {"seeds": len(mine)}
        for key in keys:
            values = [r[key] for r in mine if key in r]
            out[arm][f"{key}_median"] = round(statistics.median(values), 3)
        t95 = [r.get("t95_s_ratio") for r in mine]
        out[arm]["t95_s_ratio_all"] = t95
    # the goals: streamrft's default arm reaches 0.95 sooner than TRL on every seed, and
    # two explorers in at most 0.8 of TRL's time
    goals = (("fixed-1", "lt", 1.0), ("fixed-2", "le", 0.8), ("async-2", "le", 0.8))
    out["goals"] = {
        f"{arm}_t95_s_ratio_{op}_{limit}": None
        if arm not in out
        else all(
            v is not None and (v < limit if op == "lt" else v <= limit)
            for v in out[arm]["t95_s_ratio_all"]
        )
        for arm, op, limit in goals
    }
    return out


# -- a crash ---------------------------------------------------------------------------------
def crash_figures(tool: str, seed: int, killed: Timeline, whole: Timeline, repeat: int) -> dict:
    """What the SIGKILL cost (module docstring), against the same run whole.
    ``rollouts_regenerated``: rollouts of a batch sampled a second time;
    ``rollouts_dropped``: rollouts the restarted trainer consumed and dropped (streamrft's
    stale groups: sampled with a version the killed trainer published after its
    checkpoint); ``rollouts_lost``: both, the sampling work the crash threw away."""
    t_kill, seen = killed.kills[0] if killed.kills else (None, None)
    counts: dict[int, int] = {}
    for _, s in killed.steps:
        counts[s] = counts.get(s, 0) + 1
    made: set[tuple[str, int]] = set()
    regenerated = 0
    for _, who, batch, rollouts in killed.gens:
        if (who, batch) in made:
            regenerated += rollouts
        made.add((who, batch))
    dropped = (
        killed.summary.get("stale_dropped", 0) - whole.summary.get("stale_dropped", 0)
    ) * repeat
    back = next((t for t, s in killed.steps if t_kill and t > t_kill and s > seen), None)
    last_killed = killed.steps[-1][0] - killed.t0 if killed.steps else None
    last_whole = whole.steps[-1][0] - whole.t0 if whole.steps else None
    return {
        "tool": tool,
        "seed": seed,
        "killed_after_step": seen,
        "steps_redone": sum(n - 1 for n in counts.values()),
        "rollouts_regenerated": regenerated,
        "rollouts_dropped": dropped,
        "rollouts_lost": regenerated + dropped,
        "rollouts_generated": sum(g[3] for g in killed.gens),
        "rollouts_generated_whole": sum(g[3] for g in whole.gens),
        "recovery_s": _r(None if back is None else back - t_kill),
        "wall_lost_s": _r(
            None if last_killed is None or last_whole is None else last_killed - last_whole
        ),
        "final_accuracy": killed.evals[-1][2] if killed.evals else None,
        "final_accuracy_whole": whole.evals[-1][2] if whole.evals else None,
        "steps": len(counts),
        "restarts": len(killed.kills)
        if tool == "trl"
        else killed.summary.get("restarts", {}).get("trainer", 0),
        "exit_code": killed.exit_code,
        "peak_rss_mb": killed.meter.get("peak_rss_mb"),
        "cpu_s": killed.meter.get("cpu_s"),
    }


def crash_runs(seeds: list[int], args, made: Seeds, work: Path) -> tuple[list[dict], list[dict]]:
    points = []
    for seed in seeds:
        config = made.config(seed, args.save_every)
        for arm in ("trl", "fixed-1"):
            say(f"crash: {arm} seed {seed}, whole then killed after step {args.crash_at}")
            whole = run_arm(arm, seed, config, work, 0, args.save_every, args.trl_threads)
            killed = run_arm(
                arm, seed, config, work, args.crash_at, args.save_every, args.trl_threads
            )
            repeat = read_config(config).explorer.repeat_times
            points.append(crash_figures(arm, seed, killed, whole, repeat))
    rows = []
    for p in points:
        base = next((q for q in points if q["tool"] == "trl" and q["seed"] == p["seed"]), None)
        if p["tool"] == "trl" or base is None:
            continue
        row = {"arm": p["tool"], "seed": p["seed"]}
        for key in ("recovery_s", "wall_lost_s", "rollouts_lost", "steps_redone"):
            row[f"{key}_streamrft"], row[f"{key}_trl"] = p[key], base[key]
        if p["wall_lost_s"] and base["wall_lost_s"]:
            row["wall_lost_ratio"] = round(p["wall_lost_s"] / base["wall_lost_s"], 3)
        rows.append(row)
    return points, rows


# -- the command -----------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seed 0, trl and fixed-1, 12 steps")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=80, help="trainer steps per arm")
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--check-step", action="store_true", help="the one-step check alone")
    p.add_argument("--crash", action="store_true", help="what a SIGKILL costs each")
    p.add_argument("--save-every", type=int, default=10, help="--crash: steps between checkpoints")
    p.add_argument("--crash-at", type=int, default=15, help="--crash: the kill after this step")
    p.add_argument(
        "--trl-threads",
        type=int,
        help="torch threads of the TRL process (default: torch's own, one per core; --quick: 1)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    args = p.parse_args(argv)
    if args.trl_threads is None:
        args.trl_threads = 1 if args.quick else 0
    if args.quick:
        args.seeds, args.steps, args.eval_interval = "0", 12, 4
        args.arms = ",".join(QUICK_ARMS)
        args.save_every, args.crash_at = 4, 6
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown or "trl" not in args.arms.split(","):
        p.error(f"--arms: trl and any of {', '.join(ARMS[1:])}")
    if args.crash and not 0 < args.save_every < args.crash_at < args.steps:
        p.error("--crash: 0 < --save-every < --crash-at < --steps")
    return args


def machine() -> dict:
    cpu = next(
        (
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        ),
        platform.processor(),
    )
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    missing = trl_missing()
    if missing:
        print(f"bench/vs_trl.py: {missing}", file=sys.stderr)
        return 2
    from vs_trl_check import check_failures, check_step  # imports trl

    seeds = [int(s) for s in args.seeds.split(",")]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up as Ctrl-C
    work = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    say(f"work folder {work}")
    made = Seeds(work, args)
    started, at_start = time.monotonic(), machine()
    try:
        config = made.config(seeds[0])
        cfg = read_config(config)
        check_mappable(cfg)
        rows = mapping(cfg, args.trl_threads)
        print("streamrft setting -> TRL option (why they match):")
        for ours, theirs, why in rows:
            print(f"  {ours:45s} -> {theirs}" + (f"  ({why})" if why else ""))
        say("one step of both on the same batch")
        with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs: stdout is ours
            check = check_step(config, work / "check")
        failures = check_failures(check)
        print("check_step: " + json.dumps(check))
        extra = {
            "trl": TRL_VERSION,
            "device": args.device,
            "steps": args.steps,
            "eval_interval": args.eval_interval,
            "machine": at_start,
            "check_step": check,
            "check_failures": failures,
            "mapping": [list(r) for r in rows],
        }
        if failures:
            print("the one-step check failed: " + "; ".join(failures), file=sys.stderr)
        if args.check_step or failures:
            print(json.dumps({"bench": "vs_trl", "mode": "check_step", **extra}))
            return 1 if failures else 0
        if args.crash:
            points, rows_out = crash_runs(seeds, args, made, work)
            versus = "streamrft vs TRL after a SIGKILL"
            extra["save_every"], extra["crash_at"] = args.save_every, args.crash_at
        else:
            arms = tuple(args.arms.split(","))
            points = run_points(
                ["tiny"],
                seeds,
                arms,
                lambda arm, _kind, seed: figures(
                    arm,
                    seed,
                    run_arm(arm, seed, made.config(seed), work, trl_threads=args.trl_threads),
                ),
            )
            equal_wall(points)
            rows_out = ratios(points)
            extra["summary"] = summary(rows_out)
            versus = "streamrft / TRL"
        extra["machine_end"] = machine()
        extra["wall_s"] = round(time.monotonic() - started, 1)
        report(
            "vs_trl", points, rows_out, versus, mode="crash" if args.crash else "compare", **extra
        )
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
