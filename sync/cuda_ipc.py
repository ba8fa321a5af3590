"""The ``cuda_ipc`` transport: versions device to device between processes on one host.

**Not run on a GPU yet.** Every part that needs no CUDA (the event's fields and their
checks, the choice of copy, the digest, the slots' leases) is tested on CPUs; the calls into
CUDA are torch's documented IPC (``UntypedStorage._share_cuda_`` on the trainer's side, the
arguments ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` takes on the explorer's).

Trainer side (:class:`CudaIpcSender`): two buffers ("slots") on the trainer's GPU, written
in turn. A version is written into a slot as one safetensors image (the header, then every
tensor: the bytes the shared files and the stores hold) from the snapshot in pinned host
memory, one host-to-device copy on a stream of its own while the trainer trains on; its
digest is computed there, on the GPU (:func:`device_digest`). The event (``method:
cuda_ipc``) names the host, the slot and the GPU (by UUID) and carries the slot's CUDA IPC
handle in its ``uri`` (:func:`format_uri`), the digest in ``manifest_sha256``.

Explorer side (:class:`CudaIpcReceiver`): an explorer on the trainer's host (``run.host_id``
equal, the slot's lease file visible in ``/dev/shm``) whose model is on a GPU maps the slot
(once per slot), copies it into memory of its own on its GPU — the same GPU: a device copy;
another GPU it sees: a peer copy where peer access exists, else through pinned host memory
(:func:`copy_route`) — computes the digest of its copy and decodes views of it only when it
matches. An explorer on a CPU, or one shown only its own GPU (``explorer.device: cuda:N``
sets ``CUDA_VISIBLE_DEVICES``) when the trainer is on another, cannot load it: ``auto`` also
announces each version from shared memory and the store.

Leases: each slot has a lease file in ``/dev/shm`` (``streamrft-<run>-<pid>-cuda<slot>``)
holding the version the slot holds, its size, and the slot's storage size and offset (an
announcement naming others, a real handle with a forged size or offset, is refused before
the slot is mapped). A reader holds a shared ``flock`` on it
while it copies; the trainer takes it exclusively to rewrite the slot, so a slot is never
rewritten while an explorer reads it (the kernel drops the lock of a process that dies). The
trainer writes a version into the slot that no reader holds, the older first
(:func:`slot_order`); when both are held it waits ``lease_wait_s`` at most, then gives up on
this path for that version (:class:`SlotBusy`; ``auto``: counter ``cuda_ipc_skipped``, the
version still goes by shared memory and the store). A reader that finds its slot being
rewritten, or holding another version, rejects the version like a rewritten shared file.

Integrity: the digest catches any change of the bytes between the trainer's write and the
reader's copy: a copy of a slot that was rewritten, a wrong or stale mapping, a flipped bit.
Like shared memory's xxh3, it is not a defence against a hostile process on the host: one
that can open the handle can write the slot too.

Costs: two slots of a version's size on the trainer's GPU, and on each explorer one version of
memory on its GPU: its staging copy, which a version read from a device takes there whenever
it fits, whatever ``synchronizer.staging`` says but ``none`` (:mod:`.staging`), else a buffer
of its own (then the version is copied into host staging memory, or, with ``none``, into the
model at the sync point).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from urllib.parse import parse_qs, urlencode

import torch

from streamrft.infra.config import Config
from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync import shared, shm_files
from streamrft.sync.shared import host_id
from streamrft.sync.shm_files import LEASE_SLOTS, SHM_DIR, file_prefix
from streamrft.sync.staging import allocated
from streamrft.sync.transport import Announce, MakePayload, WeightReceiver, WeightSender
from streamrft.sync.weights import checked_image, largest_version, safetensors_header

if TYPE_CHECKING:
    from streamrft.sync.staging import Stage

log = logging.getLogger(__name__)

SCHEME = "cuda-ipc://"
LEASE_WAIT_S = 10.0
"""``auto``: longest wait for a slot no reader holds before a version skips this path."""
LEASE_POLL_S = 0.002
CLOSE_WAIT_S = 2.0
"""A closing trainer waits this long at most for readers before it frees its slots."""
STAMP = struct.Struct("<qqqq")
"""A lease file's contents: the version its slot holds (-1: none), its bytes, and the slot's
storage size and offset as its IPC handle has them (an announcement's must be these)."""
Stamp = tuple[int, int, int, int]
MAX_HANDLE_BYTES = 1024
"""Longest handle, ref-counter name or event handle an event may carry (torch's are 64-128)."""
DIGEST_BLOCK = 1 << 20
DIGEST_CHUNK = 16 * DIGEST_BLOCK
BOUNCE_BYTES = 64 << 20
"""Pinned host buffer a copy between two GPUs without peer access goes through, in pieces."""
_STAGE_NAME = "\0cuda_ipc"
"""The name of the flat buffer this receiver asks a device stage for (never a tensor's)."""

Route = Literal["same", "peer", "host"]


class SlotBusy(SyncError):
    """Both slots stayed held by readers for the whole wait: this version does not go by
    ``cuda_ipc`` (a later one may)."""

    retriable = True


# -- the event's fields ---------------------------------------------------------------------
@dataclass(frozen=True)
class IpcHandle:
    """What torch's ``UntypedStorage._share_cuda_`` says of a slot: what another process
    needs to map it (``rebuild_cuda_tensor``'s storage arguments)."""

    device: int
    """The slot's device index in the trainer's process (the reader uses its own index of
    the same GPU, found by UUID)."""
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes | None
    event_sync: bool


@dataclass(frozen=True)
class SlotRef:
    """Where a version lies on the trainer's GPU: the parsed ``uri`` of a ``cuda_ipc`` event."""

    host: str
    """The trainer's ``host_id``."""
    slot: str
    """The slot's lease file in ``/dev/shm`` (``streamrft-<run>-<pid>-cuda<n>``)."""
    gpu: str
    """The trainer's GPU: its UUID, 32 lower-case hex digits."""
    ipc: IpcHandle


_SLOT_FILE = re.compile(r"streamrft-[A-Za-z0-9._-]+-\d+-cuda[01]")


def normalize_uuid(text: str) -> str:
    """A GPU's UUID as 32 lower-case hex digits (``GPU-`` prefix and dashes dropped);
    IntegrityError when it is not one."""
    digits = text.strip().lower().removeprefix("gpu-").replace("-", "")
    if not re.fullmatch(r"[0-9a-f]{32}", digits):
        raise IntegrityError(f"not a GPU UUID: {text[:64]!r}")
    return digits


def _b64(data: bytes | None) -> str:
    return base64.urlsafe_b64encode(data or b"").decode().rstrip("=")


def _unb64(text: str, field: str) -> bytes:
    if len(text) > MAX_HANDLE_BYTES * 2 or not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise IntegrityError(f"{field}: not base64url of at most {MAX_HANDLE_BYTES} bytes")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def format_uri(ref: SlotRef) -> str:
    """``cuda-ipc://<host>/<slot>?gpu=...&dev=...&h=...``: every field :func:`parse_uri`
    reads back (bytes as base64url)."""
    ipc = ref.ipc
    query = urlencode(
        {
            "gpu": ref.gpu,
            "dev": ipc.device,
            "h": _b64(ipc.handle),
            "size": ipc.storage_bytes,
            "off": ipc.storage_offset,
            "rc": _b64(ipc.ref_counter),
            "rco": ipc.ref_counter_offset,
            "ev": _b64(ipc.event),
            "evs": int(ipc.event_sync),
        }
    )
    return f"{SCHEME}{ref.host}/{ref.slot}?{query}"


def parse_uri(uri: str) -> SlotRef:
    """The :class:`SlotRef` a ``cuda_ipc`` event's uri names; IntegrityError (saying what is
    wrong) for anything malformed: another scheme, a missing or repeated field, a number that
    is not one, a handle that is not base64url or is too long, a slot name that is not a
    lease file's."""
    if not uri.startswith(SCHEME):
        raise IntegrityError(f"not a cuda_ipc uri: {uri[:80]!r}")
    location, _, query = uri[len(SCHEME) :].partition("?")
    host, _, slot = location.partition("/")
    if not host or not _SLOT_FILE.fullmatch(slot):
        raise IntegrityError(f"cuda_ipc uri: host {host[:40]!r} / slot {slot[:80]!r} refused")
    try:
        fields = parse_qs(query, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise IntegrityError(f"cuda_ipc uri: malformed query: {exc}") from exc
    want = {"gpu", "dev", "h", "size", "off", "rc", "rco", "ev", "evs"}
    if set(fields) != want or any(len(v) != 1 for v in fields.values()):
        raise IntegrityError(
            f"cuda_ipc uri: fields {sorted(fields)} (each of {sorted(want)} exactly once)"
        )
    one = {k: v[0] for k, v in fields.items()}

    def number(key: str) -> int:
        if not re.fullmatch(r"\d{1,19}", one[key]):
            raise IntegrityError(f"cuda_ipc uri: {key}={one[key][:24]!r} is not a count")
        return int(one[key])

    if one["evs"] not in ("0", "1"):
        raise IntegrityError(f"cuda_ipc uri: evs={one['evs'][:8]!r} (0 or 1)")
    handle = _unb64(one["h"], "h")
    if not handle:
        raise IntegrityError("cuda_ipc uri: no IPC handle")
    event = _unb64(one["ev"], "ev")
    ipc = IpcHandle(
        device=number("dev"),
        handle=handle,
        storage_bytes=number("size"),
        storage_offset=number("off"),
        ref_counter=_unb64(one["rc"], "rc"),
        ref_counter_offset=number("rco"),
        event=event or None,
        event_sync=one["evs"] == "1",
    )
    return SlotRef(host=host, slot=slot, gpu=normalize_uuid(one["gpu"]), ipc=ipc)


# -- choices (pure) -------------------------------------------------------------------------
def uses_device_path(device: str, lora: bool, cuda: bool) -> bool:
    """Whether a trainer on ``device`` (its ``model.device``) sends versions by ``cuda_ipc``
    too under ``auto``: on a CUDA device that torch can use, full weights (a LoRA run's
    adapters are small; they keep shared memory)."""
    return cuda and not lora and torch.device(device).type == "cuda"


def local_index(gpu: str, visible: Sequence[str]) -> int | None:
    """This process's index of the GPU whose UUID is ``gpu`` among the ``visible`` UUIDs
    (in index order); None when this process does not see it."""
    for index, uuid in enumerate(visible):
        if normalize_uuid(uuid) == gpu:
            return index
    return None


def copy_route(own: int, source: int, peer_access: bool) -> Route:
    """How a slot on GPU ``source`` reaches a buffer on GPU ``own``: a device copy on one
    GPU, a peer copy between two with peer access, else through pinned host memory."""
    if own == source:
        return "same"
    return "peer" if peer_access else "host"


def copies_into(own: int | None, memory: torch.device) -> bool:
    """Whether an explorer whose model is on GPU ``own`` (None: not on a GPU) copies a slot
    straight into staging memory on ``memory``: only memory of that GPU (any other gets the
    receiver's own copy on the GPU first, then a copy into it)."""
    return own is not None and memory.type == "cuda" and memory.index in (None, own)


def slot_order(newest: int | None) -> tuple[int, int]:
    """The slots to try for the next version, in order: the one not holding the newest
    version first (``newest``: the slot written last; None: none yet)."""
    older = 0 if newest is None else 1 - newest
    return older, 1 - older


def stamp_mismatch(
    stamp: Stamp, version: int, nbytes: int, slot: tuple[int, int] | None = None
) -> str | None:
    """Why a slot whose lease file says ``stamp`` does not hold ``version`` of ``nbytes``,
    or (``slot``: the announcement's storage size and offset) is not that storage (None: it
    does, and is)."""
    held, size, storage_bytes, storage_offset = stamp
    if held < 0:
        return "its slot holds no version (being written, or the trainer is gone)"
    if held != version or size != nbytes:
        return f"its slot was rewritten with version {held} ({size} bytes)"
    if slot is not None and slot != (storage_bytes, storage_offset):
        return (
            f"the announcement's slot of {slot[0]} bytes at offset {slot[1]} is not the slot's "
            f"({storage_bytes} bytes at {storage_offset}): refused before it is mapped"
        )
    return None


def device_digest(buf: torch.Tensor, block: int = DIGEST_BLOCK, chunk: int = DIGEST_CHUNK) -> str:
    """The digest of a flat uint8 buffer, computed where it lies (a GPU: at memory speed),
    identical on any device: 32 hex digits of two position-weighted sums of its bytes,
    ``sum(x[i] * (1 + i % block))`` and ``sum(x[i] * (1 + (i // block) % block))``, in exact
    integer arithmetic (no term or sum overflows 64 bits below 2**43 bytes), each modulo
    2**64. A change of one byte changes the first sum; two bytes swapped change one of them
    (unless ``block**2`` bytes apart)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise SyncError(f"device_digest: a flat uint8 buffer, not {buf.dtype} {tuple(buf.shape)}")
    if chunk % block:
        raise SyncError("device_digest: chunk must be a multiple of block")
    weights = torch.arange(1, block + 1, dtype=torch.int32, device=buf.device)
    first = torch.zeros((), dtype=torch.int64, device=buf.device)
    second = torch.zeros((), dtype=torch.int64, device=buf.device)
    for lo in range(0, buf.numel(), chunk):
        x = buf[lo : lo + chunk]
        n = x.numel()
        rows = -(-n // block)
        padded = x
        if n % block:  # the tail: zeros weigh nothing
            padded = torch.zeros(rows * block, dtype=torch.uint8, device=buf.device)
            padded[:n] = x
        values = padded.view(rows, block).to(torch.int32)
        first += (values * weights).sum(dtype=torch.int64)
        blocks = torch.arange(lo // block, lo // block + rows, device=buf.device)
        second += (values.sum(dim=1, dtype=torch.int64) * (blocks % block + 1)).sum()
    mask = (1 << 64) - 1
    return f"{int(first.item()) & mask:016x}{int(second.item()) & mask:016x}"


# -- leases ---------------------------------------------------------------------------------
def read_stamp(fd: int) -> Stamp:
    raw = os.pread(fd, STAMP.size, 0)
    if len(raw) != STAMP.size:
        return -1, 0, 0, 0
    version, nbytes, storage_bytes, storage_offset = STAMP.unpack(raw)
    return int(version), int(nbytes), int(storage_bytes), int(storage_offset)


def write_stamp(
    fd: int, version: int, nbytes: int, storage_bytes: int = 0, storage_offset: int = 0
) -> None:
    os.pwrite(fd, STAMP.pack(version, nbytes, storage_bytes, storage_offset), 0)


def try_exclusive(fd: int) -> bool:
    """Take the slot's lease for writing if no reader holds it (no wait)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def take_slot(
    order: Sequence[int], take: Callable[[int], bool], wait_s: float, poll_s: float = LEASE_POLL_S
) -> int | None:
    """The first slot of ``order`` that ``take`` (an attempt at its lease, no wait) gets,
    trying again until ``wait_s`` has passed; None: every slot stayed held."""
    deadline = time.monotonic() + wait_s
    while True:
        for slot in order:
            if take(slot):
                return slot
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


@contextlib.contextmanager
def reading(path: str, what: str) -> Iterator[Stamp]:
    """Hold a slot's lease for reading (shared: other readers may hold it too; the trainer
    cannot rewrite the slot meanwhile); yields its stamp. A slot being rewritten now, or a
    lease file gone (the trainer stopped), is an IntegrityError: that version is gone; so is
    anything but a regular file under its name (:func:`~.shared.open_regular`)."""
    fd = shared.open_regular(path, f"{what}: the slot's lease")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise IntegrityError(f"{what}: its slot is being rewritten by a newer version") from exc
        yield read_stamp(fd)
    finally:
        os.close(fd)  # releases the lock


def remove_leftovers(run_id: str = "", folder: str = SHM_DIR) -> list[str]:
    """Remove the lease files that trainers now gone left (their slots went with their
    processes), of any run, by the pid in each name, and this process's own of run
    ``run_id``: shared memory's rule (:func:`~.shm_files.remove_leftovers`); their names."""
    return shm_files.remove_leftovers(run_id, folder, LEASE_SLOTS)


# -- CUDA (not run here: no GPU) ------------------------------------------------------------
def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs this process sees, in index order (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [
        normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))
        for i in range(torch.cuda.device_count())
    ]


