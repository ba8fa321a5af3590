"""The ``shared`` transport: versions through shared memory on the trainer's host.

The trainer writes each version into one of two files in ``/dev/shm`` (tmpfs: host memory,
no disk), alternating, so that the version being read is never the one being written; the
event names the file and the host (``shm://<host id>/<file>``) and carries the file's
xxh3-128 digest, computed once by the trainer as it writes. An explorer on the same host
(``run.host_id`` equal, and the file visible: a container with its own ``/dev/shm`` is not
the same host) copies the file once, into its staging copy (or, ``staging: none``, a
buffer of its own), hashing each piece as it lands, and decodes it only when the digest
matches. Both sides keep the files mapped from one version to the next (:mod:`.mapped`):
each hand-off is a ``memcpy`` and a hash of what is still in the cache. A reader that took longer than one version
period finds the file rewritten under it: the digest fails, the version is rejected like
a corrupted shard, and the explorer takes the version's store copy (``synchronizer.method:
auto``) or the next one.

A file is a safetensors file (the same bytes the stores keep), so the format has one
decoder. Files are named ``streamrft-<run id>-<trainer pid>-<slot>``; a trainer removes its
own at exit and, at start, any its run left behind (a trainer killed with SIGKILL).

Costs: two copies of the weights (in the explorers' dtype) in the trainer host's memory
for the files, and on each same-host explorer its staging copy of a version's size (two
for a LoRA run, whose adapter comes with its base). The digest catches any change of
the bytes between write and read (a torn read of a rewritten file, a flipped bit); it is
not a defence against a hostile process on the host, which could also write the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import xxhash

from streamrft.infra.config import Config
from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.mapped import Mappings, copy_hashed
from streamrft.sync.shm_files import SHM_DIR, SLOTS, file_prefix, is_version_file, remove_leftovers
from streamrft.sync.staging import Stage, allocated
from streamrft.sync.transport import Announce, MakePayload, WeightReceiver, WeightSender
from streamrft.sync.weights import Shard, checked_image, largest_version, make_shard

log = logging.getLogger(__name__)

SCHEME = "shm://"


def host_id(cfg: Config) -> str:
    """This machine's identity: ``run.host_id``, else the host name and the kernel's boot
    id (two containers with one host name but separate kernels differ)."""
    if cfg.run.host_id:
        return cfg.run.host_id
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    return f"{socket.gethostname()}-{boot}" if boot else socket.gethostname()


def parse_uri(uri: str) -> tuple[str, str]:
    """``(host id, file name)`` of a ``shm://`` uri; SyncError when it is not one."""
    if not uri.startswith(SCHEME):
        raise SyncError(f"not a shared-memory uri: {uri!r}")
    host, _, name = uri[len(SCHEME) :].partition("/")
    if not host or not name or "/" in name or name.startswith("."):
        raise SyncError(f"malformed shared-memory uri: {uri!r}")
    return host, name


