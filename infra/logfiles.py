"""Size-capped log files of a run's processes, and what a crashed process leaves behind.

A child writes its log straight to the file (opened for appending, so that a parent that
dies takes nothing with it); the supervisor caps it from outside by copy and truncate: the
file is copied to ``<name>.1`` (older copies shifted up to ``<name>.<kept>``, the oldest
dropped) and cut to nothing, and the child's next write lands at the new end. A line being
written at the moment of the copy can be cut in two; nothing else is lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

from streamrft.infra.pids import held_for_writing, writer_gone

log = logging.getLogger(__name__)

LOG_TAIL_CHARS = 4000
"""How much of a log goes into an error message (:func:`log_tail`)."""
LOG_MAX_BYTES = 64 << 20
"""A log past this is rotated (64 MiB: a day of an explorer's INFO lines is ~10 MB)."""
LOGS_KEPT = 3
"""Rotated copies kept of each log (``.1`` newest): at most 4 x 64 MiB a process."""


def log_tail(path: Path, offset: int = 0) -> str:
    """The last :data:`LOG_TAIL_CHARS` of ``path`` from ``offset`` on ("" if unreadable)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            offset = offset if offset <= size else 0  # the log was rotated since
            start = max(offset, size - LOG_TAIL_CHARS)
            f.seek(start)
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def rotate(path: Path, max_bytes: int = LOG_MAX_BYTES, kept: int = LOGS_KEPT) -> bool:
    """Copy-truncate ``path`` when it is larger than ``max_bytes``; whether it was."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        for n in range(kept - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        os.truncate(path, 0)
    except OSError as exc:  # a full disk must not stop the run over its logs
        log.warning("could not rotate %s: %s", path, exc)
        return False
    return True


def rotate_all(folders: list[Path], max_bytes: int = LOG_MAX_BYTES, kept: int = LOGS_KEPT) -> int:
    """Rotate every ``*.log`` in ``folders`` that needs it; how many were."""
    done = 0
    for folder in folders:
        for path in sorted(folder.glob("*.log")):
            done += rotate(path, max_bytes, kept)
    return done


def remove_dead_leftovers(folder: Path, pattern: str) -> list[str]:
    """Remove the entries of ``folder`` whose name fully matches ``pattern`` (a regex with a
    ``pid`` group) and whose process is gone (:func:`~streamrft.infra.pids.writer_gone`:
    a pid now another process's counts as gone), and no process holds open for writing
    (:func:`~streamrft.infra.pids.held_for_writing`: a file's writer in another pid
    namespace, whose pid means nothing here): the temporary files and folders of a
    process that was killed before it could remove them. Returns their names."""
    regex = re.compile(pattern)
    removed = []
    with contextlib.suppress(OSError):
        for entry in sorted(folder.iterdir()):
            m = regex.fullmatch(entry.name)
            if m is None:
                continue
            try:
                changed_at = entry.lstat().st_mtime
            except FileNotFoundError:
                continue
            if not writer_gone(int(m["pid"]), changed_at):
                continue
            if entry.is_file() and held_for_writing(entry):  # a writer the pid misses: one
                continue  # of another pid namespace sharing the folder (--ipc=host)
            try:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            except OSError as exc:
                log.warning("could not remove %s, left by a process that is gone: %s", entry, exc)
                continue
            removed.append(entry.name)
    if removed:
        log.info("removed %d leftover(s) of processes that are gone in %s", len(removed), folder)
    return removed
