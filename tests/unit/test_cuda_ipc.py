"""The ``cuda_ipc`` transport's parts that need no GPU (it has never run on one): the event's
fields and their checks, which path ``auto`` and an explorer choose by host and devices, the
digest against a plain reference, the slot image, the verified copy under a slot's lease,
and the leases themselves across processes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from streamrft.infra.config import ConfigError, from_dict, validate, with_run_id
from streamrft.schemas import CONTROL
from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync import cuda_ipc
from streamrft.sync.cuda_ipc import (
    CudaIpcReceiver,
    CudaIpcSender,
    IpcHandle,
    SlotRef,
    copies_into,
    copy_route,
    copy_verified,
    device_digest,
    device_sender,
    fill_image,
    format_uri,
    image_layout,
    local_index,
    parse_uri,
    reading,
    remove_leftovers,
    slot_order,
    stamp_mismatch,
    take_slot,
    try_exclusive,
    uses_device_path,
    write_stamp,
)
from streamrft.sync.shared import host_id
from streamrft.sync.transport import COST, Receivers
from tests.helpers.configs import cfg_of
from tests.helpers.waits import open_fifo_writer, outcome_within

pytestmark = pytest.mark.unit

GPU = "58f0b9cc-1d2e-4f3a-9b8c-7d6e5f4a3b2c"
HANDLE = IpcHandle(
    device=0,
    handle=bytes(range(64)),
    storage_bytes=2 << 20,
    storage_offset=4096,
    ref_counter=b"/torch_4242_1234567_0",
    ref_counter_offset=3,
    event=bytes(range(64, 128)),
    event_sync=True,
)


def _cfg(**sync):
    return with_run_id(from_dict(cfg_of(synchronizer={"method": "auto", **sync})), "ipc")


def _ref(host: str, slot: str = "streamrft-ipc-4242-cuda0", handle: IpcHandle = HANDLE):
    return SlotRef(host=host, slot=slot, gpu=GPU.replace("-", ""), ipc=handle)


def _event(uri: str, version: int = 3, nbytes: int = 1000, digest: str = "0" * 32):
    return ModelVersionReady(
        version=version, method="cuda_ipc", uri=uri, manifest_sha256=digest, bytes=nbytes,
        step=version,
    )  # fmt: skip


# -- the event ------------------------------------------------------------------------------
def test_a_slot_reference_travels_in_the_uri_and_passes_the_wire_checks():
    for handle in (HANDLE, dataclasses.replace(HANDLE, event=None, event_sync=False)):
        ref = _ref("box-1", handle=handle)
        uri = format_uri(ref)
        assert uri.startswith("cuda-ipc://box-1/streamrft-ipc-4242-cuda0?")
        assert parse_uri(uri) == ref
        event = _event(uri)
        assert CONTROL.decode(CONTROL.encode(event)) == event  # validated like any event
    assert parse_uri(format_uri(_ref("h"))).gpu == "58f0b9cc1d2e4f3a9b8c7d6e5f4a3b2c"
    # a GPU- prefixed, upper-case UUID (as nvidia-smi prints it) is the same GPU
    upper = format_uri(_ref("h")).replace(GPU.replace("-", ""), "GPU-" + GPU.upper())
    assert parse_uri(upper).gpu == GPU.replace("-", "")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda u: u.replace("cuda-ipc://", "shm://"), "not a cuda_ipc uri"),
        (lambda u: u.replace("box/", "/"), "host"),
        (lambda u: u.replace("streamrft-ipc-4242-cuda0", "../../etc/passwd"), "slot"),
        (lambda u: u.replace("cuda0", "cuda7"), "slot"),
        (lambda u: u + "&size=5", "exactly once"),
        (lambda u: u.replace("&rco=3", ""), "exactly once"),
        (lambda u: u + "&extra=1", "exactly once"),
        (lambda u: u.replace("size=2097152", "size=-5"), "size"),
        (lambda u: u.replace("size=2097152", "size=1e9"), "size"),
        (lambda u: u.replace("evs=1", "evs=2"), "evs"),
        (lambda u: u.replace("&h=", "&h=%2B%2F"), "base64url"),
        (lambda u: _with(u, "h", ""), "no IPC handle"),
        (lambda u: _with(u, "h", "A" * 5000), "at most"),
        (lambda u: _with(u, "gpu", "not-a-uuid"), "GPU UUID"),
        (lambda u: u.replace("?", "?&&=", 1), "malformed query"),
    ],
)
def test_a_malformed_slot_reference_is_refused_with_its_reason(change, why):
    uri = change(format_uri(_ref("box")))
    with pytest.raises(IntegrityError, match=why):
        parse_uri(uri)
    receiver = CudaIpcReceiver(_cfg())
    reason = receiver.refusal(_event(uri))
    assert reason is not None and why.split()[0] in reason
    assert not receiver.can_load(_event(uri))
    # the explorer's receivers of an auto run refuse it, saying why
    assert Receivers(_cfg(), "explorer-0").refusal(_event(uri)) == reason


def _with(uri: str, key: str, value: str) -> str:
    head, _, query = uri.partition("?")
    pairs = [p.split("=", 1) for p in query.split("&")]
    return head + "?" + "&".join(f"{k}={value if k == key else v}" for k, v in pairs)


# -- which path: host, devices ---------------------------------------------------------------
def test_auto_takes_the_device_path_only_from_a_trainer_on_a_usable_gpu():
    assert uses_device_path("cuda", lora=False, cuda=True)
    assert uses_device_path("cuda:1", lora=False, cuda=True)
    assert not uses_device_path("cpu", lora=False, cuda=True)  # processes on a CPU: shared
    assert not uses_device_path("cuda", lora=False, cuda=False)  # no CUDA torch
    assert not uses_device_path("cuda", lora=True, cuda=True)  # adapters: shared
    # on this machine (no CUDA) auto has no device path, whatever model.device says
    assert device_sender(_cfg()) is None
    gpu_cfg = from_dict(cfg_of(synchronizer={"method": "auto"}, model={"device": "cuda"}))
    assert device_sender(with_run_id(gpu_cfg, "ipc")) is None
    with pytest.raises(SyncError, match="CUDA device"):
        CudaIpcSender(_cfg(), 1.0)


def test_the_method_alone_needs_a_trainer_on_a_gpu_and_full_weights():
    with pytest.raises(ConfigError, match="cuda_ipc keeps versions on the trainer's GPU"):
        validate(from_dict(cfg_of(synchronizer={"method": "cuda_ipc"})))
    on_gpu = cfg_of(synchronizer={"method": "cuda_ipc"}, trainer={"device": "cuda:0"})
    validate(from_dict(on_gpu))  # a trainer on a GPU: fine (its explorers may be anywhere)
    lora = cfg_of(
        synchronizer={"method": "cuda_ipc"}, model={"device": "cuda", "lora": {"enabled": True}}
    )
    with pytest.raises(ConfigError, match="full versions"):
        validate(from_dict(lora))


def test_an_explorer_loads_the_device_copy_only_from_its_host_and_a_gpu_it_sees(tmp_path):
    cfg = _cfg()
    here = host_id(cfg)
    slot = "streamrft-ipc-4242-cuda0"
    (tmp_path / slot).write_bytes(b"")
    receiver = CudaIpcReceiver(cfg, folder=str(tmp_path))
    local = _event(format_uri(_ref(here, slot)))
    elsewhere = _event(format_uri(_ref("another-host", slot)))
    assert not receiver.can_load(elsewhere)  # another host's GPU: never
    # this host, but this explorer is on a CPU (and this machine has no CUDA): shared memory
    assert not receiver.can_load(local)
    with pytest.raises(SyncError, match="not this host"):
        receiver.receive(elsewhere, {})
    with pytest.raises(SyncError, match="not visible"):
        receiver.receive(local, {})
    # a lease file gone (the trainer stopped): not loadable either
    gone = _event(format_uri(_ref(here, "streamrft-ipc-4243-cuda1")))
    assert not receiver.can_load(gone)
    # every place of a version has its price: the device copy first, then shared memory
    assert COST["cuda_ipc"] < COST["shared"] < COST["nccl"] < COST["object_store"]


def test_a_slot_reaches_a_gpu_by_uuid_then_by_the_cheapest_copy():
    visible = ["GPU-" + GPU.upper(), "00000000-0000-0000-0000-000000000001"]
    assert local_index(GPU.replace("-", ""), visible) == 0
    assert local_index("0" * 31 + "1", visible) == 1
    assert local_index("f" * 32, visible) is None  # a process shown only its own GPU
    # a slot goes straight into staging memory on the explorer's own GPU only
    assert copies_into(0, torch.device("cuda", 0)) and copies_into(0, torch.device("cuda"))
    assert not copies_into(1, torch.device("cuda", 0))
    assert not copies_into(None, torch.device("cuda", 0))  # a model on a CPU
    assert not copies_into(0, torch.device("cpu"))  # host staging: the version did not fit
    assert copy_route(0, 0, peer_access=False) == "same"
    assert copy_route(1, 0, peer_access=True) == "peer"
    assert copy_route(1, 0, peer_access=False) == "host"


# -- the digest ------------------------------------------------------------------------------
def _reference(data: np.ndarray, block: int) -> str:
    i = np.arange(data.size, dtype=np.int64)
    x = data.astype(np.int64)
    first = int((x * (1 + i % block)).sum())
    second = int((x * (1 + (i // block) % block)).sum())
    mask = (1 << 64) - 1
    return f"{first & mask:016x}{second & mask:016x}"


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 63, 64, 65, 1000, 4096 + 3])
def test_the_digest_is_the_two_weighted_sums_whatever_the_chunks(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    buf = torch.from_numpy(data.copy())
    assert device_digest(buf, block=16, chunk=64) == _reference(data, 16)
    assert device_digest(buf, block=16, chunk=16) == _reference(data, 16)
    assert device_digest(buf) == _reference(data, cuda_ipc.DIGEST_BLOCK)


def test_the_digest_sees_a_flipped_byte_and_a_swap():
    data = np.random.default_rng(7).integers(0, 256, 10_000, dtype=np.uint8)
    pairs = ((0, 1), (3, 67), (10, 10 + 64 * 5))  # the last: the same place in its block
    for a, b in pairs:
        data[b] = data[a] ^ 3  # two different bytes
    base = device_digest(torch.from_numpy(data.copy()), block=64, chunk=256)
    assert len(base) == 32
    for pos in (0, 1, 63, 64, 255, 256, 9_999):
        flipped = data.copy()
        flipped[pos] ^= 1
        assert device_digest(torch.from_numpy(flipped), block=64, chunk=256) != base
    for a, b in pairs:
        swapped = data.copy()
        swapped[a], swapped[b] = data[b], data[a]
        assert device_digest(torch.from_numpy(swapped), block=64, chunk=256) != base
    # the largest bytes everywhere: exact, nothing overflows
    top = np.full(3 * cuda_ipc.DIGEST_BLOCK + 5, 255, dtype=np.uint8)
    assert device_digest(torch.from_numpy(top)) == _reference(top, cuda_ipc.DIGEST_BLOCK)
    with pytest.raises(SyncError, match="flat uint8"):
        device_digest(torch.zeros(4, dtype=torch.float32))


# -- the slot image and the verified copy ----------------------------------------------------
def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b": torch.randn(3, generator=g),
        "steps": torch.tensor(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


@dataclasses.dataclass
class _Slot:
    """A version's image in a slot (on the CPU here), its lease file and an event for it."""

    state: dict[str, torch.Tensor]
    slot: torch.Tensor
    lease: str
    fd: int
    event: ModelVersionReady

    def copy(self, like=None) -> dict[str, torch.Tensor]:
        buf = torch.empty(self.event.bytes, dtype=torch.uint8)
        return copy_verified(self.event, lambda: self.slot, buf, self.lease, like or {}, _copy)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


@pytest.fixture
def slot(tmp_path):
    """Version 3 written into a slot larger than its image, its lease saying so."""
    state = _state()
    head, ordered, nbytes = image_layout(state)
    buf = torch.empty(nbytes + 64, dtype=torch.uint8)
    fill_image(buf[:nbytes], head, ordered)
    lease = str(tmp_path / "streamrft-ipc-1-cuda0")
    fd = os.open(lease, os.O_RDWR | os.O_CREAT, 0o600)
    write_stamp(fd, 3, nbytes)
    event = _event("cuda-ipc://x", 3, nbytes, device_digest(buf[:nbytes]))
    yield _Slot(state, buf, lease, fd, event)
    os.close(fd)


def test_a_slot_image_decodes_to_the_version_exactly(slot):
    like = {k: torch.empty_like(v) for k, v in slot.state.items()}
    got = slot.copy(like)
    assert set(got) == set(slot.state)
    for name, tensor in slot.state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    head, ordered, nbytes = image_layout(slot.state)
    with pytest.raises(SyncError, match="image of"):
        fill_image(torch.empty(nbytes + 1, dtype=torch.uint8), head, ordered)


def test_a_copy_is_refused_when_the_slot_moved_on_or_its_bytes_changed(slot):
    nbytes = slot.event.bytes
    write_stamp(slot.fd, 5, nbytes)  # the trainer wrote version 5 into the slot since
    with pytest.raises(IntegrityError, match="rewritten with version 5"):
        slot.copy()
    write_stamp(slot.fd, -1, 0)  # being written (or the trainer died writing)
    with pytest.raises(IntegrityError, match="holds no version"):
        slot.copy()
    write_stamp(slot.fd, 3, nbytes)
    slot.slot[100] ^= 1  # a bit flipped after the trainer's digest
    with pytest.raises(IntegrityError, match="does not match"):
        slot.copy()
    slot.slot[100] ^= 1
    with pytest.raises(IntegrityError, match="do not fit"):  # not this model's shapes
        slot.copy({"w": torch.empty(5, 7, dtype=torch.bfloat16)})
    os.unlink(slot.lease)  # the trainer stopped: its leases are gone
    with pytest.raises(IntegrityError, match="cannot open"):
        slot.copy()


