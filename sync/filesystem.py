"""Weight sync through a shared folder (NFS, Lustre, a local disk on one box).

Same two-phase protocol as the object store (:mod:`.versions`): shards, then the manifest
last. Every file is written to a temporary name and renamed into place, so a reader never
sees half a file, and a version exists exactly when its manifest does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote, urlsplit

import torch

from streamrft.infra.config import Config, default_fs_dir
from streamrft.infra.durable import temporary_name
from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.sync.versions import StoreLoader, StorePublisher

#: Bytes read per call while the previous chunk is being hashed.
READ_CHUNK = 8 << 20


def fs_root(cfg: Config) -> Path:
    """The shared folder of the ``filesystem`` method (``synchronizer.fs_dir``)."""
    return Path(cfg.synchronizer.fs_dir or default_fs_dir(cfg.run.dir))


class FolderStore:
    """A :class:`~streamrft.sync.versions.BlobStore` over a local or shared folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()

    def put(self, key: str, data: bytes, content_type: str) -> None:
        self.write(key, [memoryview(data)], content_type)

    def write(self, key: str, chunks: Sequence[memoryview], content_type: str) -> None:
        """Write the chunks to a temporary name, fsync, rename into place."""
        path = self.root / key
        tmp = temporary_name(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)  # a large chunk goes straight to the file, no copy
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SyncError(f"writing {path}: {exc}") from exc

    def get(self, key: str) -> bytes:
        path = self._inside(key)
        try:
            with _open_regular(path) as fh:
                if (size := os.fstat(fh.fileno()).st_size) > MAX_SMALL_FILE:
                    raise IntegrityError(f"{path}: {size} bytes, more than a manifest holds")
                return fh.read()
        except OSError as exc:
            raise SyncError(f"reading {path}: {exc}") from exc

    def get_hashed(self, key: str, size: int) -> tuple[torch.Tensor, str]:
        """Read into one buffer (decoded without another copy), hashing each chunk while
        the next one is read. The file's size is checked before the buffer is allocated."""
        path = self._inside(key)
        digest = hashlib.sha256()
        hashed: Future | None = None
        try:
            with _open_regular(path) as fh, ThreadPoolExecutor(1) as hasher:
                if (actual := os.fstat(fh.fileno()).st_size) != size:
                    raise IntegrityError(f"{path}: {actual} bytes, the manifest says {size}")
                buf = torch.empty(size, dtype=torch.uint8)
                view = memoryview(buf.numpy())
                for start in range(0, size, READ_CHUNK):
                    chunk = view[start : start + READ_CHUNK]
                    read_fully(fh, chunk, path)
                    if hashed is not None:
                        hashed.result()
                    hashed = hasher.submit(digest.update, chunk)
                if hashed is not None:
                    hashed.result()
        except OSError as exc:
            raise SyncError(f"reading {path}: {exc}") from exc
        return buf, digest.hexdigest()

    def uri(self, key: str) -> str:
        return (self.root / key).as_uri()

    def key(self, uri: str) -> str:
        """The key of a ``file://`` uri (percent-decoded, as :meth:`uri` encodes it); a uri
        whose resolved path (``..`` and symbolic links followed) leaves the root is
        refused."""
        if not uri.startswith("file://"):
            raise SyncError(f"not a file:// uri: {uri!r}")
        path = Path(unquote(urlsplit(uri).path))
        if not path.is_absolute():
            raise SyncError(f"not an absolute file:// uri: {uri!r}")
        return self._relative(path, uri)

    def remove(self, prefix: str) -> int:
        """Delete the folder ``prefix`` (inside the root) and what it holds; how many files."""
        folder = self._inside(prefix.rstrip("/"))
        if not folder.is_dir():
            return 0
        files = sum(1 for f in folder.rglob("*") if f.is_file())
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            raise SyncError(f"removing {folder}: {exc}") from exc
        return files

    def remove_leftovers(self, prefix: str) -> int:
        """Delete the temporary files under the folder ``prefix`` that another process
        left (a trainer killed mid-write: its one writer is the trainer, so none of them is
        still being written); how many."""
        folder = self._inside(prefix.rstrip("/"))
        if not folder.is_dir():
            return 0
        mine = f".tmp-{os.getpid()}"
        removed = 0
        for f in folder.rglob(".*.tmp-*"):
            if f.is_file() and not f.name.endswith(mine):
                f.unlink(missing_ok=True)
                removed += 1
        return removed

    def _relative(self, path: Path, what: str) -> str:
        root = self.root.resolve()
        resolved = path.resolve()
        if not resolved.is_relative_to(root) or resolved == root:
            raise SyncError(f"{what} is outside synchronizer.fs_dir {self.root}")
        return resolved.relative_to(root).as_posix()

    def _inside(self, key: str) -> Path:
        """The path of ``key``, which must stay inside the root once resolved."""
        path = self.root / key
        self._relative(path, repr(key))
        return path


MAX_SMALL_FILE = 64 << 20
"""Largest manifest or extra file read whole (a manifest of 10^5 shards is ~20 MB)."""


def _open_regular(path: Path):
    """``path`` opened for reading, if it is a regular file: a FIFO, a device or a socket
    (which could block a read for ever) is refused without being read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise SyncError(f"reading {path}: {exc}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{path} is not a regular file: refusing to read it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def read_fully(fh, into: memoryview, path: Path) -> None:
    """Fill ``into`` from the file's current position."""
    filled = 0
    while filled < len(into):
        n = fh.readinto(into[filled:])
        if not n:
            raise SyncError(f"reading {path}: file changed while being read")
        filled += n


class FilesystemPublisher(StorePublisher):
    def __init__(self, root: str | Path, run_id: str, max_shard_bytes: int) -> None:
        super().__init__(FolderStore(root), "filesystem", run_id, max_shard_bytes)


class FilesystemLoader(StoreLoader):
    def __init__(self, root: str | Path, run_id: str | None = None) -> None:
        super().__init__(FolderStore(root), run_id)
