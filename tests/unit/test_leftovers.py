"""What a long run leaves on disk stays bounded: logs are capped by copy-truncate while a
real process goes on writing them, and the temporary files of killed processes go."""

import subprocess
import sys
import time

from streamrft.infra.logfiles import log_tail, remove_dead_leftovers, rotate, rotate_all
from streamrft.sync.filesystem import FolderStore

WRITER = """
import sys, time
with open(sys.argv[1], "ab", buffering=0) as fh:
    for i in range(400):
        fh.write(b"line %05d %s\\n" % (i, b"x" * 200))
        time.sleep(0.002)
"""


def test_a_log_written_by_a_live_process_is_capped_and_its_lines_go_on_at_the_start(tmp_path):
    path = tmp_path / "explorer-0.log"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    rotations = 0
    while writer.poll() is None:
        rotations += rotate(path, max_bytes=8 << 10, kept=2)
        time.sleep(0.05)
    assert writer.wait() == 0 and rotations >= 3
    rotate(path, max_bytes=8 << 10, kept=2)
    body = path.read_bytes()
    # O_APPEND: the writer's next line after a truncate lands at offset 0, not past a hole
    assert b"\0" not in body and (body == b"" or body.startswith(b"line "))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "explorer-0.log", "explorer-0.log.1", "explorer-0.log.2",
    ]  # fmt: skip
    assert b"line 00399" in body + path.with_name("explorer-0.log.1").read_bytes()
    assert all(p.stat().st_size < 64 << 10 for p in tmp_path.iterdir())


def test_only_logs_past_the_cap_are_rotated(tmp_path):
    (tmp_path / "big.log").write_bytes(b"a" * 2000)
    (tmp_path / "small.log").write_bytes(b"b" * 10)
    (tmp_path / "big.txt").write_bytes(b"c" * 2000)
    assert rotate_all([tmp_path, tmp_path / "absent"], max_bytes=1000) == 1
    assert (tmp_path / "big.log").stat().st_size == 0
    assert (tmp_path / "big.log.1").read_bytes() == b"a" * 2000
    assert (tmp_path / "small.log").read_bytes() == b"b" * 10
    assert not (tmp_path / "big.txt.1").exists()


def test_the_tail_of_a_rotated_log_is_read_from_its_start(tmp_path):
    path = tmp_path / "broker.log"
    path.write_bytes(b"old\n" * 500)
    offset = path.stat().st_size  # a service started here, then its log was rotated
    rotate(path, max_bytes=100)
    with path.open("ab") as fh:
        fh.write(b"fatal: the new error\n")
    assert log_tail(path, offset) == "fatal: the new error"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_dead_processes_go_and_those_of_live_ones_stay(tmp_path):
    import os

    dead, live = _dead_pid(), os.getpid()
    (tmp_path / f"streamrft-vllm-{dead}-abc").mkdir()
    (tmp_path / f"streamrft-vllm-{dead}-abc" / "model.safetensors").write_bytes(b"w")
    (tmp_path / f"streamrft-vllm-{live}-def").mkdir()
    (tmp_path / f"streamrft-vllm-{dead}").write_bytes(b"not the pattern")
    (tmp_path / "other-123-abc").mkdir()
    removed = remove_dead_leftovers(tmp_path, r"streamrft-vllm-(?P<pid>\d+)-\w+")
    assert removed == [f"streamrft-vllm-{dead}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"streamrft-vllm-{live}-def", f"streamrft-vllm-{dead}", "other-123-abc"]
    )


def test_a_folder_store_drops_the_temporary_files_a_killed_trainer_left(tmp_path):
    import os

    store = FolderStore(tmp_path)
    store.put("run/v00000001/manifest.json", b"{}", "application/json")
    left = tmp_path / "run" / "v00000002" / ".shard-0.safetensors.tmp-4242"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"half a shard")
    mine = tmp_path / "run" / "v00000002" / f".shard-1.safetensors.tmp-{os.getpid()}"
    mine.write_bytes(b"being written")
    other_run = tmp_path / "run2" / "v00000001" / ".x.tmp-4242"
    other_run.parent.mkdir(parents=True)
    other_run.write_bytes(b"not this run's")
    assert store.remove_leftovers("run/") == 1
    assert not left.exists() and mine.exists() and other_run.exists()
    assert (tmp_path / "run" / "v00000001" / "manifest.json").read_bytes() == b"{}"
    assert store.remove_leftovers("absent/") == 0