def test_a_forged_slot_size_or_offset_is_refused_before_the_slot_is_mapped(slot):
    """The trainer writes its slot's storage size and offset (its IPC handle's) into the
    lease: an announcement with a real handle but another size or offset (which would map
    and read memory outside the slot) is refused under the lease, before it is mapped."""
    size, offset = slot.slot.numel(), 4096
    write_stamp(slot.fd, 3, slot.event.bytes, size, offset)
    mapped: list[int] = []

    def src() -> torch.Tensor:
        mapped.append(1)
        return slot.slot

    def copy(claimed: tuple[int, int]) -> dict[str, torch.Tensor]:
        buf = torch.empty(slot.event.bytes, dtype=torch.uint8)
        return copy_verified(slot.event, src, buf, slot.lease, {}, _copy, slot=claimed)

    for forged in ((size + (1 << 20), offset), (size, 0), (size, offset + 64)):
        with pytest.raises(IntegrityError, match="not the slot's"):
            copy(forged)
    assert mapped == []  # never mapped
    assert set(copy((size, offset))) == set(slot.state) and mapped == [1]


def test_a_slot_is_mapped_once_per_handle_offset_and_size_the_old_one_dropped_first(
    monkeypatch,
):
    """torch caches IPC mappings by (handle, offset) while they live: a new slot at the
    handle of an old one (the trainer's allocator reused its block) is mapped anew, the old
    mapping let go first (else torch's cache handed the old storage back)."""
    from torch.multiprocessing import reductions

    receiver = CudaIpcReceiver(_cfg())
    calls: list[tuple[int, int]] = []

    def rebuild(cls, shape, stride, offset, storage_cls, dtype, device, handle, size, off, *rest):
        assert "streamrft-ipc-4242-cuda0" not in receiver._mapped  # the old one went first
        calls.append((off, size))
        return torch.zeros(size, dtype=torch.uint8)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    ref = _ref("h")
    first = receiver._map(ref, 0, "v3")
    assert receiver._map(ref, 0, "v3") is first and calls == [(4096, 2 << 20)]  # kept
    moved = dataclasses.replace(HANDLE, storage_offset=8192)  # same handle, another offset
    assert receiver._map(_ref("h", handle=moved), 0, "v4").numel() == 2 << 20
    grown = dataclasses.replace(moved, storage_bytes=3 << 20)  # and another size
    assert receiver._map(_ref("h", handle=grown), 0, "v5").numel() == 3 << 20
    assert calls == [(4096, 2 << 20), (8192, 2 << 20), (8192, 3 << 20)]
    assert list(receiver._mapped) == ["streamrft-ipc-4242-cuda0"]


