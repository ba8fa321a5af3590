"""Files that survive a crash: written whole under a temporary name, flushed to disk,
renamed into place, their folder flushed too. A reader after a crash sees the old file or
the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's contents (a folder: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """Where :func:`replace_durably` writes ``path`` before renaming it into place
    (``.<name>.tmp-<pid>``): a crashed writer's leftover matches ``.*.tmp-*``."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def replace_durably(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Make ``path`` hold ``data``, atomically and durably (the folder is created);
    ``mode``: its permissions (less the umask), e.g. ``0o600`` for a file holding secrets
    or user data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)
