"""Benchmark: one weight version from trainer tensors to explorer parameters, per sync method.

Builds a random float32 state dict of ``--mb`` MiB (25 tensors of equal size) and moves it
with each method named in ``--methods`` (default ``object_store,filesystem,nccl``), always
through the library code, then times a plain file-copy baseline on the same disk.

``object_store``: starts the local JuiceFS S3 gateway (``LocalServices``, object store only,
in a temporary folder removed afterwards; only when this method is selected) and times

- ``publish_s``: ``ObjectStorePublisher.publish(tensors, version, step)``: shards built as
  views of the tensors (a safetensors header of our own + each tensor's bytes, nothing
  joined or copied), the sha256 of each shard in a thread while it uploads (a single PUT
  up to ``part_size_mb``, else a multipart upload, ``parallel`` parts in flight, bodies
  sent straight from the tensors' memory through presigned URLs, no payload signing),
  then the manifest;
- ``fetch_verify_s``: ``ObjectStoreLoader.fetch(event)``: download and check the manifest
  against the event's digest, then each shard as ``parallel`` ranged GETs of
  ``part_size_mb`` into one preallocated buffer, hashed range by range while the later
  ranges download, checked against the manifest, decoded as views of the buffer;
- ``apply_s``: ``streamrft.sync.weights.apply_state_dict`` into an ``nn.ParameterDict`` of
  the same names and shapes (name/shape checks, then ``copy_`` of every tensor).

``filesystem``: the same three phases with ``FilesystemPublisher(folder, run_id,
max_shard_bytes).publish`` (every shard written from the tensors' memory and the manifest
written to a temporary name, fsync'ed and renamed; sha256 in a thread meanwhile) and
``FilesystemLoader(folder).fetch`` (read in 8 MiB chunks into one buffer, each chunk
hashed while the next is read; verify and decode as above), the folder a fresh temporary
one on the same disk as the baseline; then ``apply_s``.

``nccl``: ``CollectiveSender`` / ``CollectiveReceiver`` with the gloo backend (CPU; NCCL
shares the code path), ``bucket_mb`` 64, the trainer in this process and one explorer in a
child process (``multiprocessing`` spawn context, OMP_NUM_THREADS=1, torch threads 1) that
holds zero tensors of the same names and shapes and fills them in place. The child is
started and its tensors allocated before any timing; it is always stopped afterwards.

- ``first_broadcast_s``: ``open_epoch([member])`` + handing the uri to the child +
  ``broadcast(tensors, 1)``: rendezvous store, join, gloo group formation, the ready/go
  handshake, the bucketed transfer and the child's in-place copy (``broadcast`` returns
  when the child confirmed);
- ``broadcast_s``: the same for version 2 in the same epoch (steady state: handshake,
  transfer, in-place copy; no group formation);
- ``bytes_equal``: after each version the child hashes (sha256) the received bytes of a few
  tensors (first, middle and last by name; ``verified_tensors`` counts them) and sends the
  digests back through a Queue; true when both versions match the trainer's tensors. The
  child zeroes its tensors between versions, so version 2 is checked on fresh bytes.
- ``receive_s`` / ``first_receive_s``: the child's own ``receive`` call (informational).

Baseline, same run and same disk: the publisher's safetensors bytes (the same shards
joined by ``shard_state_dict``, untimed) are written to a file (``write_s``: open, write, close; no
fsync), the file is copied with ``shutil.copyfile`` (``copy_s``) and the copy is read back
(``read_s``, reported but not in ``copy_mb_s``).

Figures (MB = MiB = 2**20 bytes of tensor data; the safetensors header adds ~1 KiB):

- ``mb_s`` (object_store, filesystem) = MB / (``publish_s`` + ``fetch_verify_s`` +
  ``apply_s``): trainer tensors to explorer parameters through that store;
- ``mb_s`` (nccl) = MB / ``broadcast_s``, steady state; ``first_mb_s`` = MB /
  ``first_broadcast_s``, group formation included;
- ``copy_mb_s`` = MB / (``write_s`` + ``copy_s``): the same bytes written once and copied
  once on the local file system (page cache; a floor for any local file handoff);
- ``ratio_vs_copy`` = that method's ``mb_s`` / ``copy_mb_s``;
- informational: ``serialize_s`` (joining the shards into one ``bytes`` each with
  ``shard_state_dict``: what building the baseline's input costs; the stores no longer do
  it) and ``sha256_s`` (one sha256 pass over the shard bytes on one thread) and
  ``sha256_threads_s`` (the shards hashed on up to ``hash_threads`` threads at once, as
  the stores hash them, once on publish and once on fetch); ``fsync_s`` (the baseline's
  fsync after each shard's write: the folder store fsyncs every file); ``shards`` and
  ``shard_bytes``: the safetensors shards of one version (shard size: ``--shard-mb``,
  default ``ObjectStoreConfig.shard_size_mb``, for both stores); ``part_size_mb`` and
  ``parallel``: the object store's transfer settings (``--part-mb``, ``--parallel``;
  default: the ``ObjectStoreConfig`` defaults).
- the raw bounds of the store-like methods, measured in the same process:
  ``publish_bound_s`` = max(``sha256_threads_s``, ``write_s`` + ``fsync_s``) (a version
  can be published no faster than its shards are hashed or durably written) and
  ``fetch_bound_s`` = max(``sha256_threads_s``, ``read_s``); per method
  ``publish_vs_bound`` and ``fetch_vs_bound`` = the bound / that phase's seconds (1.0: at
  the bound).

``--device cuda`` (not run on a GPU yet): the trainer's tensors are on the GPU (in
``--dtype``). A store-like method's ``publish_s`` then starts with the copy a trainer makes
of them into pinned host memory (``snapshot_tensors``, also reported as ``snapshot_s``) and
its ``apply_s`` copies into parameters on the GPU; ``nccl`` is not measured (one GPU cannot
hold two NCCL ranks). ``cuda_ipc`` (``--device cuda`` only): ``CudaIpcSender.send`` here
(``publish_s``: the snapshot into pinned host memory, as a run's trainer takes it, then
the slot's fill from it and its digest on the GPU), and an explorer in a child process
(``multiprocessing`` spawn) that holds parameters of the same names and shapes on the GPU:
``fetch_verify_s`` its ``CudaIpcReceiver.receive`` (the slot's lease, the device copy, the
digest, the decode), ``apply_s`` its copy into its parameters; two versions go through
first (the first maps the slot's handle: ``first_fetch_s``), then the timed one.
``memcpy_s``: one device copy of the same bytes between two warm buffers, and
``version_ratio_vs_memcpy`` = that over fetch + apply (what the explorer pays against one
device copy).

Everything runs with one torch/OMP thread. A figure, not a test: the only checks are that
the applied parameters equal the published tensors bit for bit (object_store, filesystem)
and ``bytes_equal`` (nccl, cuda_ipc; reported, not raised).

Usage: ``python bench/weight_sync.py [--mb 500] [--quick] [--device cpu|cuda] [--dtype D]
[--methods object_store,filesystem,nccl,shared,cuda_ipc] [--part-mb N] [--parallel N]
[--shard-mb N]``. Human-readable lines first,
then one JSON line on stdout: the top-level keys
(``bench``, ``method`` = "object_store", ``mb``, ``publish_s``, ``fetch_verify_s``,
``apply_s``, ``mb_s``, ``copy_mb_s``, ``ratio_vs_copy``, the baseline and informational
figures) describe the object store (its figures ``null`` when it is not selected), and
``methods`` maps every other selected method to its figures, each with its own
``ratio_vs_copy``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import hashlib
import json
import multiprocessing as mp
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from streamrft.infra.config import ObjectStoreConfig
from streamrft.infra.local.services import LocalServices
from streamrft.sync.collective import CollectiveReceiver, CollectiveSender
from streamrft.sync.filesystem import FilesystemLoader, FilesystemPublisher
from streamrft.sync.object_store import ObjectStoreLoader, ObjectStorePublisher
from streamrft.sync.versions import HASH_THREADS
from streamrft.sync.weights import (
    apply_state_dict,
    sha256_hex,
    shard_state_dict,
    snapshot_tensors,
)

MIB = 1 << 20
N_TENSORS = 25
ROW = 4096
METHODS = ("object_store", "filesystem", "nccl", "shared", "cuda_ipc")
CPU_METHODS = ("object_store", "filesystem", "nccl", "shared")
CUDA_METHODS = ("object_store", "filesystem", "shared", "cuda_ipc")
"""The default methods per ``--device`` (``nccl`` needs two GPUs, ``cuda_ipc`` one)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BUCKET_MB = 64
NCCL_TIMEOUT_S = 120.0
MEMBER = "explorer-0"