# -- slots and leases ------------------------------------------------------------------------
def test_slots_alternate_and_a_writer_takes_the_one_no_reader_holds():
    assert slot_order(None) == (0, 1)
    assert slot_order(0) == (1, 0)  # the slot holding the newest version last
    assert slot_order(1) == (0, 1)
    held = {0}
    assert take_slot((0, 1), lambda s: s not in held, wait_s=0) == 1
    assert take_slot((1, 0), lambda s: s not in held, wait_s=0) == 1
    tries = []
    assert take_slot((0, 1), lambda s: tries.append(s) or False, wait_s=0.02, poll_s=0.001) is None
    assert tries[:4] == [0, 1, 0, 1]  # tried again, in order, until the wait ran out
    freed = iter([False, False, True])
    assert take_slot((0,), lambda s: next(freed), wait_s=5, poll_s=0.001) == 0
    assert stamp_mismatch((3, 10, 64, 0), 3, 10) is None
    assert "rewritten with version 5" in (stamp_mismatch((5, 10, 64, 0), 3, 10) or "")
    assert "rewritten" in (stamp_mismatch((3, 11, 64, 0), 3, 10) or "")
    assert stamp_mismatch((3, 10, 64, 512), 3, 10, slot=(64, 512)) is None
    for forged in ((65, 512), (64, 0)):  # the slot's size and offset are the lease's
        assert "not the slot's" in (stamp_mismatch((3, 10, 64, 512), 3, 10, forged) or "")


