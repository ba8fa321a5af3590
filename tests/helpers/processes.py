"""Watching ``streamrft`` processes from a test: waiting on them, their logs, leftovers."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll ``ready()`` until true; fail with the process's stderr if it ends first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def log_has(path: Path, text: str) -> bool:
    """Whether the file at ``path`` exists and holds ``text``."""
    return path.is_file() and text in path.read_text()


def processes_mentioning(text: str) -> list[int]:
    """Pids of the live processes (not this one) whose command line holds ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids
