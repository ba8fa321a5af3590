"""Serve mode's spool: experience groups that could not be published, waiting on disk.

A folder (``serve.spool_dir``, default ``<run dir>/serve/spool``) of files, one per batch
of groups, each a msgpack list of the groups' Kafka record values (the experience codec's
encoding, :data:`~streamrft.schemas.codec.EXPERIENCE_GROUP`). Pure file I/O, no Kafka:

- **Atomic.** A file is written under a temporary name (``.<name>.tmp-<pid>``), fsynced, renamed
  to its name and the folder fsynced: a file listed by :meth:`Spool.pending` is whole. A
  temporary file left by a crash is deleted by the next :class:`Spool` of the folder.
- **Ordered.** Names start with the time they were written in nanoseconds
  (``<ns>-<owner>-<seq>.spool``): sorted by name, oldest first.
- **Bounded.** :meth:`Spool.put` raises :class:`SpoolFull` when the folder's files would
  exceed ``max_bytes``; the check and the write hold the folder's lock file (``.lock``),
  so several processes sharing the folder keep the bound together.
- **Taken once.** :meth:`Spool.take` holds an exclusive ``flock`` on the file until
  :meth:`Spool.done` deletes it (or :meth:`Spool.release` gives it back): two processes
  never publish one file, and a process that dies lets go of what it held.
- A file that does not decode is renamed ``<name>.bad`` with a logged error, never read
  again.
- **Whole or absent.** An ``OSError`` from :meth:`Spool.put` (a full disk, a read-only or
  unwritable folder) leaves no file of the batch behind, and one from :meth:`Spool.done`
  leaves the file held: the caller keeps the groups, or deletes the file again later.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from streamrft.infra.durable import fsync_path, replace_durably
from streamrft.schemas.codec import EXPERIENCE_GROUP
from streamrft.schemas.errors import SchemaError, StreamRFTError
from streamrft.schemas.experience import ExperienceGroup

log = logging.getLogger(__name__)

SUFFIX = ".spool"
BAD_SUFFIX = ".bad"
LOCK_NAME = ".lock"
FORMAT = 1
"""Version of the file layout; a file of another version is set aside."""


class SpoolFull(StreamRFTError):
    """The spool's files would exceed its byte bound (``serve.spool_max_bytes``)."""

    retriable = True


class SpoolFile(msgspec.Struct, array_like=True):
    """One file: the layout's version and each group's record value."""

    format: int
    groups: list[bytes]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SpoolFile)


def encode(groups: Sequence[ExperienceGroup]) -> bytes:
    return _ENCODER.encode(SpoolFile(FORMAT, [EXPERIENCE_GROUP.encode(g) for g in groups]))


def decode(data: bytes) -> list[ExperienceGroup]:
    """The groups of one file; SchemaError when it is not a whole spool file of valid
    groups."""
    try:
        spooled = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"not a spool file: {exc}") from exc
    if spooled.format != FORMAT:
        raise SchemaError(f"spool file format {spooled.format}, expected {FORMAT}")
    return [EXPERIENCE_GROUP.decode(value) for value in spooled.groups]


@dataclass
class Taken:
    """A spool file held by this process (:meth:`Spool.take`) and its groups."""

    path: Path
    groups: list[ExperienceGroup]
    size: int
    fd: int


class Spool:
    """The spool folder ``folder``, written by ``owner`` (a server's id), bounded to
    ``max_bytes`` of files."""

    def __init__(self, folder: Path, max_bytes: int, owner: str) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.owner = owner
        self._seq = itertools.count()
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._locked():  # no one writes: a temporary file now is a crashed writer's
            for leftover in self.folder.glob(".*.tmp-*"):
                leftover.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The folder's lock: held while the bound is checked and a file written."""
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing lets go of the lock

    def _files(self) -> list[os.DirEntry]:
        with os.scandir(self.folder) as entries:
            return [e for e in entries if e.name.endswith(SUFFIX) and not e.name.startswith(".")]

    def size(self) -> int:
        """Bytes of the files waiting (every owner's)."""
        total = 0
        for entry in self._files():
            with contextlib.suppress(FileNotFoundError):  # taken and deleted meanwhile
                total += entry.stat().st_size
        return total

    def pending(self) -> list[Path]:
        """The files waiting, oldest first (every owner's, held by another or not)."""
        return sorted(Path(e.path) for e in self._files())

    def put(self, groups: Sequence[ExperienceGroup]) -> Path:
        """Write ``groups`` as one file (durable when this returns); :class:`SpoolFull`
        when the spool's files would then exceed ``max_bytes``; the ``OSError`` of a disk
        that refuses the file (full, read-only, no permission), with no file left."""
        data = encode(groups)
        with self._locked():
            used = self.size()
            if used + len(data) > self.max_bytes:
                raise SpoolFull(
                    f"the spool {self.folder} holds {used} bytes; {len(groups)} more groups "
                    f"({len(data)} bytes) would pass serve.spool_max_bytes={self.max_bytes}"
                )
            name = f"{time.time_ns():020d}-{self.owner}-{next(self._seq):06d}{SUFFIX}"
            path = self.folder / name
            try:
                replace_durably(path, data, mode=0o600)
            except OSError:
                # renamed in place but its folder not flushed: the caller keeps the groups,
                # so the file must not stay to be published a second time
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                raise
        return path

    def take(self, path: Path) -> Taken | None:
        """Hold ``path`` and read its groups. None when another process holds it, it is
        gone (published meanwhile), or it does not decode (then it is renamed ``*.bad``
        with a logged error). The ``OSError`` of a disk that refuses it, holding nothing."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # the holder before us may have published and deleted it: then ours is an
            # unlinked file, and the name is gone
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(path)
            data = _read_all(fd)
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return None
        except BaseException:  # a disk error: let go of it, taken again later
            os.close(fd)
            raise
        try:
            groups = decode(data)
        except SchemaError as exc:
            bad = path.with_name(path.name + BAD_SUFFIX)
            log.error("spool file %s does not decode (%s); set aside as %s", path, exc, bad.name)
            try:
                os.rename(path, bad)
            finally:  # a rename the disk refuses: let go of it too
                os.close(fd)
            return None
        return Taken(path, groups, len(data), fd)

    def done(self, taken: Taken) -> None:
        """Delete a file taken whose groups were all acknowledged, then let go of it (so
        no one takes it after). An ``OSError`` of the delete leaves it held and in place:
        call again (its groups are published; no one else may take it meanwhile)."""
        taken.path.unlink(missing_ok=True)
        try:
            fsync_path(self.folder)
        except OSError as exc:  # deleted, not yet on disk: a crash now may bring it back
            log.warning(
                "spool %s: the deletion of %s is not flushed: %s", self.folder, taken.path.name, exc
            )
        finally:
            os.close(taken.fd)

    def release(self, taken: Taken) -> None:
        """Let go of a file taken, keeping it (its publication failed)."""
        os.close(taken.fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
