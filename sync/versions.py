"""Two-phase publication of a model version over any blob store, and its verified fetch.

The same protocol for every store-based method (object store, shared filesystem):

1. safetensors shards (and any extra files, e.g. a LoRA adapter config) are written;
2. ``manifest.json`` with each file's sha256 is written last: its presence = complete;
3. the caller emits ``ModelVersionReady`` with the manifest's sha256.

The loader checks the manifest against the event, then every shard against the manifest,
before a single tensor is returned. Layout: ``<run id>/v<version:08d>/<file>``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec
import torch

from streamrft.infra.bus import Counters
from streamrft.infra.daemon_call import on_daemon_thread
from streamrft.infra.retry import retrying
from streamrft.schemas.codec import decode_manifest, encode_manifest
from streamrft.schemas.errors import IntegrityError, SchemaError, SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.schemas.manifest import ShardInfo, WeightManifest
from streamrft.sync.transport import Announce, MakePayload, Payload, WeightReceiver, WeightSender
from streamrft.sync.weights import decode_shard, sha256_hex, shards_of, tensors_dtype, verify

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"

HASH_THREADS = min(8, os.cpu_count() or 1)
"""Shards hashed at once when a version is published (sha256 runs ~1-1.5 GB/s on one
core, slower than a local write: several shards, several cores)."""


class BlobStore(Protocol):
    """Where a method keeps its files: put/get whole objects by key, name them by URI."""

    def put(self, key: str, data: bytes, content_type: str) -> None: ...

    def write(self, key: str, chunks: Sequence[memoryview], content_type: str) -> None:
        """One object made of ``chunks`` in order (written as they are, never joined)."""
        ...

    def get(self, key: str) -> bytes: ...

    def get_hashed(self, key: str, size: int) -> tuple[torch.Tensor, str]:
        """The object of ``size`` bytes (the manifest's) as a uint8 tensor, and its sha256,
        hashed while it downloads. A stored object of another size is an
        :class:`IntegrityError`."""
        ...

    def uri(self, key: str) -> str: ...

    def key(self, uri: str) -> str: ...

    def remove(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (a version's folder); how many."""
        ...

    def remove_leftovers(self, prefix: str) -> int:
        """Delete what a writer killed mid-write left under ``prefix`` and no reader can
        see (temporary files, unfinished multipart uploads); how many."""
        ...


def version_prefix(run_id: str, version: int) -> str:
    return f"{run_id}/v{version:08d}"


def publish_version(
    store: BlobStore,
    *,
    method: str,
    run_id: str,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    step: int,
    max_shard_bytes: int,
    lora: bool = False,
    extra_files: Mapping[str, bytes] | None = None,
) -> ModelVersionReady:
    prefix = version_prefix(run_id, version)
    shards = shards_of(tensors, max_shard_bytes)  # views of the tensors: nothing copied
    infos = []
    threads = max(1, min(HASH_THREADS, len(shards)))
    with ThreadPoolExecutor(threads, thread_name_prefix="sha256") as hasher:
        # every shard's hash at once, on up to HASH_THREADS cores, while they upload in turn
        digests = [hasher.submit(shard.sha256) for shard in shards]
        for i, (shard, digest) in enumerate(zip(shards, digests, strict=True), start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            store.write(f"{prefix}/{name}", shard.chunks, "application/octet-stream")
            infos.append(
                ShardInfo(
                    name=name, sha256=digest.result(), bytes=shard.nbytes, tensors=shard.names
                )
            )
    files = []
    for name, data in (extra_files or {}).items():
        store.put(f"{prefix}/{name}", data, "application/octet-stream")
        files.append(ShardInfo(name=name, sha256=sha256_hex(data), bytes=len(data)))
    manifest = WeightManifest(
        version=version,
        step=step,
        run=run_id,
        shards=infos,
        total_bytes=sum(s.bytes for s in infos),
        lora=lora,
        created_at=time.time(),
        files=files,
        dtype=tensors_dtype(tensors),
    )
    blob = encode_manifest(manifest)
    store.put(f"{prefix}/{MANIFEST}", blob, "application/json")
    return ModelVersionReady(
        version=version,
        method=method,
        uri=store.uri(f"{prefix}/{MANIFEST}"),
        manifest_sha256=sha256_hex(blob),
        bytes=manifest.total_bytes,
        step=step,
        lora=lora,
        created_at=time.time(),
    )


def fetch_manifest(
    store: BlobStore, event: ModelVersionReady, run_id: str | None = None
) -> tuple[str, WeightManifest]:
    """The verified manifest of ``event`` and the key prefix of its files. ``run_id``: the
    manifest must be that run's (``<run id>/v<version>/manifest.json``), not another's."""
    what = f"manifest of version {event.version}"
    key = store.key(event.uri)
    if run_id is not None and key != f"{version_prefix(run_id, event.version)}/{MANIFEST}":
        raise IntegrityError(
            f"{what}: {event.uri} is not where run {run_id!r} keeps version {event.version}"
        )
    blob = store.get(key)
    verify(blob, event.manifest_sha256, what)
    try:
        manifest = decode_manifest(blob)
    except SchemaError as exc:  # digest-consistent, yet not a manifest this code reads
        raise IntegrityError(f"{what}: {exc}") from exc
    if manifest.version != event.version:
        raise IntegrityError(
            f"manifest at {event.uri} is version {manifest.version}, event says {event.version}"
        )
    check_manifest(manifest, event, what)
    return key.rsplit("/", 1)[0], manifest


def check_manifest(manifest: WeightManifest, event: ModelVersionReady, what: str) -> None:
    """File names that stay in the version's folder, and sizes that agree with the event,
    before anything is fetched or allocated."""
    for info in [*manifest.shards, *manifest.files]:
        name = info.name
        if not name or "/" in name or "\\" in name or name.startswith(".") or name == MANIFEST:
            raise IntegrityError(f"{what}: file name {name!r} refused")
        if info.bytes < 0:
            raise IntegrityError(f"{what}: {name} has {info.bytes} bytes")
    shard_bytes = sum(s.bytes for s in manifest.shards)
    if shard_bytes != manifest.total_bytes or shard_bytes != event.bytes:
        raise IntegrityError(
            f"{what}: its shards hold {shard_bytes} bytes, its total says "
            f"{manifest.total_bytes}, the event {event.bytes}"
        )


def fetch_version(
    store: BlobStore, event: ModelVersionReady, run_id: str | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the version, each shard verified before it is decoded (into views
    of the buffer it was downloaded into). Two shards at a time: one finishes (its last
    ranges, its hash) while the next downloads."""
    prefix, manifest = fetch_manifest(store, event, run_id)

    def fetch_shard(shard: ShardInfo) -> dict[str, torch.Tensor]:
        what = f"shard {shard.name} of version {event.version}"
        data, digest = store.get_hashed(f"{prefix}/{shard.name}", shard.bytes)
        verify(data, shard.sha256, what, actual=digest)
        return decode_shard(data, what)

    tensors: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(2, thread_name_prefix="fetch-shard") as pool:
        for part in pool.map(fetch_shard, manifest.shards):
            tensors.update(part)
    return tensors


def fetch_file(store: BlobStore, event: ModelVersionReady, name: str) -> bytes:
    """An extra file of the version (e.g. ``adapter_config.json``), verified."""
    prefix, manifest = fetch_manifest(store, event)
    for info in manifest.files:
        if info.name == name:
            data = store.get(f"{prefix}/{name}")
            verify(data, info.sha256, f"{name} of version {event.version}")
            return data
    raise IntegrityError(f"version {event.version} has no file {name!r}")


class StorePublisher:
    """Trainer side of a store-based method: shards, then the manifest, then the event."""

    def __init__(self, store: BlobStore, method: str, run_id: str, max_shard_bytes: int) -> None:
        self.store = store
        self.method = method
        self.run_id = run_id
        self.max_shard_bytes = max_shard_bytes

    def publish(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        step: int,
        *,
        lora: bool = False,
        extra_files: Mapping[str, bytes] | None = None,
    ) -> ModelVersionReady:
        return publish_version(
            self.store,
            method=self.method,
            run_id=self.run_id,
            tensors=tensors,
            version=version,
            step=step,
            max_shard_bytes=self.max_shard_bytes,
            lora=lora,
            extra_files=extra_files,
        )

    def retire(self, versions: Sequence[int]) -> int:
        """Delete the files of ``versions``; how many."""
        return sum(self.store.remove(version_prefix(self.run_id, v) + "/") for v in versions)

    def remove_leftovers(self) -> int:
        """Delete what an earlier trainer of this run, killed mid-write, left in the store
        (a version it never announced is overwritten or retired like any other)."""
        return self.store.remove_leftovers(self.run_id + "/")


class StoreLoader:
    """Explorer side: fetch a version, every byte verified before tensors are returned."""

    def __init__(self, store: BlobStore, run_id: str | None = None) -> None:
        self.store = store
        self.run_id = run_id
        """The run whose versions it loads (None: any run's, e.g. a test's or a tool's)."""

    def fetch(self, event: ModelVersionReady) -> dict[str, torch.Tensor]:
        return fetch_version(self.store, event, self.run_id)


class StoreSender(WeightSender):
    """Trainer side of a store method: publish (retried through a store outage), then
    announce. While the store is down the step waits here and explorers keep exploring on
    their current version."""

    def __init__(self, publisher: StorePublisher, outage_timeout_s: float, counters: Counters):
        self.publisher = publisher
        self.method = publisher.method
        self.outage_timeout_s = outage_timeout_s
        self.counters = counters
        self._cleaned = False

    async def _remove_leftovers(self) -> None:
        """Once, before the first version: what a killed trainer left (best effort: a
        store that is down now is waited for by the publication itself)."""
        self._cleaned = True
        try:
            removed = await asyncio.to_thread(self.publisher.remove_leftovers)
        except SyncError as exc:
            log.warning("%s: leftovers of an earlier trainer not removed: %s", self.method, exc)
            return
        if removed:
            log.info("%s: removed %d leftover(s) of an earlier trainer", self.method, removed)
            self.counters.add("leftovers_removed", removed)

    async def publish(self, payload: Payload) -> ModelVersionReady:
        """Write the version to the store; the event that will announce it."""
        if not self._cleaned:
            await self._remove_leftovers()
        publish = functools.partial(
            self.publisher.publish,
            payload.tensors,
            payload.version,
            payload.step,
            lora=payload.lora,
            extra_files=payload.extra_files or None,
        )
        event = await retrying(
            f"publishing version {payload.version} ({self.method})",
            # a daemon thread: a signalled trainer leaves an upload to a slow store behind
            lambda: on_daemon_thread(publish, name=f"store-v{payload.version}"),
            self.outage_timeout_s,
            lambda _exc: self.counters.add("publish_retries"),
        )
        return msgspec.structs.replace(event, base_version=payload.base_version)

    async def send(self, make: MakePayload, announce: Announce) -> ModelVersionReady:
        event = await self.publish(make(False))
        await announce(event)
        return event

    def retire(self, versions: Sequence[int]) -> None:
        self.publisher.retire(versions)


class StoreReceiver(WeightReceiver):
    """Explorer side of a store method: fetch and verify (the loader raises
    :class:`StoreUnavailable`, retriable, while the store is down)."""

    def __init__(self, loader: StoreLoader) -> None:
        self.loader = loader

    def receive(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return self.loader.fetch(event)
