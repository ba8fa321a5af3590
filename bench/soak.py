"""Soak: the default example for many steps, a new version after every step; does anything
we own grow with the run?

    python bench/soak.py [--steps 2000] [--marks 500,1000,2000] [--dir DIR]

Runs ``streamrft run examples/arithmetic.yaml`` (embedded broker and object store, one
explorer, ``sync_interval: 1``, enough task epochs) and at each mark (a trainer step)
records: the RSS of the trainer, the explorer, the supervisor and the broker; the
checkpoints folder, the run's objects in the store (bytes and weight versions), the logs
and ``metrics.jsonl``. At the end, from the run's own files: the supervisor's ledger window
and the trainer's view of versions (its final counters). Prints a table, then one JSON
line with every mark and the ratio of each figure between the last two marks (the goal:
within 1.10 for what we own once every bounded structure has filled; the broker on
``memory`` storage keeps every record and is reported, not bounded).

RSS and sizes are what this machine measured; they depend on the model (here the tiny
one) and the allocator, so compare ratios, not absolute numbers, across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic.yaml"
POLL_S = 2.0


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of ``pid`` in MiB (None: not running)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def pid_of(role_args: tuple[str, ...], run_id: str) -> int | None:
    """The live process whose command line holds ``role_args`` and ``run_id``'s config."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        joined = " ".join(words)
        if run_id in joined and all(a in words for a in role_args):
            return int(entry.name)
    return None


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def trainer_step(metrics: Path) -> int:
    """The newest trainer step in ``metrics.jsonl`` (read from its tail)."""
    if not metrics.exists():
        return 0
    with metrics.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - (256 << 10)))
        lines = fh.read().splitlines()[1:]
    step = 0
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("component") == "trainer":
            step = max(step, int(ev.get("step", 0)))
    return step


def store_usage(run_dir: Path, run_id: str) -> tuple[int, int, int]:
    """(bytes, weight versions, checkpoints) of the run's objects in the embedded store: a
    version or a checkpoint (under ``<run>/checkpoints/``) is a folder with its manifest
    (the gateway lists a deleted one's empty folder)."""
    from minio import Minio

    eps = json.loads((run_dir / "services" / "services.json").read_text())["endpoints"]
    client = Minio(eps["s3_endpoint"], eps["access_key"], eps["secret_key"], secure=False)
    total, versions, checkpoints = 0, set(), set()
    for bucket in client.list_buckets():
        for obj in client.list_objects(bucket.name, prefix=f"{run_id}/", recursive=True):
            total += obj.size or 0
            if obj.object_name.endswith("/manifest.json"):
                kept = (
                    checkpoints
                    if obj.object_name.startswith(f"{run_id}/checkpoints/")
                    else versions
                )
                kept.add(obj.object_name)
    return total, len(versions), len(checkpoints)


def broker_pid(run_dir: Path) -> int | None:
    try:
        state = json.loads((run_dir / "services" / "services.json").read_text())
        return int(state["services"]["broker"]["pid"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def measure(run_dir: Path, run_id: str, supervisor: int, step: int) -> dict:
    store_bytes, versions, stored_checkpoints = store_usage(run_dir, run_id)
    return {
        "step": step,
        "rss_trainer_mb": rss_mb(pid_of(("train",), run_id)),
        "rss_explorer_mb": rss_mb(pid_of(("explore", "0"), run_id)),
        "rss_supervisor_mb": rss_mb(supervisor),
        "rss_broker_mb": rss_mb(broker_pid(run_dir)),
        "checkpoints_mb": round(folder_bytes(run_dir / "checkpoints") / 2**20, 2),
        "store_mb": round(store_bytes / 2**20, 2),
        "store_versions": versions,
        "store_checkpoints": stored_checkpoints,
        "logs_mb": round(folder_bytes(run_dir / "logs") / 2**20, 2),
        "metrics_jsonl_mb": round((run_dir / "metrics.jsonl").stat().st_size / 2**20, 2)
        if (run_dir / "metrics.jsonl").exists()
        else 0.0,
    }


def final_counters(run_dir: Path) -> dict:
    """The trainer's final counters and the supervisor's bounded structures, from the run's
    files (``metrics.jsonl``, the summary)."""
    out: dict = {}
    with (run_dir / "metrics.jsonl").open() as fh:
        for line in fh:
            if '"trainer/final_step"' in line:
                values = json.loads(line)["values"]
                out.update({k.split("/", 1)[1]: v for k, v in values.items() if "/view_" in k})
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("ledger_window_steps", "steps_in_ledger", "trained_twice"):
        out[key] = summary["books"][key]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="the last mark")
    ap.add_argument("--marks", default="", help="steps to measure at (default: 1/4, 1/2, all)")
    ap.add_argument("--dir", default="", help="runs folder (default: a temporary one)")
    ap.add_argument("--keep-versions", type=int, default=8)
    ap.add_argument(
        "-o", "--override", action="append", default=[], metavar="KEY=VALUE",
        help="more settings for the run (the CI variant shrinks the bounded structures)",
    )  # fmt: skip
    args = ap.parse_args()
    marks = [int(m) for m in args.marks.split(",") if m] or [
        args.steps // 4,
        args.steps // 2,
        args.steps,
    ]
    runs = Path(args.dir or tempfile.mkdtemp(prefix="soak-"))
    run_id = f"soak-{os.getpid()}"
    run_dir = runs / run_id
    epochs = (args.steps + 20) * 32 // 100 + 10  # 100 tasks a pass, 32 a step
    argv = [
        sys.executable, "-m", "streamrft.app.cli", "run", str(EXAMPLE),
        "--run-id", run_id, "--summary", str(run_dir / "summary.json"), "--no-progress",
        "-o", f"run.dir={runs}",
        "-o", f"trainer.max_steps={args.steps + 20}",  # still running at the last mark
        "-o", f"taskset.total_epochs={epochs}",
        "-o", "eval.interval=0",
        "-o", "synchronizer.sync_interval=1",
        "-o", f"synchronizer.keep_versions={args.keep_versions}",
        "-o", "synchronizer.method=object_store",
        *(arg for setting in args.override for arg in ("-o", setting)),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    runs.mkdir(parents=True, exist_ok=True)
    with (runs / f"{run_id}.console.log").open("wb") as console:
        proc = subprocess.Popen(argv, env=env, stdout=console, stderr=subprocess.STDOUT)
        rows = []
        for mark in marks:
            while proc.poll() is None and trainer_step(run_dir / "metrics.jsonl") < mark:
                time.sleep(POLL_S)
            if proc.poll() is not None:
                break
            rows.append(measure(run_dir, run_id, proc.pid, mark))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        code = proc.wait()
    if code != 0 or len(rows) < len(marks):
        print((runs / f"{run_id}.console.log").read_text()[-3000:], file=sys.stderr)
        print(json.dumps({"bench": "soak", "error": f"run exited {code}", "rows": rows}))
        return 1
    final = final_counters(run_dir)
    a, b = rows[-2], rows[-1]
    ratios = {
        k: round(b[k] / a[k], 3)
        for k in a
        if k != "step" and isinstance(a[k], (int, float)) and a[k] and b[k] is not None
    }
    print(f"{'figure':24} " + " ".join(f"{'step ' + str(r['step']):>12}" for r in rows))
    for k in rows[0]:
        if k != "step":
            print(f"{k:24} " + " ".join(f"{r[k]!s:>12}" for r in rows))
    result = {
        "bench": "soak",
        "steps": args.steps,
        "wall_s": round(time.monotonic() - started, 1),
        "marks": rows,
        "final": final,
        "ratio_last_two_marks": ratios,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
