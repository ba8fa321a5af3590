"""One interface per weight-sync transport, chosen by ``synchronizer.method``.

Store-based methods (``object_store``, ``filesystem``) publish a version as files and
announce it; explorers fetch it when they reach their sync point. The ``nccl`` method
broadcasts tensors over torch.distributed (see :mod:`.collective`) and keeps the object
store as its fallback and as the source for explorers that were not in the group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from streamrft.infra.config import Config
from streamrft.schemas.errors import SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.versions import StoreLoader, StorePublisher


def fs_root(cfg: Config) -> Path:
    return Path(cfg.synchronizer.fs_dir or Path(cfg.run.dir) / "weights")


def make_publisher(cfg: Config, method: str | None = None) -> StorePublisher:
    """The store publisher of ``method`` (default: the configured one; nccl → object store)."""
    method = method or cfg.synchronizer.method
    if method in ("object_store", "nccl"):
        from streamrft.sync.object_store import ObjectStorePublisher

        return ObjectStorePublisher(cfg.object_store, cfg.topics().run)
    if method == "filesystem":
        from streamrft.sync.filesystem import FilesystemPublisher

        return FilesystemPublisher(
            fs_root(cfg), cfg.topics().run, cfg.object_store.shard_size_mb << 20
        )
    raise SyncError(f"synchronizer.method: unknown method {method!r}")


class Loaders:
    """Explorer side: a loader per store method, made on first use (an event names its method)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._loaders: dict[str, StoreLoader] = {}

    def fetch(self, event: ModelVersionReady) -> dict[str, torch.Tensor]:
        loader = self._loaders.get(event.method)
        if loader is None:
            if event.method == "object_store":
                from streamrft.sync.object_store import ObjectStoreLoader

                loader = ObjectStoreLoader(self.cfg.object_store)
            elif event.method == "filesystem":
                from streamrft.sync.filesystem import FilesystemLoader

                loader = FilesystemLoader(fs_root(self.cfg))
            else:
                raise SyncError(
                    f"version {event.version}: no store loader for method {event.method!r}"
                )
            self._loaders[event.method] = loader
        return loader.fetch(event)
