"""Watching ``streamrft`` processes from a test: waiting on them, their logs, leftovers."""

from __future__ import annotations

import os
import signal
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


def kill_at_step(
    proc: subprocess.Popen,
    log: Path,
    step: int,
    find_pid: Callable[[], int | None],
    finish_s: float,
) -> str:
    """Wait (up to 240 s) for the trainer log ``log`` to show ``step``, SIGKILL the process
    ``find_pid()`` names, let ``proc`` (the run) finish within ``finish_s``; its stderr.
    ``proc`` is killed if the test fails on the way."""
    try:
        wait_for(lambda: log_has(log, f"trainer: step {step} "), proc, 240, f"step {step}")
        pid = find_pid()
        assert pid is not None, "the process to kill was not found"
        os.kill(pid, signal.SIGKILL)
        return proc.communicate(timeout=finish_s)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
