"""Soak: the default example for many steps, a new version after every step; does anything
we own grow with the run?

    python bench/soak.py [--steps 2000] [--marks 500,1000,2000] [--dir DIR]

Runs ``streamrft run examples/arithmetic.yaml`` (embedded broker and object store, one
explorer, ``sync_interval: 1``, enough task epochs) and at each mark (a trainer step)
records: the RSS of the trainer, the explorer, the supervisor and the broker; the
checkpoints folder and the run's objects in the store (bytes; the complete checkpoints and
weight versions there and the size of one; the bytes on their way: a checkpoint being
written, staged for its upload or set aside, a version or a checkpoint half written or half
deleted in the store), the logs and ``metrics.jsonl``. At the end, from the run's own
files: the supervisor's ledger window and the trainer's view of versions (its final
counters). Prints a table, then one JSON line with every mark and the ratio of each figure
between the last two marks (the goal: within 1.10 for what we own once every bounded
structure has filled; the broker on ``memory`` storage keeps every record and is reported,
not bounded).

RSS and sizes are what this machine measured; they depend on the model (here the tiny
one) and the allocator, so compare ratios, not absolute numbers, across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def _files(path: Path) -> dict[tuple[int, int], int]:
    """Bytes of each file under ``path`` by (device, inode): a file linked twice (a
    checkpoint staged for its upload) counts once; one deleted while it is counted (the run
    goes on) not at all."""
    found = {}
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            found[st.st_dev, st.st_ino] = st.st_size
    return found


def folder_bytes(path: Path) -> int:
    return sum(_files(path).values())


def checkpoint_usage(root: Path) -> dict:
    """The checkpoints folder: its bytes, the complete checkpoints in it (``step_N`` with
    its ``state.json``) and the largest one's bytes, and the bytes in none of them (on their
    way: a checkpoint being written, one staged for its upload after it was pruned, one set
    aside)."""
    complete: dict[tuple[int, int], int] = {}
    sizes = []
    for folder in root.glob("step_*"):
        if re.fullmatch(r"step_\d+", folder.name) and (folder / "state.json").is_file():
            files = _files(folder)
            sizes.append(sum(files.values()))
            complete |= files
    inside = {
        key: size for sub in root.glob("*") if sub.is_dir() for key, size in _files(sub).items()
    }
    return {
        "checkpoints_mb": round(folder_bytes(root) / 2**20, 2),
        "checkpoints_kept": len(sizes),
        "checkpoint_mb": round(max(sizes, default=0) / 2**20, 2),
        "checkpoints_on_way_mb": round(
            sum(size for key, size in inside.items() if key not in complete) / 2**20, 2
        ),
    }


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


def store_usage(run_dir: Path, run_id: str) -> dict:
    """The run's objects in the embedded store: their bytes; the weight versions
    (``<run>/vN/``) and checkpoints (``<run>/checkpoints/step_N/``) complete there (a folder
    with its manifest: the gateway lists a deleted one's empty folder) and the largest one
    of each; the bytes of the folders without a manifest (on their way: written before
    their manifest, deleted after it)."""
    from minio import Minio

    eps = json.loads((run_dir / "services" / "services.json").read_text())["endpoints"]
    client = Minio(eps["s3_endpoint"], eps["access_key"], eps["secret_key"], secure=False)
    total = 0
    folders: dict[tuple[str, str], list] = {}  # (kind, folder) -> [bytes, has its manifest]
    for bucket in client.list_buckets():
        for obj in client.list_objects(bucket.name, prefix=f"{run_id}/", recursive=True):
            total += obj.size or 0
            parts = obj.object_name.split("/")
            if len(parts) > 3 and parts[1] == "checkpoints":
                folder = ("checkpoint", "/".join(parts[:3]))
            elif len(parts) > 2 and re.fullmatch(r"v\d+", parts[1]):
                folder = ("version", "/".join(parts[:2]))
            else:
                continue  # the run's record
            entry = folders.setdefault(folder, [0, False])
            entry[0] += obj.size or 0
            entry[1] = entry[1] or parts[-1] == "manifest.json"

    def complete(kind: str) -> list[int]:
        return [size for (k, _), (size, done) in folders.items() if k == kind and done]

    versions, checkpoints = complete("version"), complete("checkpoint")
    on_way = sum(size for size, done in folders.values() if not done)
    return {
        "store_mb": round(total / 2**20, 2),
        "store_versions": len(versions),
        "store_checkpoints": len(checkpoints),
        "store_version_mb": round(max(versions, default=0) / 2**20, 2),
        "store_checkpoint_mb": round(max(checkpoints, default=0) / 2**20, 2),
        "store_on_way_mb": round(on_way / 2**20, 2),
    }


def broker_pid(run_dir: Path) -> int | None:
    try:
        state = json.loads((run_dir / "services" / "services.json").read_text())
        return int(state["services"]["broker"]["pid"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def measure(run_dir: Path, run_id: str, supervisor: int, step: int) -> dict:
    return {
        "step": step,
        "rss_trainer_mb": rss_mb(pid_of(("train",), run_id)),
        "rss_explorer_mb": rss_mb(pid_of(("explore", "0"), run_id)),
        "rss_supervisor_mb": rss_mb(supervisor),
        "rss_broker_mb": rss_mb(broker_pid(run_dir)),
        **checkpoint_usage(run_dir / "checkpoints"),
        **store_usage(run_dir, run_id),
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
