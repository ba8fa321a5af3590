"""Checkpoints in the object store, so that a trainer on any host resumes the run.

``s3://<bucket>/<run id>/checkpoints/step_00000050/``: the files of the local checkpoint
folder (``consumers/checkpoint.py``: model, optimizer, state, extras), then
``manifest.json`` (each file's size and sha256, the step and version): a checkpoint whose
manifest is there is complete, one without is an upload that did not finish and is never
read. Uploads run in a thread while the trainer trains on (:class:`CheckpointUploads`);
a trainer starting anywhere first fetches the store's newest complete checkpoint when it
is newer than its local one (:meth:`CheckpointStore.fetch_newer`), checking every file's
sha256, into its local checkpoints folder (the cache: a checkpoint already there is not
downloaded again). The store keeps ``trainer.keep_checkpoints`` checkpoints (0: all); a
step the trainer marked ``keep`` locally is kept there too.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from streamrft.consumers.checkpoint import KEEP_MARKER, latest_checkpoint, point_latest
from streamrft.consumers.state import TrainerState
from streamrft.infra.config import Config
from streamrft.infra.durable import fsync_path
from streamrft.schemas.errors import IntegrityError, SyncError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def _step_of(name: str) -> int | None:
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


class CheckpointStore:
    """The run's checkpoints under ``<run id>/checkpoints/`` in its bucket."""

    def __init__(self, cfg: Config) -> None:
        from streamrft.sync.object_store import S3Store

        self.store = S3Store(cfg.object_store, create_bucket=True)
        self.prefix = f"{cfg.run.id}/checkpoints"
        self.keep = cfg.trainer.keep_checkpoints

    def _key(self, step_dir: str, name: str) -> str:
        return f"{self.prefix}/{step_dir}/{name}"

    # -- up ----------------------------------------------------------------------------------
    def upload(self, folder: Path, state: TrainerState) -> str:
        """Every file of the checkpoint ``folder``, then its manifest; returns the
        manifest's uri. Raises :class:`SyncError` when the store fails."""
        files = {}
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            key = self._key(folder.name, path.name)
            with open(path, "rb") as f:  # hashed and sent from one open file: they agree
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    self.store.put(key, b"", "application/octet-stream")
                    files[path.name] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
                    continue
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    view = memoryview(m)
                    try:
                        files[path.name] = {
                            "size": size,
                            "sha256": hashlib.sha256(view).hexdigest(),
                        }
                        self.store.write(key, [view], "application/octet-stream")
                    finally:
                        view.release()
        manifest = {
            "step": state.step,
            "version": state.version,
            "files": files,
            "created_at": time.time(),
        }
        key = self._key(folder.name, MANIFEST)
        self.store.put(key, json.dumps(manifest, indent=1).encode(), "application/json")
        return self.store.uri(key)

    def prune(self) -> None:
        """Delete the stored checkpoints older than the newest ``keep`` complete ones, except
        those holding a ``keep`` file; each manifest first, so that none is ever read half
        deleted."""
        if self.keep == 0:
            return
        complete = sorted(self.complete())
        for step, manifest in complete[: max(len(complete) - self.keep, 0)]:
            if KEEP_MARKER in manifest["files"]:
                continue
            step_dir = f"step_{step:08d}"
            self.store.remove(self._key(step_dir, MANIFEST))
            self.store.remove(f"{self.prefix}/{step_dir}/")

    # -- down --------------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, dict[str, Any]]]:
        """(step, manifest) of every complete checkpoint in the store."""
        out = []
        for name in self._manifests():
            step = _step_of(name.split("/")[-2])
            if step is None:
                continue
            try:
                manifest = json.loads(self.store.get(name))
            except (SyncError, ValueError) as exc:
                log.warning("checkpoint manifest %s unreadable (%s); skipped", name, exc)
                continue
            out.append((step, manifest))
        return out

    def _manifests(self) -> list[str]:
        from streamrft.sync.object_store import store_error

        try:
            objects = self.store.client.list_objects(
                self.store.cfg.bucket, prefix=f"{self.prefix}/", recursive=True
            )
            return [o.object_name for o in objects if o.object_name.endswith(f"/{MANIFEST}")]
        except Exception as exc:  # minio's and urllib3's errors: the store cannot be read
            raise store_error(f"listing s3://{self.store.cfg.bucket}/{self.prefix}/", exc) from exc

    def fetch_newer(self, root: Path) -> Path | None:
        """Download the store's newest complete checkpoint into ``root`` (made ``latest``)
        when the local one is older or missing; returns it, or None when the local one is
        as new. A file whose size or sha256 differs from its manifest is an
        :class:`IntegrityError`: nothing is installed."""
        local = latest_checkpoint(root)
        local_step = _step_of(local.name.removesuffix(".prev")) if local is not None else None
        stored = self.complete()
        if not stored:
            return None
        step, manifest = max(stored, key=lambda item: item[0])
        if local_step is not None and local_step >= step:
            return None
        return self._download(root, step, manifest)

    def _download(self, root: Path, step: int, manifest: dict[str, Any]) -> Path:
        name = f"step_{step:08d}"
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp_{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for file, meta in manifest["files"].items():
            data = self.store.get(self._key(name, file))
            if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
                shutil.rmtree(tmp, ignore_errors=True)
                raise IntegrityError(
                    f"checkpoint {name} in the store: {file} is not what its manifest says "
                    f"({len(data)} bytes, sha256 differs or size {meta['size']} expected)"
                )
            with open(tmp / file, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_path(tmp)
        final = root / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(root)
        point_latest(root, name)
        log.info("trainer: checkpoint %s fetched from the store into %s", name, root)
        return final


class CheckpointUploads:
    """The trainer's uploads, one at a time in a thread while it trains on: a checkpoint
    made while one uploads waits; a newer one replaces a waiting one (only the newest
    matters). ``on_durable(state)`` runs on the event loop once a checkpoint is complete
    in the store (the trainer commits its offsets then)."""

    def __init__(
        self, store: CheckpointStore, on_durable: Callable[[TrainerState], Awaitable[None]]
    ) -> None:
        self.store = store
        self.on_durable = on_durable
        self._waiting: tuple[Path, TrainerState] | None = None
        self._task: asyncio.Task[None] | None = None
        self.uploaded = 0
        self.failures = 0
        self.last_error: SyncError | None = None

    def submit(self, folder: Path, state: TrainerState) -> None:
        self._waiting = (folder, state)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._work(), name="checkpoint-upload")

    async def _work(self) -> None:
        while self._waiting is not None:
            folder, state = self._waiting
            self._waiting = None
            t0 = time.perf_counter()
            try:
                uri = await asyncio.to_thread(self.store.upload, folder, state)
                await asyncio.to_thread(self.store.prune)
            except (SyncError, OSError) as exc:  # a folder pruned locally meanwhile: OSError
                self.failures += 1
                self.last_error = exc if isinstance(exc, SyncError) else SyncError(str(exc))
                log.warning("trainer: checkpoint %s not uploaded (%s)", folder.name, exc)
                continue
            self.uploaded += 1
            log.info(
                "trainer: checkpoint %s in the store (%s, %.1f s)",
                folder.name,
                uri,
                time.perf_counter() - t0,
            )
            await self.on_durable(state)

    async def drain(self) -> None:
        """Wait for the uploads under way and waiting (the last checkpoint of a run)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