READER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.readline()
"""


def _wait(ready, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_reader_holds_its_slot_until_it_is_done_or_dies(tmp_path):
    path = tmp_path / "streamrft-ipc-1-cuda0"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    write_stamp(fd, 4, 99)
    with reading(str(path), "v4") as first, reading(str(path), "v4") as second:
        assert first == second == (4, 99, 0, 0)  # readers share a slot
        assert not try_exclusive(fd)  # the writer waits for both
    assert try_exclusive(fd)  # both done
    with pytest.raises(IntegrityError, match="being rewritten"), reading(str(path), "v4"):
        pass
    os.close(fd)  # the writer is done
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == b"held"
        fd = os.open(path, os.O_RDWR)
        assert not try_exclusive(fd)  # another process reads the slot
        reader.kill()  # ...and dies mid-read: the kernel gives its lease back
        reader.wait(timeout=30)
        _wait(lambda: try_exclusive(fd), "the dead reader's lease")
        os.close(fd)
    finally:
        if reader.poll() is None:
            reader.kill()


def test_a_lease_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """A FIFO planted under a lease file's name held the reader for ever (its open waits for
    a writer); a symbolic link made it read (and lock) whatever it points at: both are that
    announcement's IntegrityError, at once."""
    real = tmp_path / "streamrft-ipc-1-cuda0"
    fd = os.open(real, os.O_RDWR | os.O_CREAT, 0o600)
    write_stamp(fd, 4, 99)
    fifo, link = tmp_path / "streamrft-ipc-1-cuda1", tmp_path / "streamrft-ipc-2-cuda0"
    os.mkfifo(fifo)
    os.symlink(real, link)

    def stamp(path) -> tuple[int, int]:
        with reading(str(path), "v4") as held:
            return held

    try:
        assert stamp(real) == (4, 99, 0, 0)
        for path, why in ((fifo, "not a regular file"), (link, "cannot open")):
            error = outcome_within(
                lambda path=path: stamp(path), 30, lambda path=path: open_fifo_writer(path)
            )
            assert isinstance(error, IntegrityError) and why in str(error), error
    finally:
        os.close(fd)


def test_a_trainer_removes_the_lease_files_a_killed_one_left(tmp_path):
    dead = _dead_pid()
    live = os.getppid()  # a process that started before these files: their writer
    names = [
        f"streamrft-ipc-{dead}-cuda0",
        f"streamrft-ipc-{dead}-cuda1",
        f"streamrft-ipc-x-{dead}-cuda0",  # another run's, its trainer gone too
        f"streamrft-ipc-{dead}-0",  # shared memory's own file: not this module's
        f"streamrft-ipc-{live}-cuda0",  # a trainer that runs: never touched
        f"streamrft-ipc-{dead}-cuda2",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert sorted(remove_leftovers("ipc", str(tmp_path))) == sorted(names[:3])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[3:])


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
