"""Whether a process or a port is there: pids checked across reuse (by a recorded start
time, or against the time a file was last changed; a file a process of any pid namespace
holds open for writing by a read lease), ports by a connect. Used by the local
services, the endpoint resolver and the leftover cleanup."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (another user's counts; a zombie counts as dead,
    and our own zombies are reaped)."""
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def proc_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux /proc), or None if unknown.

    Identifies a process across pid reuse. (Its command line is no good for that: JuiceFS
    rewrites its own argv.)
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


def pid_is(pid: int, start_time: str | None) -> bool:
    """Whether ``pid`` is alive and is still the process that started at ``start_time``."""
    if not pid_alive(pid):
        return False
    if start_time is None:
        return True
    current = proc_start_time(pid)
    return current is None or current == start_time


PID_REUSE_SLACK_S = 2.0
"""How much later than a file's last change a process must have started to count as
another process on the pid of the file's writer (clock ticks and mtimes are coarse)."""


def process_age(pid: int) -> float | None:
    """Seconds since ``pid`` started (Linux /proc and the boot clock), or None if unknown."""
    ticks = proc_start_time(pid)
    if ticks is None:
        return None
    return time.clock_gettime(time.CLOCK_BOOTTIME) - int(ticks) / os.sysconf("SC_CLK_TCK")


def writer_gone(pid: int, changed_at: float) -> bool:
    """Whether the process ``pid`` that wrote a file last changed at ``changed_at`` (its
    mtime, Unix time) has ended: no such process (or a zombie), or one that started more
    than :data:`PID_REUSE_SLACK_S` after that change, which the writer cannot be (a pid is
    reused only once its process ended, and the writer changed the file while it ran).
    A live process of unknown age counts as the writer."""
    if not pid_alive(pid):
        return True
    age = process_age(pid)
    return age is not None and age + PID_REUSE_SLACK_S < time.time() - changed_at


def held_for_writing(path: Path) -> bool | None:
    """Whether a process of any pid namespace holds the regular file ``path`` open for
    writing (a descriptor, or a shared mapping made through one): the kernel then refuses
    a read lease on it. None when this cannot tell (not a regular file, another user's
    file, a file system without leases)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return True if exc.errno == errno.EAGAIN else None
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


def port_open(port: int, timeout: float = 0.5, host: str = "127.0.0.1") -> bool:
    """Whether a TCP connect to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
