"""Shared-memory files kept mapped, and the one copy that moves a version into or out of
one, each piece hashed while it is still in the cache (the ``shared`` transport's hand-off).

A ``read``/``write`` of a file in ``/dev/shm`` goes through the kernel a page at a time; a
mapping kept from one version to the next makes the copy a plain ``memcpy`` (no page is
faulted in again: the files are rewritten in place, version after version). A mapping is
reused while its path names the same file (inode and size); the trainer never shrinks a
file that may be mapped (it replaces it with a new one: a mapping of a file that shrank
would fault on the pages it lost), so a mapping stays valid memory for as long as it is
kept, and the digest tells whether what was read is what the writer wrote. A mapping of a
file removed (a trainer that stopped) or replaced is dropped at the next receive, and an
explorer drops it when it applies a version too, whatever transport brought that one.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Any

import numpy as np

PIECE = 256 << 10
"""Bytes copied, then hashed, at a time: small enough to hash from the cache (a copy touches
twice that), large enough that the per-piece calls cost nothing beside the copy."""
KEEP = 3
"""Mappings a process keeps at most (the trainer's two version files and a LoRA base)."""


def address(buf: Any) -> int:
    """The address of a contiguous buffer's first byte (read-only ones too)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def copy_hashed(dst: memoryview, src: memoryview, digest: Any) -> None:
    """Copy ``src`` into ``dst`` (byte views of one size), a piece at a time, and feed each
    piece as it landed in ``dst`` to ``digest`` (an ``xxhash`` hasher). The copy runs
    without the GIL (``ctypes.memmove``)."""
    n = src.nbytes
    if dst.nbytes != n:
        raise ValueError(f"copy of {n} bytes into {dst.nbytes}")
    if not n:
        return
    to, of = address(dst), address(src)
    for lo in range(0, n, PIECE):
        size = min(PIECE, n - lo)
        ctypes.memmove(to + lo, of + lo, size)
        digest.update(dst[lo : lo + size])


class MappedFile:
    """A whole file mapped (shared: the writer's stores are the readers' loads)."""

    def __init__(self, path: str, fd: int, writable: bool) -> None:
        st = os.fstat(fd)
        self.path = path
        self.inode = st.st_ino
        self.size = st.st_size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, prot)
        self.view = memoryview(self._map).cast("B")

    def same_file(self, st: os.stat_result) -> bool:
        return st.st_ino == self.inode and st.st_size == self.size

    def close(self) -> None:
        self.view.release()
        self._map.close()


class Mappings:
    """The files a process keeps mapped, by path, at most :data:`KEEP`."""

    def __init__(self) -> None:
        self._maps: dict[str, MappedFile] = {}

    def get(self, path: str, fd: int, writable: bool = False) -> MappedFile:
        """The mapping of the file open as ``fd`` at ``path``: the one kept when it is the
        same file, else a new one (mappings of files gone or replaced are dropped first)."""
        self.prune()
        kept = self._maps.get(path)
        if kept is not None and kept.same_file(os.fstat(fd)):
            return kept
        self.drop(path)
        while len(self._maps) >= KEEP:
            self.drop(next(iter(self._maps)))
        mapped = self._maps[path] = MappedFile(path, fd, writable)
        return mapped

    def prune(self) -> None:
        """Drop the mappings whose path is gone or names another file now (their memory is
        freed once unmapped: a trainer's files after it stopped or restarted)."""
        for path, mapped in list(self._maps.items()):
            try:
                same = mapped.same_file(os.stat(path))
            except OSError:  # gone (or no longer ours to look at)
                same = False
            if not same:
                with contextlib.suppress(BufferError):  # still exported: unmapped with it
                    self.drop(path)

    def drop(self, path: str) -> None:
        mapped = self._maps.pop(path, None)
        if mapped is not None:
            mapped.close()

    def close(self) -> None:
        for path in list(self._maps):
            with contextlib.suppress(BufferError):
                self.drop(path)
