"""Weight broadcast over torch.distributed: trainer (rank 0) to explorers (ranks 1..n).

NCCL on GPUs, gloo on CPU, one code path. Design choices and the protocol:

**Groups without the default group.** A process can hold a single default process group
and vLLM (and a multi-GPU trainer) may already own it, so this module never calls
``init_process_group``. Each *group epoch* builds its own backend object directly
(``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a ``PrefixStore``) and drops it (``abort``)
when the epoch ends; nothing global is touched.

**Rendezvous.** The sender hosts a ``TCPStore`` (``is_master=True``) at ``host:port``; port 0
picks a free port and a new store for every epoch, a fixed port keeps one store for the
sender's life. Every epoch lives under its own store namespace ``streamrft/epoch/<epoch>``
and epochs are millisecond timestamps, strictly increasing, so a re-formed group (or a
restarted trainer on the same port) never collides with an old one. The epoch travels to
the explorers inside ``ModelVersionReady.uri`` as
``gloo://HOST:PORT/EPOCH?members=explorer-0,explorer-1``; the rank of a member is
1 + its index in ``members``, the world size 1 + len(members).

**Every collective is gated through the store**, so a missing peer is found by a store
wait with a deadline, never by a collective that hangs, and a timed-out version leaves no
half-posted collective behind:

1. join (once per epoch): each member sets ``join/<rank>`` and waits for ``formed``; the
   sender (inside its first ``broadcast``) waits for every ``join`` key, sets ``formed`` to
   ``go`` and all build the process group (gloo connects its full mesh here).
2. per version V: each member sets ``vV/ready/<rank>`` to the sha256 of its own sorted
   (name, shape, dtype) list and waits for ``vV/go``; the sender waits for every ready key,
   compares digests and sets ``vV/go`` to ``go``, or to ``abort:timeout:...`` /
   ``abort:mismatch:...`` (the sender raises ``SyncTimeout`` / ``SyncError``, waiting
   members raise the same, a late member reads the abort at once; the epoch stays usable).
3. transfer: a header (int64: magic, version, bucket bytes, tensor count, digest) is
   broadcast and checked, then the buckets (:func:`plan_buckets`), one ``broadcast`` call
   each: tensors grouped by dtype, sorted by name; a tensor of at least 1 MiB (or a
   bucket, if smaller) has buckets of its own, chunks of at most ``bucket_mb`` that go on
   the wire IN PLACE on both sides when the tensor is contiguous and on the wire's device
   (no copy at all); smaller tensors are packed into shared buckets (a copy costs less
   than a call). Packed buckets go through ``IN_FLIGHT`` (2) staging buffers reused from
   version to version, and ``IN_FLIGHT`` broadcasts are posted ahead (``async``), so the
   sender packs bucket i+1 while bucket i is on the wire and the receiver unpacks bucket
   i while bucket i+1 arrives. The bytes on the wire are the tensors' own, so both sides
   agree whatever their layouts; a non-contiguous tensor is staged.
4. each member sets ``vV/done/<rank>``; ``broadcast`` returns when all did.

Join and ready share one deadline of ``timeout_s`` per ``broadcast``; every collective has
its own ``timeout_s``. A failure before the group formed, or during the transfer, closes the
epoch on the sender (``broadcast`` then raises ``SyncError`` until ``open_epoch``) and makes
receivers drop their group and join afresh at the next uri. After such a failure a
receiver's tensors may hold a mix of two versions: the caller must load a whole version
(the object store fallback) before using them. Versions must strictly increase within an
epoch; every member of the epoch must call ``receive`` for every version broadcast in it.

Usage: the trainer calls ``open_epoch`` (when membership changes or after a failure), emits
``ModelVersionReady(method="nccl", uri=<that uri>, ...)``, then ``broadcast`` (it blocks
until all members have the version; run it off the training thread if that matters). Both
sides must pass the same tensor names (no tied aliases twice). Neither class is
thread-safe. Only the gloo path is exercised by the tests (CPU); NCCL shares the code.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import urllib.parse
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from streamrft.infra.net import local_address_towards
from streamrft.schemas.errors import SyncError, SyncTimeout

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
_MAGIC = 0x53524654_31574232  # "SRFT1WB2" (bucket plan 2: big tensors in buckets of their own)
DIRECT_MIN_BYTES = 1 << 20
"""A tensor of at least this size (or a bucket's, if smaller) gets buckets of its own and is
broadcast in place; smaller ones are packed together (a copy is cheaper than a call)."""
IN_FLIGHT = 2
"""Broadcasts posted ahead of the one being waited on: while one bucket is on the wire the
next is packed (sender) or the last one unpacked (receiver)."""
_NAMESPACE = "streamrft/epoch"
_GO = "go"
_ABORT_TIMEOUT = "abort:timeout:"
_ABORT_MISMATCH = "abort:mismatch:"


# ------------------------------------------------------------------------ device identity


class SameDeviceError(SyncError):
    """Members of a group sit on the trainer's GPU or share one (NCCL refuses a group with
    two ranks on one device: "Duplicate GPU detected"). ``members``: the ones to serve
    another way."""

    def __init__(self, message: str, members: Sequence[str]) -> None:
        super().__init__(message)
        self.members = tuple(members)


def device_identity(backend: str) -> str:
    """What a process broadcasts on: the UUID of its current CUDA device for ``nccl``,
    ``""`` for ``gloo`` (host memory: any number of ranks per host)."""
    if backend != "nccl" or not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def sharing_a_device(own: str, joined: Mapping[str, str]) -> list[str]:
    """The members (``joined``: member -> device identity) on the device ``own`` (the
    trainer's) or on one another member also uses; none when identities are empty."""
    if not own and not any(joined.values()):
        return []
    seen: dict[str, int] = {}
    for device in joined.values():
        if device:
            seen[device] = seen.get(device, 0) + 1
    return sorted(
        m for m, device in joined.items() if device and (device == own or seen[device] > 1)
    )


# --------------------------------------------------------------------------- rendezvous


@dataclass(frozen=True)
class Rendezvous:
    """One group epoch, as named by a rendezvous uri."""

    backend: str
    host: str
    port: int
    epoch: int
    members: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return 1 + len(self.members)

    def rank_of(self, member: str) -> int:
        """1 + the index of ``member`` in ``members``; SyncError if it is not one."""
        try:
            return 1 + self.members.index(member)
        except ValueError:
            raise SyncError(
                f"{member!r} is not a member of weight-sync epoch {self.epoch} "
                f"(members: {', '.join(self.members)})"
            ) from None

    @property
    def uri(self) -> str:
        return rendezvous_uri(self.backend, self.host, self.port, self.epoch, self.members)


def _check_members(members: Sequence[str]) -> tuple[str, ...]:
    out = tuple(members)
    if not out:
        raise SyncError("a weight-sync epoch needs at least one member")
    if any(not isinstance(m, str) or not m for m in out):
        raise SyncError(f"member ids must be non-empty strings: {list(out)!r}")
    if len(set(out)) != len(out):
        raise SyncError(f"member ids must be unique: {list(out)!r}")
    return out


def rendezvous_uri(backend: str, host: str, port: int, epoch: int, members: Sequence[str]) -> str:
    """``gloo://127.0.0.1:PORT/EPOCH?members=explorer-0,explorer-1`` (members %-quoted)."""
    if backend not in BACKENDS:
        raise SyncError(f"unknown collective backend {backend!r} (expected one of {BACKENDS})")
    if not host:
        raise SyncError("rendezvous host is empty")
    if not 0 < int(port) < 65536:
        raise SyncError(f"rendezvous port {port} out of range 1..65535")
    if int(epoch) < 0:
        raise SyncError(f"rendezvous epoch {epoch} is negative")
    ms = _check_members(members)
    netloc = f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"
    query = ",".join(urllib.parse.quote(m, safe="") for m in ms)
    return f"{backend}://{netloc}/{int(epoch)}?members={query}"


def parse_rendezvous(uri: str) -> Rendezvous:
    """The inverse of :func:`rendezvous_uri`; SyncError on anything malformed."""
    if not isinstance(uri, str):
        raise SyncError(f"rendezvous uri must be a string, got {type(uri).__name__}")
    try:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port
        host = parts.hostname
    except ValueError as exc:
        raise SyncError(f"malformed rendezvous uri {uri!r}: {exc}") from exc
    if parts.scheme not in BACKENDS:
        raise SyncError(f"rendezvous uri {uri!r}: scheme must be one of {BACKENDS}")
    if not host or port is None or port == 0 or parts.username or parts.password:
        raise SyncError(f"rendezvous uri {uri!r}: needs exactly host:port (port 1..65535)")
    epoch_s = parts.path[1:] if parts.path.startswith("/") else ""
    if not epoch_s.isdigit() or not epoch_s.isascii():
        raise SyncError(f"rendezvous uri {uri!r}: path must be /<epoch number>")
    if parts.fragment:
        raise SyncError(f"rendezvous uri {uri!r}: unexpected fragment")
    try:
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise SyncError(f"rendezvous uri {uri!r}: bad query: {exc}") from exc
    if set(query) != {"members"} or len(query["members"]) != 1:
        raise SyncError(f"rendezvous uri {uri!r}: query must be exactly members=a,b,...")
    # parse_qs already %-decoded the value; members are split on the raw commas
    raw = parts.query[len("members=") :].split(",")
    members = _check_members([urllib.parse.unquote(m) for m in raw])
    return Rendezvous(parts.scheme, host, port, int(epoch_s), members)


# ------------------------------------------------------------------------------ buckets


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + numel)`` of tensor ``name`` (flattened) at ``offset``."""

    name: str
    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """(name, shape, dtype) of every tensor, sorted by name: the order of the wire."""
    return [
        TensorSpec(name, tuple(int(s) for s in tensors[name].shape), tensors[name].dtype)
        for name in sorted(tensors)
    ]


def spec_digest(specs: Sequence[TensorSpec]) -> bytes:
    """sha256 over the sorted (name, shape, dtype) list; equal models have equal digests."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}\t{','.join(map(str, s.shape))}\t{s.dtype}\n".encode())
    return h.digest()


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Tensors, grouped by dtype, in buckets of at most ~``bucket_bytes`` each.

    Deterministic for a given spec list. A tensor of at least ``min(bucket_bytes,
    DIRECT_MIN_BYTES)`` gets buckets of its own (one segment each, a tensor larger than a
    bucket split across several), so a contiguous tensor goes on the wire in place, with no
    copy; smaller tensors are packed together into shared buckets, so that many tiny
    tensors cost a few broadcast calls. Empty tensors take no room.
    """
    if bucket_bytes <= 0:
        raise SyncError(f"bucket size must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[TensorSpec]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for s in specs:
        by_dtype.setdefault(str(s.dtype), []).append(s)
        dtypes[str(s.dtype)] = s.dtype
    own_min = min(bucket_bytes, DIRECT_MIN_BYTES)
    buckets: list[Bucket] = []
    for key in sorted(by_dtype):
        dtype = dtypes[key]
        item = _itemsize(dtype)
        cap = max(1, bucket_bytes // item)
        segs: list[Segment] = []
        fill = 0
        for s in by_dtype[key]:
            if s.numel * item >= own_min:
                for start in range(0, s.numel, cap):
                    n = min(cap, s.numel - start)
                    buckets.append(Bucket(dtype, n, (Segment(s.name, start, n, 0),)))
                continue
            start = 0
            while start < s.numel:
                n = min(s.numel - start, cap - fill)
                segs.append(Segment(s.name, start, n, fill))
                start += n
                fill += n
                if fill == cap:
                    buckets.append(Bucket(dtype, fill, tuple(segs)))
                    segs, fill = [], 0
        if segs:
            buckets.append(Bucket(dtype, fill, tuple(segs)))
    return buckets


def direct_view(
    bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """The bucket's bytes as a view of the tensor itself when it is one segment of a
    contiguous tensor on ``device`` (broadcast in place, no copy); else None."""
    if len(bucket.segments) != 1:
        return None
    seg = bucket.segments[0]
    t = tensors[seg.name].detach()
    if not t.is_contiguous() or t.device != device:
        return None
    return t.view(-1)[seg.start : seg.start + seg.numel]


@torch.no_grad()
def flatten_bucket(
    bucket: Bucket,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One contiguous 1-D buffer on ``device`` holding the bucket's slices (written into
    ``out``, a 1-D buffer of the bucket's dtype and size, when given)."""
    buf = torch.empty(bucket.numel, dtype=bucket.dtype, device=device) if out is None else out
    srcs = [
        tensors[seg.name].detach().reshape(-1)[seg.start : seg.start + seg.numel]
        for seg in bucket.segments
    ]
    if all(src.device == buf.device for src in srcs):
        torch.cat(srcs, out=buf)  # one call: faster than a copy per segment
        return buf
    for seg, src in zip(bucket.segments, srcs, strict=True):
        buf[seg.offset : seg.offset + seg.numel].copy_(src)
    return buf


