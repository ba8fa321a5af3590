"""Checkpoints in the object store, so that a trainer on any host resumes the run.

``s3://<bucket>/<run id>/checkpoints/step_00000050/``: the files of the local checkpoint
folder (``consumers/checkpoint.py``: model, optimizer, state, extras), then
``manifest.json`` (each file's size and sha256, the step and version): a checkpoint whose
manifest is there is complete, one without is an upload that did not finish and is never
read. Uploads run in a thread while the trainer trains on (:class:`CheckpointUploads`;
a daemon thread: a trainer stopped by a signal gives up on one after
:data:`STOP_DRAIN_S` and exits without waiting for it);
a trainer starting anywhere first fetches the store's newest complete checkpoint when it
is newer than its local one (:meth:`CheckpointStore.fetch_newer`), checking every file's
sha256, into its local checkpoints folder (the cache: a checkpoint already there is not
downloaded again). The store keeps ``trainer.keep_checkpoints`` checkpoints (0: all); a
step the trainer marked ``keep`` locally is kept there too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from streamrft.consumers.checkpoint import KEEP_MARKER, marked_keep, point_latest, unmark_keep
from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.consumers.state import TrainerState
from streamrft.infra.bus import Counters
from streamrft.infra.config import Config
from streamrft.infra.daemon_call import on_daemon_thread
from streamrft.infra.durable import fsync_path
from streamrft.schemas.errors import IntegrityError, ServiceError, SyncError
from streamrft.sync.weights import sha256_hex

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def _step_of(name: str) -> int | None:
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def _latest_step(root: Path) -> int | None:
    """The step of the checkpoint ``latest`` names in ``root`` (None: none)."""
    local = latest_checkpoint(root)
    return _step_of(local.name.removesuffix(".prev")) if local is not None else None


class CheckpointStore:
    """The run's checkpoints under ``<run id>/checkpoints/`` in its bucket."""

    def __init__(self, cfg: Config, quick: bool = False) -> None:
        """``quick``: a client with short timeouts and the bucket taken as made, for the
        run's small records (:class:`StoredRecord`): a store that does not answer fails a
        call within seconds (:data:`~streamrft.sync.object_store.QUICK_TIMEOUT`)."""
        from streamrft.sync.object_store import S3Store

        self.store = S3Store(cfg.object_store, create_bucket=not quick, quick=quick)
        self.prefix = f"{cfg.run.id}/checkpoints"
        self.keep = cfg.trainer.keep_checkpoints

    def _key(self, step_dir: str, name: str) -> str:
        return f"{self.prefix}/{step_dir}/{name}"

    # -- up ----------------------------------------------------------------------------------
    def upload(self, folder: Path, state: TrainerState) -> str:
        """Every file of the checkpoint ``folder`` (named ``step_N``, or a staging folder
        for it: ``step``), then its manifest; returns the manifest's uri. Raises
        :class:`SyncError` when the store fails."""
        step_dir = f"step_{state.step:08d}"
        files = {}
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            key = self._key(step_dir, path.name)
            with open(path, "rb") as f:  # hashed and sent from one open file: they agree
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    self.store.put(key, b"", "application/octet-stream")
                    files[path.name] = {"size": 0, "sha256": sha256_hex(b"")}
                    continue
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    view = memoryview(m)
                    try:
                        files[path.name] = {
                            "size": size,
                            "sha256": sha256_hex(view),
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
        key = self._key(step_dir, MANIFEST)
        self.store.put(key, json.dumps(manifest, indent=1).encode(), "application/json")
        return self.store.uri(key)

    def prune(self) -> None:
        """Delete the stored checkpoints older than the newest ``keep`` complete ones,
        except those holding a ``keep`` file (each manifest first, so that none is ever
        read half deleted), and the files of uploads that never completed below the
        newest complete one."""
        complete = sorted(self.complete())
        if not complete:
            return
        newest = complete[-1][0]
        doomed = [] if self.keep == 0 else complete[: max(len(complete) - self.keep, 0)]
        for step, manifest in doomed:
            if KEEP_MARKER in manifest["files"]:
                continue
            step_dir = f"step_{step:08d}"
            self.store.remove(self._key(step_dir, MANIFEST))
            self.store.remove(f"{self.prefix}/{step_dir}/")
        done = {step for step, _ in complete}
        for step in self._steps():
            if step < newest and step not in done:  # an upload cut short: never to be read
                self.store.remove(f"{self.prefix}/step_{step:08d}/")

    def unmark(self, step: int) -> None:
        """Take the keep mark off the checkpoint of ``step`` in the store (its manifest
        rewritten without it): retention may then remove it."""
        name = f"step_{step:08d}"
        try:
            manifest = json.loads(self.store.get(self._key(name, MANIFEST)))
        except ValueError as exc:
            raise IntegrityError(f"checkpoint {name} in the store: manifest: {exc}") from exc
        if manifest["files"].pop(KEEP_MARKER, None) is None:
            return
        self.store.put(self._key(name, MANIFEST), json.dumps(manifest).encode(), "application/json")
        self.store.remove(self._key(name, KEEP_MARKER))

    def remove_unfinished(self) -> int:
        """Abort the multipart uploads a killed trainer left (their parts take space)."""
        return self.store.remove_leftovers(f"{self.prefix}/")

    # -- the run's small records beside its checkpoints ------------------------------------
    def read_record(self, name: str) -> bytes | None:
        """The object ``name`` beside the checkpoints (``<run id>/checkpoints/<name>``), or
        None when there is none; :class:`SyncError` when the store cannot be read."""
        key = f"{self.prefix}/{name}"
        if key not in self._objects(key):
            return None
        return self.store.get(key)

    def write_record(self, name: str, data: bytes) -> None:
        """Replace the object ``name`` beside the checkpoints (one PUT: whole or not at all)."""
        self.store.put(f"{self.prefix}/{name}", data, "application/json")

    # -- down --------------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, dict[str, Any]]]:
        """(step, manifest) of every complete checkpoint in the store."""
        out = []
        for name in self._objects():
            if not name.endswith(f"/{MANIFEST}"):
                continue
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

    def _steps(self) -> set[int]:
        steps = set()
        for name in self._objects():
            if name.endswith("/"):  # a folder marker some gateways list (JuiceFS): no data
                continue
            step = _step_of(name[len(self.prefix) + 1 :].split("/")[0])
            if step is not None:
                steps.add(step)
        return steps

    def _objects(self, prefix: str = "") -> list[str]:
        """The names of the objects under ``prefix`` (default: every checkpoint's)."""
        from streamrft.sync.object_store import store_error

        prefix = prefix or f"{self.prefix}/"
        try:
            objects = self.store.client.list_objects(
                self.store.cfg.bucket, prefix=prefix, recursive=True
            )
            return [o.object_name for o in objects]
        except Exception as exc:  # minio's and urllib3's errors: the store cannot be read
            raise store_error(f"listing s3://{self.store.cfg.bucket}/{prefix}", exc) from exc

    def fetch_newer(self, root: Path) -> Path | None:
        """Download the store's newest complete checkpoint that is newer than the local one
        into ``root`` (made ``latest``); returns it, or None when the local one is as new
        (or none in the store is usable). A checkpoint with a file whose size or sha256
        differs from its manifest is skipped with a warning (nothing of it installed) and
        the next older one tried."""
        local_step = _latest_step(root)
        for step, manifest in sorted(self.complete(), key=lambda item: -item[0]):
            if local_step is not None and local_step >= step:
                return None
            try:
                return self._download(root, step, manifest)
            except IntegrityError as exc:
                log.warning("trainer: %s; trying an older checkpoint", exc)
        return None

    def fetch_missing(self, root: Path, steps: set[int] | None = None) -> list[Path]:
        """Download the store's complete checkpoints of ``steps`` (None: every one) that
        ``root`` lacks, oldest first (what ``streamrft score`` reads on a host the trainer
        never ran on); one whose files differ from its manifest is skipped with a warning.
        ``latest`` names the newest checkpoint in ``root`` afterwards."""
        have = {_step_of(p.name) for p in root.glob("step_*")} if root.is_dir() else set()
        held = _latest_step(root)
        got = []
        for step, manifest in sorted(self.complete(), key=lambda item: item[0]):
            if (steps is None or step in steps) and step not in have:
                try:  # ``latest`` never points back meanwhile: a trainer may resume from it
                    got.append(self._download(root, step, manifest, latest=False))
                except IntegrityError as exc:
                    log.warning("%s; skipped", exc)
                    continue
                if held is None or step > held:  # ascending: the last one kept is the newest
                    held = step
                    point_latest(root, got[-1].name)
        return got

    def _download(
        self, root: Path, step: int, manifest: dict[str, Any], latest: bool = True
    ) -> Path:
        name = f"step_{step:08d}"
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".fetch_{name}"  # not the trainer's own .tmp_ (its saves clear them)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            for file, meta in manifest["files"].items():
                if "/" in file or file.startswith(".") or not file:
                    raise IntegrityError(f"checkpoint {name} in the store: file name {file!r}")
                with open(tmp / file, "wb") as out:
                    digest = self.store.download_to(self._key(name, file), meta["size"], out)
                    out.flush()
                    os.fsync(out.fileno())
                if digest != meta["sha256"]:
                    raise IntegrityError(
                        f"checkpoint {name} in the store: {file} is not what its manifest says "
                        "(sha256 differs)"
                    )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_path(tmp)
        final = root / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(root)
        if latest:
            point_latest(root, name)
        log.info("trainer: checkpoint %s fetched from the store into %s", name, root)
        return final


class StoredRecord:
    """A small record of the run kept beside its checkpoints in the store (the trainer's
    poison record, ``consumers/poison.py``): a :class:`~.poison.RecordPlace`."""

    def __init__(self, store: CheckpointStore, name: str) -> None:
        self.store = store
        self.name = name
        self.where = store.store.uri(f"{store.prefix}/{name}")

    def read(self) -> bytes | None:
        return self.store.read_record(self.name)

    def write(self, data: bytes) -> None:
        self.store.write_record(self.name, data)


STAGING = ".upload_"
"""Prefix of the folder a checkpoint's files are linked into while they upload: local
retention may delete the checkpoint folder meanwhile, the links keep the files."""
RETRIES = 3
"""Tries of one upload before it is given up (a newer checkpoint is tried afresh)."""
RETRY_S = 5.0
STOP_DRAIN_S = 10.0
"""How long a trainer stopped by a signal waits for its last upload."""
UPLOAD = "checkpoint-upload"
"""The name of the daemon threads the store calls of the uploads run on."""


def stage(folder: Path) -> Path:
    """Hard links to ``folder``'s files in a staging folder beside it (same file system:
    no copy), which nothing but the upload deletes."""
    # a name of its own: the same step saved again is staged while the first one uploads
    staged = folder.parent / f"{STAGING}{folder.name}.{uuid.uuid4().hex[:8]}"
    staged.mkdir()
    for path in folder.iterdir():
        if path.is_file():
            os.link(path, staged / path.name)
    return staged


class CheckpointUploads:
    """The trainer's uploads, one at a time in a thread while it trains on: a checkpoint
    made while one uploads waits; a newer one replaces a waiting one (only the newest
    matters), unless that one is marked ``keep`` (``trainer.keep_best``): it goes too.
    ``on_durable(state)`` runs on the event loop once a checkpoint is complete in the store
    (the trainer commits its offsets then). A failed upload is tried again
    (:data:`RETRIES`) unless a newer checkpoint is waiting; failures are counted in
    ``counters`` (``checkpoint_upload_failures``) and logged."""

    def __init__(
        self,
        store: CheckpointStore,
        on_durable: Callable[[TrainerState], Awaitable[None]],
        counters: Counters,
    ) -> None:
        self.store = store
        self.on_durable = on_durable
        self.counters = counters
        self._waiting: list[tuple[Path, TrainerState]] = []
        self._uploading: int | None = None
        """The step of the upload under way."""
        self._unmark_after: set[int] = set()
        """Steps whose keep mark comes off in the store once their upload is complete."""
        self._task: asyncio.Task[None] | None = None

    def submit(self, folder: Path, state: TrainerState) -> None:
        staged = stage(folder)
        kept = []
        for waiting in self._waiting:  # the same step saved again replaces its own, too
            if waiting[1].step != state.step and marked_keep(waiting[0]):
                kept.append(waiting)
            else:
                shutil.rmtree(waiting[0], ignore_errors=True)
        self._waiting = [*kept, (staged, state)]
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._work(), name="checkpoint-upload")

    async def _work(self) -> None:
        while self._waiting:
            staged, state = self._waiting.pop(0)
            self._uploading = state.step
            try:
                await self._upload(staged, state)
            finally:
                self._uploading = None
                shutil.rmtree(staged, ignore_errors=True)
            if state.step in self._unmark_after:
                self._unmark_after.discard(state.step)
                await self._unmark_now(state.step)

    async def _upload(self, staged: Path, state: TrainerState) -> None:
        for attempt in range(1, RETRIES + 1):
            t0 = time.perf_counter()
            try:
                uri = await on_daemon_thread(self.store.upload, staged, state, name=UPLOAD)
                break
            except (SyncError, OSError) as exc:
                self.counters.add("checkpoint_upload_failures")
                log.warning(
                    "trainer: checkpoint of step %d not uploaded (try %d of %d): %s",
                    state.step,
                    attempt,
                    RETRIES,
                    exc,
                )
                # a best is tried to the end; another gives way to a newer one waiting
                if (self._waiting and not marked_keep(staged)) or attempt == RETRIES:
                    return  # a newer one goes instead, or it stays local
                await asyncio.sleep(RETRY_S)
        self.counters.add("checkpoints_stored")
        log.info(
            "trainer: checkpoint step_%08d in the store (%s, %.1f s)",
            state.step,
            uri,
            time.perf_counter() - t0,
        )
        await self.on_durable(state)
        try:
            await on_daemon_thread(self.store.prune, name=UPLOAD)
        except SyncError as exc:
            log.warning("trainer: old checkpoints in the store not pruned (%s); later", exc)

    async def unmark(self, step: int) -> None:
        """Take the keep mark off the checkpoint of ``step`` (a best no longer): off its
        waiting upload, after its upload under way, or in the store now."""
        for staged, state in self._waiting:
            if state.step == step:
                unmark_keep(staged)
                return
        if self._uploading == step:
            self._unmark_after.add(step)
            return
        await self._unmark_now(step)

    async def _unmark_now(self, step: int) -> None:
        try:
            await on_daemon_thread(self.store.unmark, step, name=UPLOAD)
        except (SyncError, ServiceError) as exc:
            log.warning("trainer: the store keeps step %d marked (%s)", step, exc)

    async def drain(self, stopping: bool = False) -> None:
        """Wait for the uploads under way and waiting (the last checkpoint of a run); a
        trainer stopped by a signal waits :data:`STOP_DRAIN_S` at most, then abandons
        them: the store calls run on daemon threads, which end with the process, and the
        offsets of a checkpoint whose upload did not finish are never committed."""
        if self._task is None or self._task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), STOP_DRAIN_S if stopping else None)
        except TimeoutError:
            self._task.cancel()  # its thread goes on alone, and ends with the process
            log.warning(
                "trainer: stopping with the last checkpoint's upload unfinished after %.0f s; "
                "it is abandoned (its offsets are not committed) and stays on this host's "
                "disk",
                STOP_DRAIN_S,
            )
