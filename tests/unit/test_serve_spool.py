"""Serve mode's spool (:mod:`streamrft.producers.serving.spool`): files on disk, bounded in
bytes, read back oldest first, each taken by one process at a time."""

from __future__ import annotations

import errno
import multiprocessing
import os

import pytest

from streamrft.producers.serving.spool import Spool, SpoolFull, decode, encode
from tests.helpers.groups import make_group
from tests.helpers.tiny_disk import tiny_disk

pytestmark = pytest.mark.unit


def _groups(*tasks: str) -> list:
    return [make_group("run", task, version=0) for task in tasks]


def _ids(groups) -> list[str]:
    return [g.id for g in groups]


def test_groups_come_back_as_they_went_in_oldest_file_first(tmp_path):
    spool = Spool(tmp_path / "spool", 1 << 20, "serve-1")
    batches = [_groups("a", "b"), _groups("c"), _groups("d", "e", "f")]
    paths = [spool.put(batch) for batch in batches]
    assert spool.pending() == paths  # names sort in the order written
    got = []
    for path in spool.pending():
        taken = spool.take(path)
        assert taken is not None
        got.append(taken.groups)
        spool.done(taken)
    assert got == batches  # equal structs: every field came back
    assert spool.pending() == [] and spool.size() == 0


def test_the_bound_counts_every_file_and_refuses_what_would_pass_it(tmp_path):
    one = len(encode(_groups("a")))
    spool = Spool(tmp_path / "spool", 3 * one, "serve-1")
    for task in "abc":
        spool.put(_groups(task))
    assert spool.size() == 3 * one
    with pytest.raises(SpoolFull, match=r"serve\.spool_max_bytes"):
        spool.put(_groups("d"))
    assert len(spool.pending()) == 3 and spool.size() == 3 * one  # nothing half written
    # another process's spool of the same folder shares the bound
    other = Spool(tmp_path / "spool", 3 * one, "serve-2")
    with pytest.raises(SpoolFull):
        other.put(_groups("d"))
    taken = other.take(spool.pending()[0])
    other.done(taken)  # room again
    other.put(_groups("d"))
    assert spool.size() == 3 * one


def test_files_are_whole_or_absent(tmp_path):
    folder = tmp_path / "spool"
    spool = Spool(folder, 1 << 20, "serve-1")
    path = spool.put(_groups("a"))
    assert sorted(p.name for p in folder.iterdir()) == [".lock", path.name]
    # a writer that crashed before its rename leaves a temporary file: never listed, and
    # deleted by the next spool of the folder
    (folder / f".{path.name[:-6]}x.spool.tmp-4242").write_bytes(b"half a fi")
    assert spool.pending() == [path]
    Spool(folder, 1 << 20, "serve-2")
    assert sorted(p.name for p in folder.iterdir()) == [".lock", path.name]


def test_a_file_that_does_not_decode_is_set_aside(tmp_path, caplog):
    spool = Spool(tmp_path / "spool", 1 << 20, "serve-1")
    good = spool.put(_groups("a"))
    bad = tmp_path / "spool" / "00000000000000000001-foreign-000000.spool"
    bad.write_bytes(b"\x93not msgpack of groups")
    truncated = tmp_path / "spool" / "00000000000000000002-cut-000000.spool"
    truncated.write_bytes(good.read_bytes()[:-7])
    assert spool.pending() == [bad, truncated, good]
    assert spool.take(bad) is None and spool.take(truncated) is None
    assert not bad.exists() and bad.with_name(bad.name + ".bad").exists()
    assert truncated.with_name(truncated.name + ".bad").exists()
    assert "does not decode" in caplog.text
    assert spool.pending() == [good]  # the rest is published as before
    taken = spool.take(good)
    assert _ids(taken.groups) == ["run/a@0"]
    with pytest.raises(Exception, match="not a spool file"):
        decode(b"\x01")


def test_a_file_is_taken_by_one_spool_at_a_time(tmp_path):
    first = Spool(tmp_path / "spool", 1 << 20, "serve-1")
    second = Spool(tmp_path / "spool", 1 << 20, "serve-2")
    path = first.put(_groups("a"))
    taken = first.take(path)
    assert taken is not None
    assert second.take(path) is None  # held
    first.release(taken)  # its publication failed: kept
    again = second.take(path)
    assert again is not None and _ids(again.groups) == ["run/a@0"]
    second.done(again)
    assert first.take(path) is None and first.pending() == []


def _hold_and_wait(folder, path, held, finish) -> None:
    spool = Spool(folder, 1 << 20, "serve-child")
    assert spool.take(path) is not None
    held.set()
    finish.wait(30)
    os._exit(0)  # dies holding it, as a crashed server would


def test_a_file_held_by_a_process_that_died_is_taken_by_the_next(tmp_path):
    folder = tmp_path / "spool"
    spool = Spool(folder, 1 << 20, "serve-1")
    path = spool.put(_groups("a", "b"))
    ctx = multiprocessing.get_context("fork")
    held, finish = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_and_wait, args=(folder, path, held, finish))
    child.start()
    try:
        assert held.wait(30)
        assert Spool(folder, 1 << 20, "serve-2").take(path) is None  # another process holds it
    finally:
        finish.set()
        child.join(30)
    restarted = Spool(folder, 1 << 20, "serve-3")  # a new server of the run, after the crash
    assert restarted.pending() == [path]
    taken = restarted.take(path)
    assert taken is not None and _ids(taken.groups) == ["run/a@0", "run/b@0"]
    restarted.done(taken)
    assert not path.exists()


def test_a_file_that_cannot_be_deleted_stays_held_until_it_is(tmp_path):
    with tiny_disk(tmp_path / "disk") as disk:
        spool = Spool(disk.path / "spool", 1 << 20, "serve-1")
        path = spool.put(_groups("a"))
        other = Spool(spool.folder, 1 << 20, "serve-2")  # another server of the run
        taken = spool.take(path)
        assert taken is not None
        disk.read_only()
        with pytest.raises(OSError) as refused:
            spool.done(taken)  # its groups are published: no one may take it meanwhile
        assert refused.value.errno == errno.EROFS
        assert path.exists() and other.take(path) is None  # still held
        with pytest.raises(OSError) as put_refused:
            spool.put(_groups("b"))
        assert put_refused.value.errno == errno.EROFS and spool.pending() == [path]
        disk.read_only(False)
        spool.done(taken)
        assert spool.pending() == [] and other.take(path) is None


def test_a_file_the_disk_does_not_let_it_set_aside_is_let_go(tmp_path):
    """A take that fails on a disk error (here the rename of a file that does not decode,
    on a read-only disk) holds nothing after it: once the disk takes writes again, this
    spool, or another server's, sets the file aside."""
    with tiny_disk(tmp_path / "disk") as disk:
        spool = Spool(disk.path / "spool", 1 << 20, "serve-1")
        bad = spool.folder / "00000000000000000001-foreign-000000.spool"
        bad.write_bytes(b"\x93not msgpack of groups")
        good = spool.put(_groups("a"))
        disk.read_only()
        with pytest.raises(OSError) as refused:
            spool.take(bad)
        assert refused.value.errno == errno.EROFS
        disk.read_only(False)
        assert spool.take(bad) is None  # set aside now...
        assert not bad.exists() and bad.with_name(bad.name + ".bad").exists()
        assert spool.pending() == [good]  # ... and out of the files waiting