@torch.no_grad()
def unflatten_bucket(
    bucket: Bucket,
    buf: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    staging: dict[str, torch.Tensor] | None = None,
) -> None:
    """Copy the bucket's slices into ``tensors`` IN PLACE (any device, any layout).

    A non-contiguous tensor split across buckets is assembled in ``staging`` (pass the same
    dict for every bucket of one transfer) and copied in when its last slice arrives. A
    ``buf`` that already is the tensor's memory (received in place) is left as it is.
    """
    staging = {} if staging is None else staging
    for seg in bucket.segments:
        dst = tensors[seg.name]
        src = buf[seg.offset : seg.offset + seg.numel]
        total = dst.numel()
        if dst.is_contiguous() and src.data_ptr() == dst.data_ptr() + seg.start * src.itemsize:
            continue  # received in place
        if seg.start == 0 and seg.numel == total:
            dst.copy_(src.view(dst.shape))
        elif dst.is_contiguous():
            dst.view(-1)[seg.start : seg.start + seg.numel].copy_(src)
        else:
            stage = staging.get(seg.name)
            if stage is None:
                stage = staging[seg.name] = torch.empty(
                    dst.shape, dtype=dst.dtype, device=dst.device
                )
            stage.view(-1)[seg.start : seg.start + seg.numel].copy_(src)
            if seg.start + seg.numel == total:
                dst.copy_(staging.pop(seg.name))


