"""Child processes of the local services: start, identify, watch and stop them.

A service runs as a child process (its own session, its output appended to a log file) and
is known by pid plus start time, so that a recorded pid that the system has since handed to
another process is never signalled (see :func:`pid_is`). In-process children also get
``PR_SET_PDEATHSIG`` on Linux, so the kernel stops them when their parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from streamrft.infra.logfiles import log_tail
from streamrft.infra.pids import pid_alive, pid_is, proc_start_time
from streamrft.schemas.errors import ServiceError

STOP_GRACE_S = 5.0
"""How long a stopped service may take to exit after SIGTERM before it gets SIGKILL."""


def terminate_pid(pid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns when the process is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def die_with_parent_fn() -> Any:
    """A ``preexec_fn`` that has Linux send SIGTERM to the child when its parent dies.

    Only used when starting from the main thread: the death signal fires when the *thread*
    that forked exits, so a child started from a short-lived worker thread would be
    killed early.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    sigterm = int(signal.SIGTERM)
    parent = os.getpid()

    def _preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sigterm)

    return _preexec


@dataclass
class Service:
    """One started service: its own child (``popen``), or one known by pid and start time
    (a detached service found in a state file)."""

    name: str
    port: int
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    pid: int = 0
    log_offset: int = 0
    start_time: str | None = None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_is(self.pid, self.start_time)

    def tail(self) -> str:
        """Its log since this start."""
        return log_tail(self.log, self.log_offset)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`; a no-op once it is gone."""
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.terminate()
                try:
                    self.popen.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(5.0)
        elif pid_is(self.pid, self.start_time):
            terminate_pid(self.pid)


def log_header(fh: BinaryIO, argv: list[str]) -> int:
    """Append a line naming the command about to run to an open log file; returns the
    offset where the command's own output starts (for :func:`log_tail`)."""
    offset = fh.tell()
    fh.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
    fh.flush()
    return offset


def spawn(
    name: str, port: int, argv: list[str], log: Path, env: dict[str, str], *, detached: bool
) -> Service:
    """Start ``argv`` as service ``name`` (listening on ``port``), its output appended to
    ``log``. ``detached``: no death signal, the child may outlive this process."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**env, "NO_COLOR": "1"}  # no ANSI escapes in the log files
    with log.open("ab") as fh:
        offset = log_header(fh, argv)
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
                preexec_fn=None if detached else die_with_parent_fn(),
            )
        except OSError as e:
            raise ServiceError(f"could not start the {name}: {e}") from e
    return Service(
        name=name,
        port=port,
        argv=argv,
        log=log,
        popen=popen,
        pid=popen.pid,
        log_offset=offset,
        start_time=proc_start_time(popen.pid),
    )
