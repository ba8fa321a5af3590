"""Shared-memory files kept mapped (``sync/mapped.py``): one copy, hashed piece by piece to
the digest of the whole; a mapping reused while its path names the same file, dropped when
the file is replaced or gone; a sender whose version changes size makes a new file rather
than shrinking one a reader maps."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
import xxhash

from streamrft.infra.config import Config, RunSection
from streamrft.schemas.errors import IntegrityError
from streamrft.sync.mapped import PIECE, Mappings, copy_hashed
from streamrft.sync.shared import SharedReceiver, SharedSender
from streamrft.sync.transport import Payload
from tests.helpers.waits import open_fifo_writer, outcome_within

pytestmark = pytest.mark.unit


def test_one_copy_hashed_by_pieces_is_the_digest_of_the_whole():
    for n in (0, 1, PIECE - 1, PIECE, 3 * PIECE + 17):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        digest = xxhash.xxh3_128()
        copy_hashed(memoryview(dst.numpy()), memoryview(src.numpy()), digest)
        assert torch.equal(dst, src)
        assert digest.hexdigest() == xxhash.xxh3_128(src.numpy().tobytes()).hexdigest()
    with pytest.raises(ValueError, match="copy of"):
        copy_hashed(memoryview(bytearray(3)), memoryview(b"abcd"), xxhash.xxh3_128())


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_a_mapping_is_kept_for_the_same_file_and_dropped_when_it_is_replaced(tmp_path):
    path = str(tmp_path / "slot")
    _write(path, b"a" * 4096)
    maps = Mappings()
    fd = os.open(path, os.O_RDONLY)
    first = maps.get(path, fd)
    assert maps.get(path, fd) is first
    os.close(fd)
    assert bytes(first.view[:3]) == b"aaa"
    os.unlink(path)  # replaced: a new file (inode) under the same name
    _write(path, b"b" * 4096)
    fd = os.open(path, os.O_RDONLY)
    second = maps.get(path, fd)
    os.close(fd)
    assert second is not first and bytes(second.view[:3]) == b"bbb"
    os.unlink(path)
    maps.prune()  # gone: unmapped
    assert maps._maps == {}
    maps.close()


def _pair(folder):
    """A sender and a receiver of run ``mapped-test`` in ``folder``, the events sent, and
    ``send(version, tensors)``."""
    cfg = Config(run=RunSection(id="mapped-test"))
    sender = SharedSender(cfg, folder=str(folder))
    receiver = SharedReceiver(cfg, folder=str(folder))
    events: list = []

    async def announce(event):
        events.append(event)

    def send(version: int, tensors: dict[str, torch.Tensor]) -> None:
        payload = Payload(version, version, tensors, base_version=version)
        asyncio.run(sender.send(lambda _full: payload, announce))

    return sender, receiver, events, send


def test_a_version_of_another_size_is_a_new_file_and_an_old_event_is_refused(tmp_path):
    sender, receiver, events, send = _pair(tmp_path)
    try:
        big = {"w": torch.randn(64, 64)}
        send(0, big)
        got = receiver.receive(events[0], big)
        assert torch.equal(got["w"], big["w"])
        inode = os.stat(sender.paths["0"]).st_ino
        send(1, big)  # the other file
        small = {"w": torch.randn(8, 8)}
        send(2, small)  # file 0 again, smaller: a new file, the mapped one never shrinks
        assert os.stat(sender.paths["0"]).st_ino != inode
        with pytest.raises(IntegrityError, match="rewritten"):
            receiver.receive(events[0], big)
        got = receiver.receive(events[2], small)
        assert torch.equal(got["w"], small["w"])
        assert list(receiver._maps._maps) == [sender.paths["0"]]  # the new file's
        receiver.release_unused()  # still there: kept
        assert list(receiver._maps._maps) == [sender.paths["0"]]
    finally:
        receiver.close()
        sender.close()
    assert not os.path.exists(sender.paths["0"])


def test_the_mappings_of_files_the_trainer_removed_are_released_without_a_receive(tmp_path):
    """After the trainer removed its files (it stopped), the explorer's mappings of them go
    when it asks (an apply of any version), not at its next shared-memory receive only."""
    sender, receiver, events, send = _pair(tmp_path)
    tensors = {"w": torch.randn(32, 32)}
    try:
        send(0, tensors)
        receiver.receive(events[0], tensors)
        assert list(receiver._maps._maps) == [sender.paths["0"]]
        sender.close()  # removes its files
        receiver.release_unused()
        assert receiver._maps._maps == {}
    finally:
        receiver.close()
        sender.close()


def test_a_file_that_is_not_one_of_the_runs_version_files_is_never_mapped(tmp_path):
    """An event naming another file of the folder (another program's segment, which its
    owner may shrink under a mapping: SIGBUS; another run's file) is refused before the file
    is opened, even when its bytes and digest are those of a real version."""
    import msgspec

    sender, receiver, events, send = _pair(tmp_path)
    tensors = {"w": torch.randn(16, 16)}
    try:
        send(0, tensors)
        real = events[0]
        assert receiver.refusal(real) is None and receiver.can_load(real)
        image = Path(sender.paths["0"]).read_bytes()
        host = real.uri.rsplit("/", 1)[0]
        for name in ("pulse-shm-4242", "streamrft-another-run-77-0", "streamrft-mapped-test-x"):
            _write(tmp_path / name, image)
            event = msgspec.structs.replace(real, uri=f"{host}/{name}")
            assert receiver.refusal(event) is not None, name
            assert not receiver.can_load(event)
            with pytest.raises(IntegrityError, match="not a version file"):
                receiver.receive(event, tensors)
        assert receiver._maps._maps == {}  # nothing was mapped
        assert torch.equal(receiver.receive(real, tensors)["w"], tensors["w"])
    finally:
        receiver.close()
        sender.close()


def test_a_fifo_or_a_symbolic_link_under_a_version_files_name_is_refused_at_once(tmp_path):
    """A FIFO planted under a version file's name held the receive for ever (its open waits
    for a writer); a symbolic link redirected it to whatever it points at (here a copy of a
    real version, which was read): both are that announcement's IntegrityError, at once."""
    import msgspec

    sender, receiver, events, send = _pair(tmp_path)
    tensors = {"w": torch.randn(16, 16)}
    try:
        send(0, tensors)
        real = events[0]
        host = real.uri.rsplit("/", 1)[0]
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(Path(sender.paths["0"]).read_bytes())
        fifo, link = tmp_path / "streamrft-mapped-test-1-0", tmp_path / "streamrft-mapped-test-1-1"
        os.mkfifo(fifo)
        os.symlink(elsewhere, link)
        for path, why in ((fifo, "not a regular file"), (link, "cannot open")):
            event = msgspec.structs.replace(real, uri=f"{host}/{path.name}")
            assert receiver.refusal(event) is None  # a version file's name...
            error = outcome_within(
                lambda event=event: receiver.receive(event, tensors),
                30,
                lambda path=path: open_fifo_writer(path),
            )
            assert isinstance(error, IntegrityError) and why in str(error), error
        assert list(receiver._maps._maps) == []  # nothing was mapped
        assert torch.equal(receiver.receive(real, tensors)["w"], tensors["w"])
    finally:
        receiver.close()
        sender.close()
