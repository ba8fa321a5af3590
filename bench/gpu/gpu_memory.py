"""Samples the GPU's memory while other processes run: the whole device's used memory and,
per compute process nvidia-smi lists, its used memory, named by its command line.

    python bench/gpu/gpu_memory.py OUT.json [--every 0.5]

Runs until killed; OUT.json is rewritten after every sample with the peaks so far
(MiB, as nvidia-smi reports: the CUDA context and the caching allocator's reserve
included, unlike torch's ``max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path


def _query(*args: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def _name(pid: str) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid} (not in this namespace)"
    words = [a.decode(errors="replace") for a in argv if a]
    return " ".join(words)[:160]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--every", type=float, default=0.5)
    args = p.parse_args()
    peaks: dict[str, int] = {}
    device_peak, started = 0, time.time()
    while True:
        for row in _query("--query-gpu=memory.used"):
            device_peak = max(device_peak, int(row[0]))
        for row in _query("--query-compute-apps=pid,used_memory"):
            if len(row) == 2 and row[1].isdigit():
                pid, used = row
                key = f"{pid} {_name(pid)}"
                peaks[key] = max(peaks.get(key, 0), int(used))
        Path(args.out).write_text(
            json.dumps(
                {
                    "device_used_peak_mib": device_peak,
                    "processes_peak_mib": peaks,
                    "seconds": round(time.time() - started),
                },
                indent=1,
            )
        )
        time.sleep(args.every)


if __name__ == "__main__":
    main()
