"""Weight sync through a shared folder (NFS, Lustre, a local disk on one box).

Same two-phase protocol as the object store (:mod:`.versions`): shards, then the manifest
last. Every file is written to a temporary name and renamed into place, so a reader never
sees half a file, and a version exists exactly when its manifest does.
"""

from __future__ import annotations

import os
from pathlib import Path

from streamrft.infra.config import Config
from streamrft.schemas.errors import SyncError
from streamrft.sync.versions import StoreLoader, StorePublisher
from streamrft.sync.weights import sha256_hex


def fs_root(cfg: Config) -> Path:
    """The shared folder of the ``filesystem`` method (``synchronizer.fs_dir``)."""
    return Path(cfg.synchronizer.fs_dir or Path(cfg.run.dir) / "weights")


class FolderStore:
    """A :class:`~streamrft.sync.versions.BlobStore` over a local or shared folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()

    def put(self, key: str, data: bytes, content_type: str) -> None:
        path = self.root / key
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise SyncError(f"writing {path}: {exc}") from exc

    def get(self, key: str) -> bytes:
        try:
            return (self.root / key).read_bytes()
        except OSError as exc:
            raise SyncError(f"reading {self.root / key}: {exc}") from exc

    def get_hashed(self, key: str) -> tuple[bytearray, str]:
        """Read into one buffer (decoded without another copy) and hash it."""
        path = self.root / key
        try:
            with path.open("rb") as fh:
                buf = bytearray(path.stat().st_size)
                if fh.readinto(buf) != len(buf):
                    raise SyncError(f"reading {path}: file changed while being read")
        except OSError as exc:
            raise SyncError(f"reading {path}: {exc}") from exc
        return buf, sha256_hex(buf)

    def uri(self, key: str) -> str:
        return (self.root / key).as_uri()

    def key(self, uri: str) -> str:
        if not uri.startswith("file://"):
            raise SyncError(f"not a file:// uri: {uri!r}")
        path = Path(uri[len("file://") :])
        try:
            return str(path.relative_to(self.root))
        except ValueError as exc:
            raise SyncError(f"{uri} is outside synchronizer.fs_dir {self.root}") from exc


class FilesystemPublisher(StorePublisher):
    def __init__(self, root: str | Path, run_id: str, max_shard_bytes: int) -> None:
        super().__init__(FolderStore(root), "filesystem", run_id, max_shard_bytes)


class FilesystemLoader(StoreLoader):
    def __init__(self, root: str | Path) -> None:
        super().__init__(FolderStore(root))
