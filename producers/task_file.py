"""The feeder's tasks on disk: encoded once when it starts, read back by position.

A taskset of a million rows would take gigabytes as objects in memory; here each task is
one msgpack record in a file, and memory holds only an offset per task (8 bytes). Records
are read through a memory map, so what is read often stays in the page cache and the rest
costs nothing. The file has no name (an anonymous temporary file in the folder given): no
two feeders can share it, and its space returns to the disk when the process ends,
however it ends.
"""

from __future__ import annotations

import mmap
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path

import msgspec

from streamrft.schemas.experience import Task

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Task)


class TaskFile:
    """Tasks appended with :meth:`append`, then, after :meth:`seal`, read by position."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 (held until close())
        self._offsets = array("Q", [0])
        self._map: mmap.mmap | None = None
        self._sealed = False

    def append(self, task: Task) -> None:
        self._offsets.append(self._offsets[-1] + self._file.write(_ENCODER.encode(task)))

    def seal(self) -> None:
        """Done writing: the file is mapped for reading."""
        self._file.flush()
        self._sealed = True
        if len(self) and self._map is None:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> Task:
        if not self._sealed:
            raise RuntimeError("TaskFile: read before seal()")
        if self._map is None or not 0 <= i < len(self):
            raise IndexError(f"task {i} of {len(self)}")
        return _DECODER.decode(self._map[self._offsets[i] : self._offsets[i + 1]])

    def __iter__(self) -> Iterator[Task]:
        return (self[i] for i in range(len(self)))

    @property
    def size_bytes(self) -> int:
        """Bytes on disk."""
        return self._offsets[-1]

    def close(self) -> None:
        """Unmap and close: the disk space is returned."""
        if self._map is not None:
            self._map.close()
            self._map = None
        self._file.close()