def open_regular(path: str, what: str) -> int:
    """``path`` opened for reading when it is a regular file itself: never through a symbolic
    link (one planted under a version file's name would redirect the read), never blocking
    (a FIFO would hold the open, and every read after it, for ever). Anything else is an
    IntegrityError of the announcement naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:  # gone, or a symbolic link (ELOOP)
        raise IntegrityError(f"{what}: cannot open {path}: {exc}") from exc
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise IntegrityError(f"{what}: {path} is not a regular file: refused")
    return fd


def _write_hashed(into: memoryview, shard: Shard) -> str:
    """Copy ``shard``'s pieces into ``into`` (a mapped file of its size) from its start,
    hashing each piece right after it landed (while it is in the cache); the xxh3-128 hex
    digest."""
    digest = xxhash.xxh3_128()
    offset = 0
    for chunk in shard.chunks:
        raw = chunk.cast("B")
        copy_hashed(into[offset : offset + raw.nbytes], raw, digest)
        offset += raw.nbytes
    return digest.hexdigest()


class SharedSender(WeightSender):
    """Trainer side: each version into the next of two files in ``/dev/shm``, then its event."""

    method = "shared"

    def __init__(self, cfg: Config, folder: str = SHM_DIR) -> None:
        self.folder = folder
        self.host = host_id(cfg)
        self.run_id = cfg.topics().run
        self.lora = cfg.model.lora.enabled
        remove_leftovers(self.run_id, folder)
        stem = f"{file_prefix(self.run_id)}{os.getpid()}-"
        self.paths = {slot: os.path.join(folder, f"{stem}{slot}") for slot in SLOTS}
        self._next = 0
        self._closed = False
        self._maps = Mappings()
        self._writing = threading.Lock()
        """Held while a version is copied into a mapping: :meth:`close` unmaps only then."""

    async def send(self, make: MakePayload, announce: Announce) -> ModelVersionReady:
        payload = make(False)
        if self.lora and not payload.lora:  # a base: later adapters name it
            path = self.paths["base"]
        else:
            path = self.paths[SLOTS[self._next]]
            self._next ^= 1
        # tensors only: the files a store version keeps beside them (a LoRA adapter's
        # config) are for export, not needed to apply it
        shard = make_shard(payload.tensors, list(payload.tensors))
        digest = await asyncio.to_thread(self._write, path, shard)
        event = ModelVersionReady(
            version=payload.version,
            method=self.method,
            uri=f"{SCHEME}{self.host}/{os.path.basename(path)}",
            manifest_sha256=digest,
            bytes=shard.nbytes,
            step=payload.step,
            lora=payload.lora,
            created_at=time.time(),
            base_version=payload.base_version,
        )
        await announce(event)
        return event

    def _write(self, path: str, shard: Shard) -> str:
        """The file of one version (its pages reserved first: a /dev/shm too small fails
        here, with an error, not later in the middle of the copy), written through a
        mapping kept for the next version in it; its digest."""
        if self._closed:
            raise SyncError("the shared sender is closed")
        try:
            with self._writing:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    size = os.fstat(fd).st_size
                    if size != shard.nbytes:  # new, or another size: reserve
                        if size:  # readers may map it: never shrink it, make a new one
                            os.close(fd)
                            os.unlink(path)
                            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                        os.ftruncate(fd, shard.nbytes)
                        os.posix_fallocate(fd, 0, shard.nbytes)
                    mapped = self._maps.get(path, fd, writable=True)
                finally:
                    os.close(fd)
                digest = _write_hashed(mapped.view, shard)
            if self._closed:  # closed while writing: leave nothing behind
                self.close()
            return digest
        except OSError as exc:
            raise SyncError(
                f"cannot write a {shard.nbytes >> 20} MiB version to {path}: {exc} (is "
                f"{self.folder} large enough? containers: --shm-size)"
            ) from exc

    def close(self) -> None:
        self._closed = True
        for path in self.paths.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self._writing.acquire(blocking=False):  # else the writer unmaps when it is done
            try:
                self._maps.close()
            finally:
                self._writing.release()


class SharedReceiver(WeightReceiver):
    """Explorer side: read a version's file on this host into a buffer of its own, check
    its digest, decode views of it. :meth:`receive`'s buffers (two, taken in turn: an
    adapter's base and the adapter are both held until applied) are reused version after
    version, so the tensors it returns are valid until the receive after next;
    :meth:`receive_into` reads into the stage's bytes instead."""

    needs_template = True
    reuses_buffers = True

    def __init__(self, cfg: Config, folder: str = SHM_DIR) -> None:
        self.folder = folder
        self.host = host_id(cfg)
        self.run_id = cfg.topics().run
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._maps = Mappings()
        self._reading = threading.Lock()
        """Held while a file is copied out of its mapping: :meth:`close` unmaps only then."""
        self._closed = False

    def refusal(self, event: ModelVersionReady) -> str | None:
        """A file that is not one of this run's version files is never mapped (another
        program's, which may shrink it under the mapping: SIGBUS)."""
        try:
            _host, name = parse_uri(event.uri)
        except SyncError as exc:
            return str(exc)
        if not is_version_file(self.run_id, name):
            return f"{name[:80]!r} is not a version file of this run in {self.folder}"
        return None

    def _path(self, event: ModelVersionReady) -> str | None:
        """The file ``event`` names if it is on this host (None: another host's, or not a
        version file of this run)."""
        try:
            host, name = parse_uri(event.uri)
        except SyncError:
            return None
        if host != self.host or not is_version_file(self.run_id, name):
            return None
        return os.path.join(self.folder, name)

    def can_load(self, event: ModelVersionReady) -> bool:
        path = self._path(event)
        return path is not None and os.path.exists(path)

    def receive(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return self._receive(event, like, self._buffer)

    def receive_into(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor], stage: Stage
    ) -> dict[str, torch.Tensor]:
        """Read into the stage's host bytes (one copy, hashed as it goes); the tensors are
        views of them (copied to the device only with device staging)."""
        return stage.adopt(self._receive(event, like, stage.host_bytes))

    def _receive(
        self,
        event: ModelVersionReady,
        like: Mapping[str, torch.Tensor],
        buffer: Callable[[int], torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        what = f"version {event.version} in shared memory"
        why = self.refusal(event)
        if why is not None:
            raise IntegrityError(f"{what}: {why}: refused")
        path = self._path(event)
        if path is None:
            raise SyncError(f"{what}: {event.uri} is not on this host ({self.host})")
        limit = largest_version(like)
        if not 0 < event.bytes <= limit:
            raise IntegrityError(
                f"{what}: {event.bytes} bytes announced; this model's tensors are {limit} "
                "at most: refusing to allocate"
            )
        buf = buffer(event.bytes)
        digest = self._read_hashed(path, buf, what)
        why = "rewritten while read, or corrupted"
        return checked_image(buf, digest, event.manifest_sha256, what, like, why)

    def _buffer(self, size: int) -> torch.Tensor:
        turn, self._turn = self._turn, self._turn ^ 1
        buf = self._buffers[turn]
        if buf is None or buf.numel() != size:
            self._buffers[turn] = None  # the old one is freed before the new one is made
            buf = self._buffers[turn] = allocated(
                lambda: torch.empty(size, dtype=torch.uint8), size, "a receive buffer"
            )
        return buf

    def _read_hashed(self, path: str, buf: torch.Tensor, what: str) -> str:
        """Copy the file into ``buf`` (its exact size) from a mapping kept for the next
        version in it, hashing each piece as it lands."""
        view = memoryview(buf.numpy()).cast("B")
        digest = xxhash.xxh3_128()
        fd = open_regular(path, what)  # gone: the trainer restarted, or a newer one replaced it
        with self._reading:
            try:
                size = os.fstat(fd).st_size
                if size != view.nbytes:
                    raise IntegrityError(
                        f"{what}: the file holds {size} bytes, the event says "
                        f"{view.nbytes} (rewritten by a newer version)"
                    )
                mapped = self._maps.get(path, fd)
            finally:
                os.close(fd)
            copy_hashed(view, mapped.view, digest)
            if self._closed:  # closed meanwhile: nothing stays mapped
                self._maps.close()
        return digest.hexdigest()

    def release_unused(self) -> None:
        """Unmap the files the trainer removed or replaced (their memory is freed only once
        no mapping holds it: a stopped trainer's files stayed allocated until the next
        shared-memory receive, or for ever); a copy under way prunes them itself."""
        if self._reading.acquire(blocking=False):
            try:
                self._maps.prune()
            finally:
                self._reading.release()

    def close(self) -> None:
        """Unmap the files (a copy under way unmaps them when it ends); twice is safe."""
        self._closed = True
        if self._reading.acquire(blocking=False):
            try:
                self._maps.close()
            finally:
                self._reading.release()
