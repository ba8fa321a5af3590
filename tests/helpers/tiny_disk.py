"""A disk of a few pages for tests of a full or read-only disk: the kernel's own ENOSPC and
EROFS, not an error raised by the test.

A tmpfs mounted in the mount namespace of a helper process (``unshare --user
--map-root-user --mount``: no root needed where the kernel allows user namespaces) and
reached from the test through ``/proc/<helper pid>/root``, so nothing is mounted on the
host. :func:`tiny_disk` skips the test on a host where that is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# the helper: mount, then do what each line of its stdin says, answering each with a line
SCRIPT = """
mount -t tmpfs -o "size=$1" tmpfs "$0" || exit 1
echo ready
while read -r what; do
  case "$what" in
    ro) mount -o remount,ro "$0" && echo ok || echo failed ;;
    rw) mount -o remount,rw "$0" && echo ok || echo failed ;;
    *) echo failed ;;
  esac
done
"""


class TinyDisk:
    """The helper process and the folder its tmpfs is, as this process sees it."""

    def __init__(self, proc: subprocess.Popen, mountpoint: Path) -> None:
        self.proc = proc
        self.path = Path(f"/proc/{proc.pid}/root") / mountpoint.relative_to("/")
        """The tmpfs (only through this path: the host sees an empty folder)."""
        self.filler = self.path / ".filler"

    def fill(self) -> int:
        """Write a file until the disk refuses it (ENOSPC); the bytes it took."""
        written = 0
        with open(self.filler, "ab", buffering=0) as f:
            try:
                while True:
                    written += f.write(b"\0" * 4096)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        return written

    def free(self) -> None:
        """Delete what :meth:`fill` wrote."""
        self.filler.unlink()

    def read_only(self, on: bool = True) -> None:
        """Remount read-only (``on``) or writable again."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"ro\n" if on else b"rw\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer == b"ok", f"remount {'ro' if on else 'rw'}: {answer!r}"


@contextlib.contextmanager
def tiny_disk(where: Path, size: int = 64 << 10) -> Iterator[TinyDisk]:
    """A tmpfs of ``size`` bytes on the empty folder ``where`` (made), for the test's
    length; the test is skipped where this host cannot make one."""
    unshare = shutil.which("unshare")
    if unshare is None or not Path("/proc/self/ns/mnt").exists():
        pytest.skip("no unshare(1) / mount namespaces here: a tiny disk needs them")
    where.mkdir(parents=True, exist_ok=True)
    argv = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", SCRIPT]
    proc = subprocess.Popen(
        [*argv, str(where), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            proc.wait(30)
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            pytest.skip(f"cannot mount a tmpfs in a user namespace here: {err.strip()}")
        disk = TinyDisk(proc, where)
        assert os.statvfs(disk.path).f_blocks * os.statvfs(disk.path).f_frsize <= size
        yield disk
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
