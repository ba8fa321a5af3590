"""Watching ``streamrft`` processes from a test: waiting on them, their logs, leftovers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll ``ready()`` until true; fail with the process's stderr (where piped) if it ends
    first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, _ended(proc)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _ended(proc: subprocess.Popen) -> str:
    err = proc.communicate()[1]
    said = f": {err[-3000:]}" if err else ""
    return f"{proc.args[:4]} ended with {proc.returncode} first{said}"


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


def child_pid(run_id: str, role: str, name: str | None = None) -> int | None:
    """Pid of a live ``streamrft ROLE`` process of run ``run_id`` (``role``: train, explore,
    feed), whose command line also holds ``name`` where given (``"--index 0"``)."""
    for pid in processes_mentioning(run_id):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(args).decode(errors="replace")
        if "streamrft.app.cli" not in text:
            continue
        if role in [a.decode(errors="replace") for a in args] and (name is None or name in text):
            return pid
    return None


def kill_run(run_id: str) -> None:
    """SIGKILL every live process of run ``run_id`` until none is left: a test's clean-up
    after a failure (killing ``streamrft run`` alone leaves its children running)."""
    while pids := processes_mentioning(run_id):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@contextlib.contextmanager
def frozen(pid: int | None) -> Iterator[None]:
    """The process ``pid`` (:func:`child_pid`'s answer) stopped (SIGSTOP) for the block and
    continued after it, also when the block fails: a test holds a run at a state while
    something slow (a process started by hand, loading its model on a busy machine)
    catches up, instead of racing the run."""
    assert pid is not None, "the process to hold was not found"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


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
