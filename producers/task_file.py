"""The feeder's tasks on disk: encoded once when it starts, read back by position.

A taskset of a million rows would take gigabytes as objects in memory; here each task is
one msgpack record in a file, and memory holds only an offset per task (8 bytes). Records
are read through a memory map, so what is read often stays in the page cache and the rest
costs nothing.
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Iterator
from pathlib import Path

import msgspec

from streamrft.schemas.experience import Task

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Task)


class TaskFile:
    """Tasks appended with :meth:`append`, then, after :meth:`seal`, read by position."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = path.open("wb")
        self._offsets = array("Q", [0])
        self._map: mmap.mmap | None = None

    def append(self, task: Task) -> None:
        self._offsets.append(self._offsets[-1] + self._out.write(_ENCODER.encode(task)))

    def seal(self) -> None:
        """Done writing: the file is mapped for reading."""
        self._out.close()
        if len(self) and self._map is None:
            with self.path.open("rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> Task:
        if self._map is None:
            raise RuntimeError("TaskFile: read before seal()")
        return _DECODER.decode(self._map[self._offsets[i] : self._offsets[i + 1]])

    def __iter__(self) -> Iterator[Task]:
        return (self[i] for i in range(len(self)))

    def close(self) -> None:
        """Unmap and delete the file."""
        self._out.close()
        if self._map is not None:
            self._map.close()
            self._map = None
        self.path.unlink(missing_ok=True)