def _digest_words(digest: bytes) -> list[int]:
    return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _header(version: int, bucket_bytes: int, specs: Sequence[TensorSpec]) -> list[int]:
    return [_MAGIC, int(version), int(bucket_bytes), len(specs), *_digest_words(spec_digest(specs))]


# ------------------------------------------------------------------------ process groups


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=max(float(seconds), 0.001))


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def _gloo_devices(bind_host: str) -> list[Any]:
    ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if ifnames:
        return [dist.ProcessGroupGloo.create_device(interface=i) for i in ifnames.split(",")]
    if bind_host and bind_host not in ("0.0.0.0", "::"):
        return [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return [dist.ProcessGroupGloo.create_default_device()]


def _make_group(backend: str, store: Any, rank: int, size: int, timeout_s: float, bind: str):
    """A standalone backend object (no default group, nothing global touched)."""
    internal = _internal_timeout(backend, timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = _gloo_devices(bind)
        opts._timeout = internal
        opts._threads = 2
        return dist.ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise SyncError("nccl weight sync needs CUDA and a torch built with NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = internal
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise SyncError(f"unknown collective backend {backend!r}")


def _buffer_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _internal_timeout(backend: str, timeout_s: float) -> timedelta:
    """The backend's own timeout. gloo: ours (a timed-out gloo op closes its connections, so
    peers fail fast too). NCCL: longer than ours, so our ``Work.wait`` fires first and we
    abort the communicator before the NCCL watchdog tears the whole process down."""
    return _td(timeout_s) if backend == "gloo" else _td(2 * timeout_s + 30)


def _post(pg: Any, backend: str, tensor: torch.Tensor, timeout_s: float) -> Any:
    """Post one broadcast from rank 0 (as bytes: dtype-agnostic); its work handle."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = _internal_timeout(backend, timeout_s)
    return pg.broadcast([tensor.view(torch.uint8)], opts)


def _wait_work(work: Any, timeout_s: float) -> None:
    if not work.wait(_td(timeout_s)):
        raise TimeoutError(f"broadcast did not complete within {timeout_s:.1f}s")


class _Staging:
    """``IN_FLIGHT`` reusable byte buffers for packed buckets, taken in turn: one is packed
    (or unpacked) while the others are on the wire. Kept between versions on the CPU, where
    a fresh buffer costs more in page faults than the copy into it; given back after each
    version on a GPU (the caching allocator reuses the memory anyway)."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._turn = 0

    def reserve(self, nbytes: int, device: torch.device) -> None:
        if nbytes and (
            not self._bufs or self._bufs[0].device != device or self._bufs[0].numel() < nbytes
        ):
            self._bufs = []  # drop the old ones first: at most one set alive
            self._bufs = [
                torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(IN_FLIGHT)
            ]

    def take(self, bucket: Bucket) -> torch.Tensor:
        buf = self._bufs[self._turn]
        self._turn = (self._turn + 1) % len(self._bufs)
        return buf[: bucket.nbytes].view(bucket.dtype)

    def release(self) -> None:
        if self._bufs and self._bufs[0].device.type != "cpu":
            self._bufs = []

    def drop(self) -> None:
        """Forget the buffers whatever their device: after a failed transfer, whose
        abandoned broadcasts may still write into (or read from) them."""
        self._bufs = []
        self._turn = 0


def _plan_views(
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    staging: _Staging,
) -> list[torch.Tensor | None]:
    """Each bucket's in-place view (None: packed), staging reserved for the packed ones."""
    views = [direct_view(b, tensors, device) for b in buckets]
    packed = [b.nbytes for b, v in zip(buckets, views, strict=True) if v is None]
    staging.reserve(max(packed, default=0), device)
    return views


def _send_buckets(
    pg: Any,
    backend: str,
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    timeout_s: float,
    staging: _Staging,
) -> tuple[float, int]:
    """Broadcast every bucket, in place when it can be, else packed into a staging buffer
    while the previous bucket is on the wire; the seconds spent packing and the number of
    buckets packed."""
    device = _buffer_device(backend)
    src = {
        n: t.detach() if t.is_contiguous() else t.detach().contiguous() for n, t in tensors.items()
    }
    views = _plan_views(buckets, src, device, staging)
    pending: deque[Any] = deque()
    pack_s = 0.0
    try:
        for bucket, view in zip(buckets, views, strict=True):
            while len(pending) >= IN_FLIGHT:  # frees the staging buffer this bucket may take
                _wait_work(pending.popleft(), timeout_s)
            if view is None:
                t0 = time.perf_counter()
                view = flatten_bucket(bucket, src, device, out=staging.take(bucket))
                pack_s += time.perf_counter() - t0
            pending.append(_post(pg, backend, view, timeout_s))
        while pending:
            _wait_work(pending.popleft(), timeout_s)
    except BaseException:
        staging.drop()  # broadcasts still in flight may use them: never again
        raise
    staging.release()
    return pack_s, sum(v is None for v in views)


def _recv_buckets(
    pg: Any,
    backend: str,
    buckets: Sequence[Bucket],
    tensors: Mapping[str, torch.Tensor],
    timeout_s: float,
    staging: _Staging,
) -> tuple[float, int]:
    """Receive every bucket, in place when it can be, else into a staging buffer that is
    unpacked while the next bucket is on the wire; the seconds spent unpacking and the
    number of buckets unpacked."""
    views = _plan_views(buckets, tensors, _buffer_device(backend), staging)
    pending: deque[tuple[Any, Bucket, torch.Tensor]] = deque()
    assembling: dict[str, torch.Tensor] = {}
    unpack_s = 0.0
    try:
        for i, bucket in enumerate([*buckets, None]):
            while pending and (bucket is None or len(pending) >= IN_FLIGHT):
                work, done, buf = pending.popleft()
                _wait_work(work, timeout_s)
                t0 = time.perf_counter()
                unflatten_bucket(done, buf, tensors, assembling)  # a no-op when in place
                unpack_s += time.perf_counter() - t0
            if bucket is not None:
                view = views[i] if views[i] is not None else staging.take(bucket)
                pending.append((_post(pg, backend, view, timeout_s), bucket, view))
    except BaseException:
        staging.drop()  # broadcasts still in flight may write into them: never again
        raise
    staging.release()
    return unpack_s, sum(v is None for v in views)


def _drop_group(pg: Any) -> None:
    if pg is None:
        return
    try:
        pg.abort()
    except Exception as exc:  # a broken group may refuse; it is dropped either way
        log.debug("aborting a weight-sync process group: %s", exc)


def _wait_keys(store: Any, keys: Sequence[str], deadline: float) -> list[str]:
    """Wait until every key is set or the deadline passes; the keys still missing."""
    remaining = deadline - time.monotonic()
    if remaining > 0:
        try:
            store.wait(list(keys), _td(remaining))
            return []
        except (dist.DistStoreError, RuntimeError) as exc:
            if not _is_timeout(exc):
                raise
    return [k for k in keys if not store.check([k])]


def _wait_get(store: Any, key: str, timeout_s: float) -> str | None:
    if _wait_keys(store, [key], time.monotonic() + timeout_s):
        return None
    return store.get(key).decode()


# -------------------------------------------------------------------------------- sender


@dataclass
class _Epoch:
    rdv: Rendezvous
    store: Any  # PrefixStore of this epoch's control keys
    pg: Any = None
    broken: str = ""
    last_version: int = -(2**62)


class CollectiveSender:
    """Trainer side (rank 0): hosts the rendezvous store and broadcasts versions."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        bucket_mb: float,
        backend: str | None = None,
        device_id: str | None = None,
    ) -> None:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        self.device_id = device_identity(backend) if device_id is None else device_id
        """The trainer's device (:func:`device_identity`; tests give their own)."""
        if backend not in BACKENDS:
            raise SyncError(f"unknown collective backend {backend!r}")
        if timeout_s <= 0 or bucket_mb <= 0:
            raise SyncError("timeout_s and bucket_mb must be positive")
        self.host = host
        self.port = int(port)
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.backend = backend
        self._master: Any = None  # the TCPStore server
        self._epoch: _Epoch | None = None
        self._last_epoch = 0
        self._staging = _Staging()
        self.last_stats: dict[str, float] = {}
        """Seconds of the last version's phases: ``wait_s`` (group formation when new, the
        ready/go handshake), ``send_s`` (header and buckets), ``pack_s`` (the part of
        ``send_s`` spent copying into buckets), ``confirm_s`` (until every member confirmed);
        counts: ``buckets`` (broadcast calls after the header), ``packed`` (those copied
        into a staging buffer; the others went in place)."""

    # -- epochs

    @property
    def uri(self) -> str | None:
        """The current epoch's rendezvous uri (None before ``open_epoch`` / after ``close``)."""
        return self._epoch.rdv.uri if self._epoch else None

    @property
    def usable(self) -> bool:
        """False when the current epoch failed and a new one must be opened."""
        return self._epoch is not None and not self._epoch.broken

    def open_epoch(self, members: Sequence[str]) -> str:
        """Start a new group epoch for ``members``; returns its rendezvous uri at once.

        The previous epoch's group is dropped. The group forms in the next ``broadcast``.
        """
        members = _check_members(members)
        self._end_epoch()
        if self._master is None or self.port == 0:
            self._master = None  # port 0: the previous store (and its port) goes away
            try:
                self._master = dist.TCPStore(
                    self.host,
                    self.port,
                    None,
                    True,
                    _td(self.timeout_s),
                    wait_for_workers=False,
                )
            except Exception as exc:
                raise SyncError(
                    f"cannot host the weight-sync store at {self.host}:{self.port}: {exc}"
                ) from exc
        epoch = max(self._last_epoch + 1, time.time_ns() // 1_000_000)
        self._last_epoch = epoch
        rdv = Rendezvous(self.backend, self.host, int(self._master.port), epoch, members)
        store = dist.PrefixStore(f"{_NAMESPACE}/{epoch}", self._master)
        self._epoch = _Epoch(rdv, store)
        log.info("weight-sync epoch %d opened for %s at %s", epoch, ", ".join(members), rdv.uri)
        return rdv.uri

    def _end_epoch(self) -> None:
        if self._epoch is not None:
            _drop_group(self._epoch.pg)
            self._epoch.pg = None
            self._epoch = None

    def _fail(self, ep: _Epoch, reason: str, timeout: bool) -> SyncError:
        ep.broken = reason
        _drop_group(ep.pg)
        ep.pg = None
        cls = SyncTimeout if timeout else SyncError
        return cls(f"weight-sync epoch {ep.rdv.epoch}: {reason}")

    def _form(self, ep: _Epoch, deadline: float) -> None:
        rdv = ep.rdv
        keys = [f"join/{r}" for r in range(1, rdv.world_size)]
        missing = _wait_keys(ep.store, keys, deadline)
        if missing:
            who = [rdv.members[int(k.split("/")[1]) - 1] for k in missing]
            reason = f"{', '.join(who)} did not join within {self.timeout_s:.1f}s"
            ep.store.set("formed", _ABORT_TIMEOUT + reason)
            raise self._fail(ep, reason, timeout=True)
        joined = {
            rdv.members[r - 1]: ep.store.get(f"join/{r}").decode().removeprefix("1")
            for r in range(1, rdv.world_size)
        }
        apart = sharing_a_device(self.device_id, joined)
        if apart:
            reason = (
                f"{', '.join(apart)} share a GPU with the trainer or with another member "
                "(NCCL broadcasts between devices only)"
            )
            ep.store.set("formed", _ABORT_MISMATCH + reason)
            ep.broken = reason
            raise SameDeviceError(f"weight-sync epoch {rdv.epoch}: {reason}", apart)
        ep.store.set("formed", _GO)
        t0 = time.monotonic()
        try:
            pg_store = dist.PrefixStore("pg", ep.store)
            ep.pg = _make_group(rdv.backend, pg_store, 0, rdv.world_size, self.timeout_s, self.host)
        except SyncError:
            raise
        except Exception as exc:
            raise self._fail(ep, f"forming the group failed: {exc}", _is_timeout(exc)) from exc
        log.info(
            "weight-sync epoch %d formed (%s, world %d) in %.2fs",
            rdv.epoch,
            rdv.backend,
            rdv.world_size,
            time.monotonic() - t0,
        )

    def broadcast(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Send ``tensors`` as ``version`` to every member of the current epoch.

        Blocks until every member has copied them in; SyncTimeout when a member does not
        come within ``timeout_s``, SyncError when a member's tensors do not match.
        """
        ep = self._epoch
        if ep is None:
            raise SyncError("broadcast before open_epoch (or after close)")
        if ep.broken:
            raise SyncError(
                f"weight-sync epoch {ep.rdv.epoch} failed earlier ({ep.broken}); open a new epoch"
            )
        if version <= ep.last_version:
            raise SyncError(
                f"version {version} is not above {ep.last_version}, the last one broadcast "
                f"in epoch {ep.rdv.epoch}"
            )
        ep.last_version = version
        try:
            self._send(ep, tensors, version)
        except SyncError:
            raise
        except Exception as exc:  # the store or the group failed under us
            raise self._fail(
                ep, f"broadcast of version {version} failed: {exc}", _is_timeout(exc)
            ) from exc

    def _send(self, ep: _Epoch, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        specs = tensor_specs(tensors)
        if ep.pg is None:
            self._form(ep, deadline)
        rdv, store = ep.rdv, ep.store
        ranks = range(1, rdv.world_size)
        keys = self._handshake(ep, version, spec_digest(specs).hex(), deadline)
        t1 = time.perf_counter()
        # transfer: header, then the buckets
        device = _buffer_device(rdv.backend)
        buckets = plan_buckets(specs, self.bucket_bytes)
        header = torch.tensor(_header(version, self.bucket_bytes, specs), dtype=torch.int64)
        _wait_work(_post(ep.pg, rdv.backend, header.to(device), self.timeout_s), self.timeout_s)
        pack_s, packed = _send_buckets(
            ep.pg, rdv.backend, buckets, tensors, self.timeout_s, self._staging
        )
        t2 = time.perf_counter()
        done = [f"v{version}/done/{r}" for r in ranks]
        missing = _wait_keys(store, done, time.monotonic() + self.timeout_s)
        if missing:
            who = [rdv.members[int(k.rsplit("/", 1)[1]) - 1] for k in missing]
            raise self._fail(ep, f"{', '.join(who)} did not confirm version {version}", True)
        t3 = time.perf_counter()
        for key in [*keys, *done]:
            store.delete_key(key)
        self.last_stats = {"wait_s": t1 - t0, "send_s": t2 - t1, "pack_s": pack_s}
        self.last_stats.update(confirm_s=t3 - t2, buckets=len(buckets), packed=packed)
        log.info(
            "weight-sync version %d: %.1f MB in %d buckets to %d members, %.2fs waiting, "
            "%.2fs sending (%.2fs packing), %.2fs until confirmed",
            version,
            sum(b.nbytes for b in buckets) / 1e6,
            len(buckets),
            len(rdv.members),
            t1 - t0,
            t2 - t1,
            pack_s,
            t3 - t2,
        )

    def _handshake(self, ep: _Epoch, version: int, digest: str, deadline: float) -> list[str]:
        """Wait for every member's ready key, check their digests, set go (or abort);
        the control keys of this version to delete once it is done."""
        rdv, store = ep.rdv, ep.store
        ranks = range(1, rdv.world_size)
        ready = [f"v{version}/ready/{r}" for r in ranks]
        missing = _wait_keys(store, ready, deadline)
        if missing:
            who = [rdv.members[int(k.rsplit("/", 1)[1]) - 1] for k in missing]
            reason = (
                f"{', '.join(who)} did not ask for version {version} within {self.timeout_s:.1f}s"
            )
            store.set(f"v{version}/go", _ABORT_TIMEOUT + reason)
            raise SyncTimeout(f"weight-sync epoch {rdv.epoch}: {reason}")
        wrong = [
            rdv.members[r - 1]
            for r, key in zip(ranks, ready, strict=True)
            if store.get(key).decode() != digest
        ]
        if wrong:
            reason = (
                f"the tensors of {', '.join(wrong)} do not match the trainer's "
                f"(names, shapes or dtypes differ); version {version} not sent"
            )
            store.set(f"v{version}/go", _ABORT_MISMATCH + reason)
            raise SyncError(f"weight-sync epoch {rdv.epoch}: {reason}")
        store.set(f"v{version}/go", _GO)
        return [*ready, f"v{version}/go"]

    def close(self) -> None:
        """Drop the group and stop the rendezvous store. Idempotent."""
        self._end_epoch()
        self._master = None
        self._staging = _Staging()

    def __enter__(self) -> CollectiveSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ receiver


class CollectiveReceiver:
    """Explorer side: joins the epoch a uri names and fills tensors in place."""

    def __init__(self, member_id: str, timeout_s: float, device_id: str | None = None) -> None:
        if not member_id:
            raise SyncError("member_id is empty")
        if timeout_s <= 0:
            raise SyncError("timeout_s must be positive")
        self.member_id = member_id
        self.timeout_s = float(timeout_s)
        self._device_id = device_id
        """This member's device (None: :func:`device_identity` of the epoch's backend)."""
        self._rdv: Rendezvous | None = None
        self._rank = 0
        self._client: Any = None
        self._store: Any = None
        self._pg: Any = None
        self._staging = _Staging()
        self.last_stats: dict[str, float] = {}
        """Seconds of the last version's phases: ``wait_s`` (ready until go), ``recv_s``
        (header and buckets), ``unpack_s`` (the part of ``recv_s`` spent copying out of
        buckets); counts: ``buckets`` and ``packed`` (received into a staging buffer; the
        others straight into the tensors)."""

    @property
    def epoch(self) -> int | None:
        """The epoch this receiver is in (None when in none)."""
        return self._rdv.epoch if self._rdv else None

    def _leave(self) -> None:
        _drop_group(self._pg)
        self._pg = self._store = self._client = self._rdv = None

    def _join(self, rdv: Rendezvous, rank: int) -> None:
        self._leave()
        try:
            client = dist.TCPStore(rdv.host, rdv.port, None, False, _td(self.timeout_s))
        except Exception as exc:
            cls = SyncTimeout if _is_timeout(exc) else SyncError
            raise cls(
                f"cannot reach the weight-sync store of epoch {rdv.epoch} at "
                f"{rdv.host}:{rdv.port}: {exc}"
            ) from exc
        store = dist.PrefixStore(f"{_NAMESPACE}/{rdv.epoch}", client)
        device = device_identity(rdv.backend) if self._device_id is None else self._device_id
        store.set(f"join/{rank}", "1" + device)  # the trainer checks nobody shares a GPU
        formed = _wait_get(store, "formed", self.timeout_s)
        if formed is None:
            raise SyncTimeout(
                f"weight-sync epoch {rdv.epoch}: the trainer did not form the group "
                f"within {self.timeout_s:.1f}s"
            )
        if formed.startswith(_ABORT_MISMATCH):
            raise SyncError(f"weight-sync epoch {rdv.epoch}: {formed.split(':', 2)[-1]}")
        if formed != _GO:
            raise SyncTimeout(f"weight-sync epoch {rdv.epoch}: {formed.split(':', 2)[-1]}")
        try:
            bind = local_address_towards(rdv.host)
            pg = _make_group(
                rdv.backend,
                dist.PrefixStore("pg", store),
                rank,
                rdv.world_size,
                self.timeout_s,
                bind,
            )
        except SyncError:
            raise
        except Exception as exc:
            cls = SyncTimeout if _is_timeout(exc) else SyncError
            raise cls(f"weight-sync epoch {rdv.epoch}: joining the group failed: {exc}") from exc
        self._rdv, self._rank, self._client, self._store, self._pg = rdv, rank, client, store, pg
        log.info("joined weight-sync epoch %d as rank %d of %d", rdv.epoch, rank, rdv.world_size)

    def receive(self, uri: str, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Receive ``version`` from the epoch ``uri`` names into ``tensors``, in place.

        Joins (or re-forms into) that epoch first when needed. SyncTimeout when the trainer
        does not send this version in time (or gave up on it), SyncError when the tensors'
        names, shapes or dtypes differ from the trainer's.
        """
        rdv = parse_rendezvous(uri)
        if rdv != self._rdv:
            if self.member_id not in rdv.members:
                self._leave()  # a new epoch without us: the old group is over too
            rank = rdv.rank_of(self.member_id)
        else:
            rank = self._rank
        specs = tensor_specs(tensors)
        try:
            if rdv != self._rdv:
                self._join(rdv, rank)
            self._receive(rdv, rank, specs, tensors, version)
        except SyncError:
            raise
        except Exception as exc:  # store or collective failure: this group is unusable
            self._leave()
            cls = SyncTimeout if _is_timeout(exc) else SyncError
            raise cls(
                f"weight-sync epoch {rdv.epoch}: receiving version {version} failed "
                f"(tensors may be partly updated): {exc}"
            ) from exc

    def _receive(
        self,
        rdv: Rendezvous,
        rank: int,
        specs: list[TensorSpec],
        tensors: Mapping[str, torch.Tensor],
        version: int,
    ) -> None:
        store = self._store
        t0 = time.perf_counter()
        store.set(f"v{version}/ready/{rank}", spec_digest(specs).hex())
        go = _wait_get(store, f"v{version}/go", self.timeout_s)
        if go is None:
            raise SyncTimeout(
                f"weight-sync epoch {rdv.epoch}: version {version} was not sent "
                f"within {self.timeout_s:.1f}s"
            )
        if go.startswith(_ABORT_TIMEOUT):
            raise SyncTimeout(f"weight-sync epoch {rdv.epoch}: {go[len(_ABORT_TIMEOUT) :]}")
        if go.startswith(_ABORT_MISMATCH):
            raise SyncError(f"weight-sync epoch {rdv.epoch}: {go[len(_ABORT_MISMATCH) :]}")
        if go != _GO:
            raise SyncError(f"weight-sync epoch {rdv.epoch}: unexpected go value {go!r}")
        t1 = time.perf_counter()
        header = torch.zeros(8, dtype=torch.int64, device=_buffer_device(rdv.backend))
        _wait_work(_post(self._pg, rdv.backend, header, self.timeout_s), self.timeout_s)
        got = header.cpu().tolist()
        bucket_bytes = got[2]
        if bucket_bytes <= 0 or got != _header(version, bucket_bytes, specs):
            self._leave()  # the sender goes on with buckets nobody here will read
            raise SyncError(
                f"weight-sync epoch {rdv.epoch}: header {got} does not match version "
                f"{version} of this model"
            )
        buckets = plan_buckets(specs, bucket_bytes)
        unpack_s, packed = _recv_buckets(
            self._pg, rdv.backend, buckets, tensors, self.timeout_s, self._staging
        )
        t2 = time.perf_counter()
        store.set(f"v{version}/done/{rank}", "1")
        self.last_stats = {"wait_s": t1 - t0, "recv_s": t2 - t1, "unpack_s": unpack_s}
        self.last_stats.update(buckets=len(buckets), packed=packed)

    def close(self) -> None:
        """Leave the current epoch. Idempotent."""
        self._leave()
        self._staging = _Staging()

    def __enter__(self) -> CollectiveReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
