"""The shared-memory version files a trainer that is gone left (``sync/shm_files.py``
``remove_leftovers``): removed by the next trainer of any run, ``streamrft run`` or
``streamrft infra clean``, by the pid in their names, checked across pid reuse; a file
whose trainer runs is never touched.

Real files and real processes: a pid that ended (reaped), a process that runs, and a live
process on a pid whose file was last written before it started (pid reuse).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrft.app.cli import main
from streamrft.infra.pids import PID_REUSE_SLACK_S, pid_alive, writer_gone
from streamrft.sync.shm_files import SHM_DIR, file_prefix, remove_leftovers

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert not pid_alive(proc.pid)
    return proc.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A process that runs for the test's length, started before any file of it."""
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(30)


def _write(folder: Path, run: str, pid: int, slot: str, age_s: float = 0.0) -> str:
    name = f"{file_prefix(run)}{pid}-{slot}"
    (folder / name).write_bytes(b"w" * 4096)
    if age_s:  # last written that long ago
        then = time.time() - age_s
        os.utime(folder / name, (then, then))
    return name


def test_files_of_gone_trainers_of_any_run_go_and_a_running_ones_stay(tmp_path, live_pid):
    dead = _dead_pid()
    gone = [
        _write(tmp_path, "run-a", dead, "0"),
        _write(tmp_path, "run-a", dead, "1"),
        _write(tmp_path, "other-run-7", dead, "base"),  # another run's: any run
        _write(tmp_path, "run-a", os.getpid(), "base"),  # the caller's own: written anew
    ]
    running = [
        _write(tmp_path, "run-a", live_pid, "0"),  # this run's, but its trainer runs
        _write(tmp_path, "run-b", live_pid, "1"),
        _write(tmp_path, "run-b", os.getpid(), "0"),  # this process's, of another run
    ]
    not_versions = ["streamrft-run-a-x1-0", f"streamrft-run-a-{dead}-2", f"other-{dead}-0"]
    for name in not_versions:
        (tmp_path / name).write_bytes(b"?")

    removed = remove_leftovers("run-a", str(tmp_path))

    assert sorted(removed) == sorted(gone)
    assert sorted(os.listdir(tmp_path)) == sorted(running + not_versions)


def test_a_pid_now_another_process_s_counts_as_gone(tmp_path, live_pid):
    # the file was last written an hour ago; the process on its pid started seconds ago:
    # it cannot be the writer (a pid is reused only once its process ended)
    reused = _write(tmp_path, "run-a", live_pid, "0", age_s=3600)
    # written just before or after that process started: it may be the writer, kept
    fresh = _write(tmp_path, "run-a", live_pid, "1")
    recent = _write(tmp_path, "run-a", live_pid, "base", age_s=PID_REUSE_SLACK_S / 2)
    assert remove_leftovers("", str(tmp_path)) == [reused]
    assert sorted(os.listdir(tmp_path)) == sorted([fresh, recent])
    assert writer_gone(live_pid, time.time() - 3600)
    assert not writer_gone(live_pid, time.time())
    assert not writer_gone(os.getpid(), time.time())


def test_streamrft_infra_clean_removes_what_gone_trainers_left_in_dev_shm(capsys, live_pid):
    if not os.path.isdir(SHM_DIR):
        pytest.skip(f"no {SHM_DIR} on this host")
    run = f"clean-{uuid.uuid4().hex[:8]}"
    folder = Path(SHM_DIR)
    dead = _write(folder, run, _dead_pid(), "0")
    kept = _write(folder, run, live_pid, "1")
    try:
        assert main(["infra", "clean"]) == 0
        removed = json.loads(capsys.readouterr().out)["removed"]
        assert dead in removed and kept not in removed
        assert not (folder / dead).exists() and (folder / kept).exists()
    finally:
        for name in (dead, kept):
            (folder / name).unlink(missing_ok=True)


WRITER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)  # kept, as a trainer keeps its version files mapped
os.close(fd)
m[:1] = b"v"
print("mapped", flush=True)
sys.stdin.readline()
"""


def test_a_file_a_live_process_writes_stays_whatever_pid_its_name_holds(tmp_path):
    """A trainer in another pid namespace that shares ``/dev/shm`` (containers with
    ``--ipc=host``) names its files by a pid that here is no process, or another: the
    file is kept while a process holds it open for writing (its mapping), and goes once
    that process is gone."""
    name = f"{file_prefix('run-c')}{_dead_pid()}-0"  # its writer's pid in its own namespace
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / name)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().strip() == "mapped"
        assert remove_leftovers("", str(tmp_path)) == []
        assert (tmp_path / name).exists()
    finally:
        writer.communicate("\n", timeout=30)
    assert remove_leftovers("", str(tmp_path)) == [name]  # its writer gone: removed