def say(msg: str) -> None:
    print(msg, flush=True)


def make_tensors(
    mb: float,
    seed: int,
    count: int = N_TENSORS,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """``count`` random tensors of ``dtype`` on ``device``, ~``mb`` MiB in all (2-D when
    sizes allow); also bench/broadcast.py's."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = max(1, round(mb * MIB / itemsize / count))
    shape = (numel // ROW, ROW) if numel % ROW == 0 else (numel,)
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layer{i:04d}_weight": torch.randn(shape, generator=gen).to(device, dtype)
        for i in range(count)
    }


# ------------------------------------------------------------------ store-based methods


def _synchronize(tensors: Mapping[str, torch.Tensor]) -> None:
    """Wait for the GPU work on ``tensors``' device (nothing on a CPU)."""
    device = next(iter(tensors.values())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def store_path(publisher: Any, loader: Any, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """publish -> fetch (+ verify) -> apply through one store; the three phase timings.
    Tensors on a GPU are first copied into pinned host memory, as a trainer's snapshot is
    (in ``publish_s``; also ``snapshot_s``), and applied into parameters on the GPU."""
    model = nn.ParameterDict(
        {k: nn.Parameter(torch.zeros_like(v), requires_grad=False) for k, v in tensors.items()}
    )
    on_gpu = next(iter(tensors.values())).is_cuda

    t0 = time.perf_counter()
    host = snapshot_tensors(tensors) if on_gpu else tensors
    t_snap = time.perf_counter()
    event = publisher.publish(host, version=1, step=1)
    t1 = time.perf_counter()
    fetched = loader.fetch(event)
    t2 = time.perf_counter()
    apply_state_dict(model, fetched)
    _synchronize(tensors)
    t3 = time.perf_counter()

    del fetched
    for name, tensor in tensors.items():
        if not torch.equal(model[name], tensor):
            raise RuntimeError(f"{name}: applied parameter differs from the published tensor")
    return {
        "publish_s": t1 - t0,
        "fetch_verify_s": t2 - t1,
        "apply_s": t3 - t2,
        "snapshot_s": t_snap - t0,
        "shard_bytes": float(event.bytes),
    }


def object_store_path(
    cfg: ObjectStoreConfig, tensors: dict[str, torch.Tensor], run_id: str
) -> dict[str, float]:
    publisher = ObjectStorePublisher(cfg, run_id)  # creates the bucket: untimed
    return store_path(publisher, ObjectStoreLoader(cfg), tensors)


def filesystem_path(
    folder: Path, tensors: dict[str, torch.Tensor], run_id: str, shard_bytes: int
) -> dict[str, float]:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        publisher = FilesystemPublisher(folder, run_id, shard_bytes)
        return store_path(publisher, FilesystemLoader(folder), tensors)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------- shared memory (/dev/shm)


class _SharedStore:
    """The ``shared`` method seen as a store for :func:`store_path`: ``publish`` is
    ``SharedSender.send`` (write into the next /dev/shm file, hashing each piece), ``fetch``
    is ``SharedReceiver.receive`` (read into the receiver's buffer, hashing each piece,
    check the digest, decode views)."""

    def __init__(self, run_id: str, like: dict[str, torch.Tensor]) -> None:
        from streamrft.infra.config import Config, RunSection
        from streamrft.sync.shared import SharedReceiver, SharedSender

        cfg = Config(run=RunSection(id=run_id))
        self.sender, self.receiver, self.like = SharedSender(cfg), SharedReceiver(cfg), like

    def publish(self, tensors: dict[str, torch.Tensor], version: int, step: int):
        import asyncio

        from streamrft.sync.transport import Payload

        events = []

        async def announce(event) -> None:
            events.append(event)

        payload = Payload(version, step, tensors, base_version=version)
        asyncio.run(self.sender.send(lambda _full: payload, announce))
        return events[0]

    def fetch(self, event) -> dict[str, torch.Tensor]:
        return self.receiver.receive(event, self.like)


def shared_path(tensors: dict[str, torch.Tensor], run_id: str) -> dict[str, float]:
    """Steady state: two versions go through first (untimed), so both files and the
    receiver's buffers exist, as they do from the third version of a run on; then the
    timed version, and a memcpy of the same bytes between two warm buffers (the floor of
    any handoff between processes, which takes two: into shared memory and out)."""
    store = _SharedStore(run_id, tensors)
    try:
        for version in (1, 2):
            store.fetch(store.publish(tensors, version, version))
        res = store_path(store, store, tensors)
    finally:
        store.sender.close()
    flat = torch.cat([t.reshape(-1) for t in tensors.values()]).cpu()  # host memory's floor
    dst = torch.empty_like(flat)
    dst.copy_(flat)  # warm
    t0 = time.perf_counter()
    dst.copy_(flat)
    res["memcpy_s"] = time.perf_counter() - t0
    return res


# ------------------------------------------------------- device to device (cuda_ipc)


def _ipc_config(run_id: str) -> Any:
    from streamrft.infra.config import Config, ModelConfig, RunSection

    return Config(run=RunSection(id=run_id), model=ModelConfig(device="cuda"))


def _ipc_receiver(
    run_id: str, shapes: dict[str, tuple[int, ...]], dtype: str, commands: Any, results: Any
) -> None:
    """Child process: one explorer on the GPU; receives versions through CUDA IPC, applies
    them into its parameters, reports its times and sha256 digests."""
    import msgspec

    from streamrft.schemas.events import ModelVersionReady
    from streamrft.sync.cuda_ipc import CudaIpcReceiver
    from streamrft.sync.weights import copy_into

    params = {n: torch.zeros(s, dtype=DTYPES[dtype], device="cuda") for n, s in shapes.items()}
    receiver = CudaIpcReceiver(_ipc_config(run_id))

    def receive(raw: bytes, names: list[str]) -> dict[str, Any]:
        event = msgspec.json.decode(raw, type=ModelVersionReady)
        t0 = time.perf_counter()
        tensors = receiver.receive(event, params)
        t1 = time.perf_counter()
        copy_into(params, tensors, "weights")
        torch.cuda.synchronize()
        digests = {n: sha256_hex(params[n]) for n in names}
        return {"fetch_verify_s": t1 - t0, "apply_s": time.perf_counter() - t1, "sha256": digests}

    try:
        _serve(commands, results, receive, params)
    finally:
        receiver.close()


def cuda_ipc_path(tensors: dict[str, torch.Tensor], run_id: str) -> dict[str, Any]:
    """The device path: the sender here, an explorer in a child process (a process cannot
    map its own CUDA IPC handle); versions 1 and 2 untimed (the first maps the slots), the
    third timed; a device memcpy of the same bytes for the floor."""
    import asyncio

    import msgspec

    from streamrft.sync.cuda_ipc import CudaIpcSender
    from streamrft.sync.transport import Payload

    dtype = next(iter(tensors.values())).dtype
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    proc = ctx.Process(
        target=_ipc_receiver,
        args=(run_id, shapes, dtype_name, commands, results),
        name="bench-ipc-receiver",
        daemon=True,
    )
    sender = CudaIpcSender(_ipc_config(run_id), lease_wait_s=60)
    order = sorted(tensors)
    names = list(dict.fromkeys([order[0], order[len(order) // 2], order[-1]]))
    want = {n: sha256_hex(tensors[n]) for n in names}
    proc.start()
    done = []
    try:
        ready = _result(results, proc, 300)
        if ready.get("op") != "ready":
            raise RuntimeError(f"ipc receiver: unexpected first message {ready!r}")
        for version in (1, 2, 3):
            events = []

            async def announce(event: Any, into: list = events) -> None:
                into.append(event)

            t0 = time.perf_counter()
            host = snapshot_tensors(tensors)
            payload = Payload(version, version, host, base_version=version)
            asyncio.run(sender.send(lambda _full, p=payload: p, announce))
            publish_s = time.perf_counter() - t0
            commands.put(("receive", msgspec.json.encode(events[0]), names))
            got = _result(results, proc, NCCL_TIMEOUT_S)
            if "error" in got:
                raise RuntimeError(f"ipc receiver, version {version}: {got['error']}")
            done.append({**got, "publish_s": publish_s})
    finally:
        sender.close()
        stop_child(proc, commands, results)
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    dst = torch.empty_like(flat)
    dst.copy_(flat)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(flat)
    torch.cuda.synchronize()
    last = done[-1]
    return {
        "publish_s": last["publish_s"],
        "fetch_verify_s": last["fetch_verify_s"],
        "apply_s": last["apply_s"],
        "first_fetch_s": done[0]["fetch_verify_s"],
        "memcpy_s": time.perf_counter() - t0,
        "bytes_equal": all(d["sha256"] == want for d in done),
        "verified_tensors": len(names),
    }


# ---------------------------------------------------------------------- nccl (gloo)


def _nccl_receiver(
    shapes: dict[str, tuple[int, ...]], timeout_s: float, commands: Any, results: Any
) -> None:
    """Child process: one explorer; receives versions in place, reports sha256 digests."""
    tensors = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
    receiver = CollectiveReceiver(MEMBER, timeout_s)

    def receive(uri: str, version: int, names: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        receiver.receive(uri, tensors, version)
        digests = {n: sha256_hex(tensors[n]) for n in names}
        return {"receive_s": time.perf_counter() - t0, "sha256": digests}

    try:
        _serve(commands, results, receive, tensors)
    finally:
        receiver.close()


def _serve(commands: Any, results: Any, receive: Callable[..., dict[str, Any]], held: dict) -> None:
    """A receiver child's loop, one thread: "ready", then for each ``("receive", *args)``
    the answer of ``receive(*args)`` (its error as text: the bench raises it), the ``held``
    tensors zeroed after each (the next version must really arrive), until ``("exit",)``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    results.put({"op": "ready"})
    while (cmd := commands.get())[0] != "exit":
        out: dict[str, Any] = {"op": "received"}
        try:
            out.update(receive(*cmd[1:]))
        except Exception as exc:  # reported to the bench, which raises it
            out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        for tensor in held.values():
            tensor.zero_()
        results.put(out)


def stop_child(proc: Any, commands: Any, results: Any) -> None:
    """Ask a receiver child to exit, kill it if it does not, close its queues."""
    if proc.is_alive():
        commands.put(("exit",))
        proc.join(timeout=15)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)
    commands.close()
    results.close()


def _result(results: Any, proc: Any, timeout_s: float) -> dict[str, Any]:
    """The child's next message; RuntimeError if it dies or stays silent."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"nccl receiver died (exit code {proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nccl receiver silent for {timeout_s:.0f} s") from None


def nccl_path(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    proc = ctx.Process(
        target=_nccl_receiver,
        args=(shapes, NCCL_TIMEOUT_S, commands, results),
        name="bench-nccl-receiver",
        daemon=True,
    )
    sender: CollectiveSender | None = None
    t_spawn = time.perf_counter()
    proc.start()
    try:
        ready = _result(results, proc, 300)
        if ready.get("op") != "ready":
            raise RuntimeError(f"nccl receiver: unexpected first message {ready!r}")
        spawn_s = time.perf_counter() - t_spawn
        order = sorted(tensors)
        names = list(dict.fromkeys([order[0], order[len(order) // 2], order[-1]]))
        want = {n: sha256_hex(tensors[n]) for n in names}
        sender = CollectiveSender("127.0.0.1", 0, NCCL_TIMEOUT_S, BUCKET_MB, backend="gloo")

        t0 = time.perf_counter()
        uri = sender.open_epoch([MEMBER])
        commands.put(("receive", uri, 1, names))
        sender.broadcast(tensors, 1)
        t1 = time.perf_counter()
        first = _result(results, proc, NCCL_TIMEOUT_S)

        t2 = time.perf_counter()
        commands.put(("receive", uri, 2, names))
        sender.broadcast(tensors, 2)
        t3 = time.perf_counter()
        second = _result(results, proc, NCCL_TIMEOUT_S)
    finally:
        if sender is not None:
            sender.close()
        stop_child(proc, commands, results)
    for version, res in ((1, first), (2, second)):
        if "error" in res:
            raise RuntimeError(f"nccl receiver, version {version}: {res['error']}")
    return {
        "first_broadcast_s": t1 - t0,
        "broadcast_s": t3 - t2,
        "first_receive_s": first["receive_s"],
        "receive_s": second["receive_s"],
        "bytes_equal": first["sha256"] == want and second["sha256"] == want,
        "verified_tensors": len(names),
        "spawn_s": spawn_s,
    }


# ------------------------------------------------------------------------- baseline


def copy_baseline(shards: list[bytes], folder: Path) -> dict[str, float]:
    """The shards written as a version is (each durably, all kept until the end), then
    copied, then read back: the bytes a store-like method moves, with nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    write_s = fsync_s = copy_s = read_s = 0.0
    try:
        paths = []
        for i, data in enumerate(shards):
            src = folder / f"src-{i:05d}.safetensors"
            t0 = time.perf_counter()
            with open(src, "wb") as f:
                f.write(data)
                f.flush()
                t1 = time.perf_counter()
                os.fsync(f.fileno())
            write_s += t1 - t0
            fsync_s += time.perf_counter() - t1
            paths.append(src)
        for src in paths:
            t0 = time.perf_counter()
            shutil.copyfile(src, src.with_name(f"dst-{src.name}"))
            copy_s += time.perf_counter() - t0
        for src, data in zip(paths, shards, strict=True):
            dst = src.with_name(f"dst-{src.name}")
            t0 = time.perf_counter()
            back = dst.read_bytes()
            read_s += time.perf_counter() - t0
            if back != data:
                raise RuntimeError(f"{dst}: read back differs from what was written")
            del back
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"write_s": write_s, "fsync_s": fsync_s, "copy_s": copy_s, "read_s": read_s}


# ----------------------------------------------------------------------------- run


def _phases(mb: float, res: Mapping[str, float]) -> tuple[float, float]:
    total_s = res["publish_s"] + res["fetch_verify_s"] + res["apply_s"]
    return total_s, mb / total_s


def _say_phases(
    name: str, mb: float, res: Mapping[str, float], digits: int, extra: str = ""
) -> None:
    total_s, rate = _phases(mb, res)
    say(
        f"{name}: publish {res['publish_s']:.{digits}f} s, fetch+verify"
        f" {res['fetch_verify_s']:.{digits}f} s, apply {res['apply_s']:.{digits}f} s"
        f" -> {rate:.0f} MB/s over {total_s:.{digits}f} s{extra}"
    )


def _phase_figures(
    mb: float, res: Mapping[str, float], copy_mb_s: float, digits: int
) -> dict[str, float]:
    """A store-like method's figures in the JSON line: its three phases, MB/s, the ratio."""
    rate = _phases(mb, res)[1]
    return {
        **{k: round(res[k], digits) for k in ("publish_s", "fetch_verify_s", "apply_s")},
        "mb_s": round(rate, 1),
        "ratio_vs_copy": round(rate / copy_mb_s, 4),
    }


def _vs_bounds(res: Mapping[str, float], bounds: Mapping[str, float]) -> dict[str, float]:
    """How near a store-like method's publish and fetch come to their raw bounds (1.0: at
    the bound; the bound / the phase's seconds)."""
    return {
        "publish_vs_bound": round(bounds["publish_s"] / res["publish_s"], 4),
        "fetch_vs_bound": round(bounds["fetch_verify_s"] / res["fetch_verify_s"], 4),
    }


def run(
    store: ObjectStoreConfig | None,
    methods: list[str],
    mb: float,
    seed: int,
    scratch: Path,
    shard_mb: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    t = time.perf_counter()
    tensors = make_tensors(mb, seed, device=device, dtype=dtype)
    data_bytes = sum(v.numel() * v.element_size() for v in tensors.values())
    mb_real = data_bytes / MIB
    shape = tuple(next(iter(tensors.values())).shape)
    say(
        f"state dict: {len(tensors)} {str(dtype).removeprefix('torch.')} tensors of shape"
        f" {shape} on {device}, {mb_real:.1f} MB, made in {time.perf_counter() - t:.1f} s"
    )
    shard_size = shard_mb * MIB

    run_id = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    done: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method == "object_store":
            assert store is not None
            res = object_store_path(store, tensors, run_id)
            _say_phases("object store", mb_real, res, 2)
        elif method == "filesystem":
            res = filesystem_path(scratch / "fs-weights", tensors, run_id, shard_size)
            _say_phases("filesystem", mb_real, res, 2)
        elif method == "shared":
            res = shared_path(tensors, run_id)
            _say_phases("shared", mb_real, res, 3, f"; memcpy {res['memcpy_s']:.3f} s")
        elif method == "cuda_ipc":
            res = cuda_ipc_path(tensors, run_id)
            extra = f"; device memcpy {res['memcpy_s']:.4f} s; bytes equal {res['bytes_equal']}"
            _say_phases("cuda_ipc", mb_real, res, 4, extra)
        else:
            res = nccl_path(tensors)
            say(
                f"nccl (gloo, {BUCKET_MB} MB buckets, child up in {res['spawn_s']:.1f} s):"
                f" open_epoch + first broadcast {res['first_broadcast_s']:.2f} s"
                f" -> {mb_real / res['first_broadcast_s']:.0f} MB/s; second broadcast"
                f" {res['broadcast_s']:.2f} s -> {mb_real / res['broadcast_s']:.0f} MB/s;"
                f" bytes equal: {res['bytes_equal']}"
            )
        done[method] = res

    t0 = time.perf_counter()
    shards = [data for _names, data in shard_state_dict(tensors, shard_size)]
    t1 = time.perf_counter()
    for data in shards:
        hashlib.sha256(data).hexdigest()
    t2 = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(shards)))) as pool:
        list(pool.map(lambda data: hashlib.sha256(data).hexdigest(), shards))
    t3 = time.perf_counter()
    serialize_s, sha256_s, sha256_threads_s = t1 - t0, t2 - t1, t3 - t2
    del tensors
    base = copy_baseline(shards, scratch / "copy-baseline")
    shard_bytes = sum(len(s) for s in shards)
    n_shards = len(shards)
    del shards
    copy_total = base["write_s"] + base["copy_s"]
    copy_mb_s = mb_real / copy_total
    say(
        f"file baseline ({shard_bytes / MIB:.1f} MB of safetensors): write {base['write_s']:.2f} s,"
        f" copyfile {base['copy_s']:.2f} s -> {copy_mb_s:.0f} MB/s;"
        f" read back {base['read_s']:.2f} s"
    )
    say(
        f"for reference: serialize {serialize_s:.2f} s, one sha256 pass {sha256_s:.2f} s"
        f" ({sha256_threads_s:.2f} s on up to {HASH_THREADS} threads, as the stores hash)"
    )
    # the raw bounds of the store-like methods: a publication can be no faster than hashing
    # its shards or writing them durably; a fetch than hashing them or reading them back
    bounds = {
        "publish_s": max(sha256_threads_s, base["write_s"] + base["fsync_s"]),
        "fetch_verify_s": max(sha256_threads_s, base["read_s"]),
    }
    say(
        f"raw bounds: publish max(hash, write + fsync) {bounds['publish_s']:.2f} s,"
        f" fetch max(hash, read) {bounds['fetch_verify_s']:.2f} s"
    )

    osp = done.get("object_store")
    mb_s = _phases(mb_real, osp)[1] if osp else None
    result: dict[str, Any] = {
        "bench": "weight_sync",
        "method": "object_store",
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "mb": round(mb_real, 1),
        "publish_s": round(osp["publish_s"], 3) if osp else None,
        "fetch_verify_s": round(osp["fetch_verify_s"], 3) if osp else None,
        "apply_s": round(osp["apply_s"], 3) if osp else None,
        "mb_s": round(mb_s, 1) if mb_s else None,
        "copy_mb_s": round(copy_mb_s, 1),
        "ratio_vs_copy": round(mb_s / copy_mb_s, 4) if mb_s else None,
        "write_s": round(base["write_s"], 3),
        "copy_s": round(base["copy_s"], 3),
        "read_s": round(base["read_s"], 3),
        "serialize_s": round(serialize_s, 3),
        "fsync_s": round(base["fsync_s"], 3),
        "sha256_s": round(sha256_s, 3),
        "sha256_threads_s": round(sha256_threads_s, 3),
        "hash_threads": HASH_THREADS,
        "publish_bound_s": round(bounds["publish_s"], 3),
        "fetch_bound_s": round(bounds["fetch_verify_s"], 3),
        **(_vs_bounds(osp, bounds) if osp else {}),
        "shards": n_shards,
        "shard_bytes": int(osp["shard_bytes"]) if osp else shard_bytes,
        "part_size_mb": store.part_size_mb if store else None,
        "parallel": store.parallel if store else None,
        "methods": {},
    }
    fs = done.get("filesystem")
    if fs:
        result["methods"]["filesystem"] = {
            **_phase_figures(mb_real, fs, copy_mb_s, 3),
            **_vs_bounds(fs, bounds),
            "shard_bytes": int(fs["shard_bytes"]),
        }
    sh = done.get("shared")
    if sh:
        result["methods"]["shared"] = {
            **_phase_figures(mb_real, sh, copy_mb_s, 4),
            "memcpy_s": round(sh["memcpy_s"], 4),
            "memcpy_mb_s": round(mb_real / sh["memcpy_s"], 1),
            # the two copies of a handoff (write + hash, read + verify) against two memcpys
            "handoff_ratio_vs_memcpy": round(
                2 * sh["memcpy_s"] / (sh["publish_s"] + sh["fetch_verify_s"]), 4
            ),
            # with the explorer's copy into its model: three copies against three memcpys
            "version_ratio_vs_memcpy": round(
                3 * sh["memcpy_s"] / (sh["publish_s"] + sh["fetch_verify_s"] + sh["apply_s"]), 4
            ),
        }
    ipc = done.get("cuda_ipc")
    if ipc:
        result["methods"]["cuda_ipc"] = {
            **_phase_figures(mb_real, ipc, copy_mb_s, 4),
            "first_fetch_s": round(ipc["first_fetch_s"], 4),
            "memcpy_s": round(ipc["memcpy_s"], 4),
            "memcpy_mb_s": round(mb_real / ipc["memcpy_s"], 1),
            # what the explorer pays (its copy out of the slot, verified, and into its
            # parameters) against one device copy of the same bytes
            "version_ratio_vs_memcpy": round(
                ipc["memcpy_s"] / (ipc["fetch_verify_s"] + ipc["apply_s"]), 4
            ),
            "bytes_equal": ipc["bytes_equal"],
            "verified_tensors": ipc["verified_tensors"],
        }
    nc = done.get("nccl")
    if nc:
        rate = mb_real / nc["broadcast_s"]
        result["methods"]["nccl"] = {
            "backend": "gloo",
            "bucket_mb": BUCKET_MB,
            "first_broadcast_s": round(nc["first_broadcast_s"], 3),
            "broadcast_s": round(nc["broadcast_s"], 3),
            "first_mb_s": round(mb_real / nc["first_broadcast_s"], 1),
            "mb_s": round(rate, 1),
            "ratio_vs_copy": round(rate / copy_mb_s, 4),
            "bytes_equal": nc["bytes_equal"],
            "verified_tensors": nc["verified_tensors"],
            "first_receive_s": round(nc["first_receive_s"], 3),
            "receive_s": round(nc["receive_s"], 3),
        }
    return result


def parse_methods(text: str, device: str = "cpu") -> list[str]:
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown or no methods {unknown} (choose from {', '.join(METHODS)})")
    if device == "cpu" and "cuda_ipc" in methods:
        raise ValueError("cuda_ipc moves tensors between GPUs' memory: use --device cuda")
    if device == "cuda" and "nccl" in methods:
        raise ValueError("nccl is not measured with --device cuda (one GPU, one NCCL rank)")
    return methods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=None, help="state dict MiB (default 500)")
    ap.add_argument("--quick", action="store_true", help="tiny run (8 MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument(
        "--methods",
        help=f"comma list of sync methods to time (default {','.join(CPU_METHODS)}; "
        f"on cuda {','.join(CUDA_METHODS)})",
    )
    defaults = ObjectStoreConfig()
    ap.add_argument(
        "--part-mb",
        type=int,
        default=defaults.part_size_mb,
        help=f"object store part / range size in MiB (default {defaults.part_size_mb})",
    )
    ap.add_argument(
        "--shard-mb",
        type=int,
        default=defaults.shard_size_mb,
        help=f"largest shard in MiB, both stores (default {defaults.shard_size_mb})",
    )
    ap.add_argument(
        "--parallel",
        type=int,
        default=defaults.parallel,
        help=f"object store parts / ranges in flight (default {defaults.parallel})",
    )
    args = ap.parse_args(argv)
    mb = args.mb if args.mb is not None else (8.0 if args.quick else 500.0)
    if mb <= 0:
        ap.error("--mb must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no GPU")
    default = CUDA_METHODS if args.device == "cuda" else CPU_METHODS
    try:
        methods = parse_methods(args.methods or ",".join(default), args.device)
    except ValueError as exc:
        ap.error(f"--methods: {exc}")
    torch.set_num_threads(1)

    # SIGTERM -> SystemExit so that the finally blocks stop the services and the child
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="streamrft-bench-weights-"))
    services = None
    try:
        store = None
        if "object_store" in methods:
            services = LocalServices(tmp / "services", broker=False, object_store=True)
            eps = services.start()
            store = ObjectStoreConfig(
                endpoint=eps.s3_endpoint,
                access_key=eps.access_key or "",
                secret_key=eps.secret_key or "",
                part_size_mb=args.part_mb,
                parallel=args.parallel,
                shard_size_mb=args.shard_mb,
            )
            say(
                f"object store at {eps.s3_endpoint} (JuiceFS gateway), parts of"
                f" {store.part_size_mb} MiB, {store.parallel} in flight"
            )
        say(f"methods {', '.join(methods)}; {mb:g} MB, torch threads 1")
        result = run(
            store, methods, mb, args.seed, tmp, args.shard_mb, args.device, DTYPES[args.dtype]
        )
    finally:
        if services is not None:
            services.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    parts = [f"{result['copy_mb_s']} MB/s file copy"]
    if result["mb_s"] is not None:
        parts.insert(0, f"object store {result['mb_s']} MB/s (ratio {result['ratio_vs_copy']})")
    parts += [
        f"{name} {fig['mb_s']} MB/s (ratio {fig['ratio_vs_copy']})"
        for name, fig in result["methods"].items()
    ]
    say(f"overall: {', '.join(parts)} (wall {time.perf_counter() - t_start:.1f} s)")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