def cuda_index(device: str) -> int | None:
    """The CUDA device index ``device`` (a ``model.device``) names in this process; None
    for a CPU or without CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def image_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[torch.Tensor], int]:
    """A version as one safetensors image: its header, its tensors in the image's order
    (wider dtypes first: every tensor's data aligned to its element size) and its bytes."""
    ordered = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    head = safetensors_header(ordered)
    return (
        head,
        [t for _, t in ordered],
        len(head) + sum(t.numel() * t.element_size() for _, t in ordered),
    )


def fill_image(buf: torch.Tensor, head: bytes, ordered: Sequence[torch.Tensor]) -> None:
    """Copy an image (see :func:`image_layout`) into the flat uint8 ``buf`` of its size, on
    the current stream (asynchronous from pinned host memory)."""
    buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    offset = len(head)
    for tensor in ordered:
        data = _as_bytes(tensor)
        buf[offset : offset + data.numel()].copy_(data, non_blocking=True)
        offset += data.numel()
    if offset != buf.numel():
        raise SyncError(f"cuda_ipc: an image of {offset} bytes in a slot of {buf.numel()}")


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Work queued on ``stream`` (None: the current one, e.g. on a CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def copy_verified(
    event: ModelVersionReady,
    src: Callable[[], torch.Tensor],
    buf: torch.Tensor,
    lease: str,
    like: Mapping[str, torch.Tensor],
    copy: Callable[[torch.Tensor, torch.Tensor], None],
    stream: torch.cuda.Stream | None = None,
    slot: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Version ``event`` from its slot into ``buf`` under the slot's ``lease`` (its stamp
    must say this version, and, ``slot``: the announcement's storage size and offset, that
    they are the slot's), by ``copy(dst, src())``: ``src()`` maps the slot (its image's
    bytes) only then, so a forged size or offset with a real handle is never mapped nor
    read. Then its digest is checked, the image decoded (views of ``buf``) and fitted to
    ``like``. Any mismatch is an IntegrityError and nothing is returned."""
    what = f"version {event.version} on the trainer's GPU"
    with reading(lease, what) as stamp:
        why = stamp_mismatch(stamp, event.version, event.bytes, slot)
        if why is not None:
            raise IntegrityError(f"{what}: {why}")
        source = src()
        with _on(stream):
            copy(buf, source[: event.bytes])
        if stream is not None:
            stream.synchronize()  # copied before the lease is given back
    with _on(stream):
        digest = device_digest(buf)
    why = "rewritten while copied, or corrupted"
    return checked_image(buf, digest, event.manifest_sha256, what, like, why)


class CudaIpcSender(WeightSender):
    """Trainer side: each version into the slot on its GPU no explorer reads, then its event."""

    method = "cuda_ipc"

    def __init__(self, cfg: Config, lease_wait_s: float, folder: str = SHM_DIR) -> None:
        index = cuda_index(cfg.model.device)
        if index is None:
            raise SyncError(
                f"cuda_ipc: the trainer's model.device is {cfg.model.device!r}; versions go "
                "device to device only from a CUDA device torch can use"
            )
        self.device = torch.device("cuda", index)
        self.gpu = normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))
        self.host = host_id(cfg)
        self.lease_wait_s = lease_wait_s
        run = cfg.topics().run
        remove_leftovers(run, folder)
        stem = f"{file_prefix(run)}{os.getpid()}-"
        self.leases = [os.path.join(folder, f"{stem}{name}") for name in LEASE_SLOTS]
        self._fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in self.leases]
        for fd in self._fds:
            write_stamp(fd, -1, 0)
        self._slots: list[torch.Tensor | None] = [None, None]
        self._handles: list[IpcHandle | None] = [None, None]
        self._newest: int | None = None
        self._stream: torch.cuda.Stream | None = None
        self._closed = False

    async def send(self, make: MakePayload, announce: Announce) -> ModelVersionReady:
        payload = make(False)
        if payload.lora:
            raise SyncError("cuda_ipc carries full versions (a LoRA run's adapters: shared)")
        slot, digest, nbytes = await asyncio.to_thread(
            self._write, payload.tensors, payload.version
        )
        handle = self._handles[slot]
        assert handle is not None
        ref = SlotRef(self.host, os.path.basename(self.leases[slot]), self.gpu, handle)
        event = ModelVersionReady(
            version=payload.version,
            method=self.method,
            uri=format_uri(ref),
            manifest_sha256=digest,
            bytes=nbytes,
            step=payload.step,
            created_at=time.time(),
            base_version=payload.base_version,
        )
        await announce(event)
        return event

    def _write(self, tensors: Mapping[str, torch.Tensor], version: int) -> tuple[int, str, int]:
        """Into a slot no reader holds: the version's image, its digest, then its stamp."""
        if self._closed:
            raise SyncError("the cuda_ipc sender is closed")
        order = slot_order(self._newest)
        slot = take_slot(order, lambda s: try_exclusive(self._fds[s]), self.lease_wait_s)
        if slot is None:
            raise SlotBusy(
                f"cuda_ipc: both slots stayed held by readers for {self.lease_wait_s:.0f}s"
            )
        fd = self._fds[slot]
        try:
            write_stamp(fd, -1, 0)
            head, ordered, nbytes = image_layout(tensors)
            buf = self._slot(slot, nbytes)
            digest = self._fill(buf, head, ordered)
            handle = self._handles[slot]
            assert handle is not None
            write_stamp(fd, version, nbytes, handle.storage_bytes, handle.storage_offset)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._newest = slot
        return slot, digest, nbytes

    def _slot(self, slot: int, nbytes: int) -> torch.Tensor:
        """Slot ``slot`` of exactly ``nbytes`` (made, and its IPC handle taken, when new)."""
        buf = self._slots[slot]
        if buf is not None and buf.numel() == nbytes:
            return buf
        self._slots[slot] = self._handles[slot] = None  # the old one goes first
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise SyncError(
                f"cuda_ipc: no room on {self.device} for a {nbytes >> 20} MiB slot: {exc}"
            ) from exc
        self._handles[slot] = IpcHandle(*buf.untyped_storage()._share_cuda_())
        self._slots[slot] = buf
        return buf

    def _fill(self, buf: torch.Tensor, head: bytes, ordered: list[torch.Tensor]) -> str:
        """:func:`fill_image` on a stream of this sender's (the trainer's kernels do not wait
        for it), then the digest there; returns once both are done."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # sources made on the GPU
        with torch.cuda.stream(stream):
            fill_image(buf, head, ordered)
            digest = device_digest(buf)
        stream.synchronize()
        return digest

    def close(self) -> None:
        """Mark both slots empty under their leases (a reader copying now finishes first,
        for :data:`CLOSE_WAIT_S` at most), remove the lease files, free the slots."""
        if self._closed:
            return
        self._closed = True
        for fd in self._fds:
            if take_slot((fd,), try_exclusive, CLOSE_WAIT_S) is not None:
                write_stamp(fd, -1, 0)
        for fd, path in zip(self._fds, self.leases, strict=True):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.close(fd)  # its lease with it
        self._slots = [None, None]


def device_sender(cfg: Config) -> CudaIpcSender | None:
    """``auto``'s device path: a :class:`CudaIpcSender` when :func:`uses_device_path` says
    so, else None (with a warning when it should have and could not start)."""
    if not uses_device_path(cfg.model.device, cfg.model.lora.enabled, torch.cuda.is_available()):
        return None
    try:
        return CudaIpcSender(cfg, LEASE_WAIT_S)
    except SyncError as exc:
        log.warning("auto: no device-to-device path (%s); shared memory and the store", exc)
        return None


class CudaIpcReceiver(WeightReceiver):
    """Explorer side: map a slot of the trainer's GPU, copy it into memory of its own on this
    explorer's GPU under the slot's lease, check the digest, decode views of the copy. The
    copy (one buffer, reused) is valid until the next receive."""

    needs_template = True
    reuses_buffers = True

    def __init__(self, cfg: Config, folder: str = SHM_DIR) -> None:
        self.folder = folder
        self.host = host_id(cfg)
        self.device = cfg.model.device
        self._mapped: dict[str, tuple[tuple[bytes, int, int], torch.Tensor]] = {}
        """Slots mapped, by lease file name: ((handle, offset, size), the slot as uint8); the
        newest two."""
        self._buffer: torch.Tensor | None = None
        self._bounce: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    # -- what it can load ------------------------------------------------------------------
    def refusal(self, event: ModelVersionReady) -> str | None:
        try:
            parse_uri(event.uri)
        except IntegrityError as exc:
            return str(exc)
        return None

    def _route(self, ref: SlotRef) -> tuple[int, int, Route] | None:
        """(this explorer's GPU, the slot's GPU as this process numbers it, how to copy);
        None when the slot cannot reach this explorer's model."""
        own = cuda_index(self.device)
        if own is None:
            return None
        source = local_index(ref.gpu, visible_gpus())
        if source is None:
            return None
        peer = own != source and torch.cuda.can_device_access_peer(own, source)
        return own, source, copy_route(own, source, peer)

    def can_load(self, event: ModelVersionReady) -> bool:
        try:
            ref = parse_uri(event.uri)
        except IntegrityError:
            return False
        if ref.host != self.host or not os.path.exists(os.path.join(self.folder, ref.slot)):
            return False
        return self._route(ref) is not None

    # -- receiving -------------------------------------------------------------------------
    def receive(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        ref, own, source, route = self._checked(event, like)
        buf = self._buffer
        if buf is None or buf.numel() != event.bytes or buf.device.index != own:
            self._buffer = None
            buf = self._buffer = allocated(
                lambda: torch.empty(event.bytes, dtype=torch.uint8, device=own),
                event.bytes,
                "a receive buffer on the GPU",
            )
        return self._copy_verified(event, ref, like, buf, source, route)

    def receive_into(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor], stage: Stage
    ) -> dict[str, torch.Tensor]:
        """Into the stage's memory for versions read from a device (on this explorer's GPU
        whenever a version fits there, whatever ``synchronizer.staging`` says: see
        :mod:`.staging`) directly, no buffer of its own; when that is host memory (the
        version did not fit): :meth:`receive`, then a copy into the stage."""
        memory = stage.from_device
        if not copies_into(cuda_index(self.device), memory.device):
            return super().receive_into(event, like, stage)
        ref, _own, source, route = self._checked(event, like)
        flat = torch.empty(event.bytes, dtype=torch.uint8, device="meta")
        buf = stage.like({_STAGE_NAME: flat}, memory)[_STAGE_NAME]
        return self._copy_verified(event, ref, like, buf, source, route)

    def _checked(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor]
    ) -> tuple[SlotRef, int, int, Route]:
        what = f"version {event.version} on the trainer's GPU"
        ref = parse_uri(event.uri)
        if ref.host != self.host:
            raise SyncError(f"{what}: {ref.host} is not this host ({self.host})")
        route = self._route(ref)
        if route is None:
            raise SyncError(f"{what}: GPU {ref.gpu} is not visible to this explorer")
        limit = largest_version(like)
        if not 0 < event.bytes <= min(limit, ref.ipc.storage_bytes):
            raise IntegrityError(
                f"{what}: {event.bytes} bytes announced; this model's tensors are {limit} at "
                f"most, the slot {ref.ipc.storage_bytes}: refusing to copy"
            )
        return ref, *route

    def _copy_verified(
        self,
        event: ModelVersionReady,
        ref: SlotRef,
        like: Mapping[str, torch.Tensor],
        buf: torch.Tensor,
        source: int,
        route: Route,
    ) -> dict[str, torch.Tensor]:
        what = f"version {event.version} on the trainer's GPU"
        if self._stream is None:
            self._stream = torch.cuda.Stream(buf.device)
        lease = os.path.join(self.folder, ref.slot)
        return copy_verified(
            event,
            lambda: self._map(ref, source, what),  # once the lease says the slot is this
            buf,
            lease,
            like,
            lambda d, s: self._copy(d, s, route),
            self._stream,
            (ref.ipc.storage_bytes, ref.ipc.storage_offset),
        )

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, route: Route) -> None:
        if route != "host":  # one GPU, or two with peer access: the driver copies directly
            dst.copy_(src, non_blocking=True)
            return
        if self._bounce is None:
            self._bounce = allocated(
                lambda: torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True),
                BOUNCE_BYTES,
                "a pinned bounce buffer",
            )
        bounce, stream = self._bounce, torch.cuda.current_stream(dst.device)
        for lo in range(0, src.numel(), BOUNCE_BYTES):
            piece = src[lo : lo + BOUNCE_BYTES]
            bounce[: piece.numel()].copy_(piece)  # waits: the buffer is reused next piece
            dst[lo : lo + piece.numel()].copy_(bounce[: piece.numel()], non_blocking=True)
            stream.synchronize()

    def _map(self, ref: SlotRef, source: int, what: str) -> torch.Tensor:
        """The slot as a uint8 tensor in this process, mapped once per slot, handle, offset
        and size (torch caches mappings by handle and offset: a new slot in the block of an
        old one has the handle and may have the offset of the old one, which is dropped
        first, so torch's cache cannot hand it back); the newest two kept (a restarted
        trainer's slots replace the old ones)."""
        ipc = ref.ipc
        key = (ipc.handle, ipc.storage_offset, ipc.storage_bytes)
        held = self._mapped.get(ref.slot)
        if held is not None and held[0] == key:
            return held[1]
        self._mapped.pop(ref.slot, None)  # unmapped (torch's cache forgets it) before anew
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        try:
            slot = rebuild_cuda_tensor(
                torch.Tensor,
                (ipc.storage_bytes,),
                (1,),
                0,
                torch.storage.TypedStorage,
                torch.uint8,
                source,
                ipc.handle,
                ipc.storage_bytes,
                ipc.storage_offset,
                False,
                ipc.ref_counter,
                ipc.ref_counter_offset,
                ipc.event,
                ipc.event_sync,
            )
        except RuntimeError as exc:  # the driver refused the handle
            raise IntegrityError(f"{what}: its IPC handle does not map here: {exc}") from exc
        if slot.numel() != ipc.storage_bytes:  # an older mapping torch kept alive elsewhere
            raise IntegrityError(f"{what}: mapped {slot.numel()} bytes, not {ipc.storage_bytes}")
        self._mapped[ref.slot] = (key, slot)
        while len(self._mapped) > len(LEASE_SLOTS):
            self._mapped.pop(next(iter(self._mapped)))
        return slot

    def close(self) -> None:
        self._mapped.clear()
        self._buffer = self._bounce = None
