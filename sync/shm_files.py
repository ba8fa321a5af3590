"""The files the same-host weight paths keep in ``/dev/shm`` (``shared``'s version files,
``cuda_ipc``'s lease files), and removing those of trainers now gone.

Names only, without torch: ``streamrft run`` and ``streamrft infra clean`` clean up
before any model is loaded. A file is ``streamrft-<run id>-<trainer pid>-<slot>``.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

SHM_DIR = "/dev/shm"

SLOTS = ("0", "1", "base")
"""``shared``'s slots: two files versions alternate in, and a LoRA run's full version
(the base its adapters apply on, sent once per trainer: it must outlive the adapters
after it)."""

LEASE_SLOTS = ("cuda0", "cuda1")
"""``cuda_ipc``'s lease files, one per slot of GPU memory."""


def file_prefix(run_id: str) -> str:
    return f"streamrft-{run_id}-"


def is_version_file(run_id: str, name: str) -> bool:
    """Whether ``name`` is one of run ``run_id``'s version files (a trainer's, by its pid and
    slot): the only files of the folder a receiver maps."""
    slots = "|".join(re.escape(slot) for slot in SLOTS)
    return re.fullmatch(re.escape(file_prefix(run_id)) + rf"\d+-({slots})", name) is not None


def remove_leftovers(
    run_id: str = "", folder: str = SHM_DIR, slots: tuple[str, ...] = SLOTS
) -> list[str]:
    """Remove the version files that trainers now gone left in ``folder`` (killed before
    they could), of any run, by the pid in each name, checked across pid reuse
    (:func:`~streamrft.infra.logfiles.remove_dead_leftovers`): a file whose trainer still
    runs is never touched, except this process's own of run ``run_id``, which the caller
    is about to write anew. Their names. A trainer calls this at start, before it writes
    its own; so do ``streamrft run`` and ``streamrft infra clean``. ``slots``: the files'
    last parts (:data:`LEASE_SLOTS` for ``cuda_ipc``'s lease files)."""
    from streamrft.infra.logfiles import remove_dead_leftovers

    names = "|".join(re.escape(slot) for slot in slots)
    removed = []
    if run_id:
        mine = re.compile(re.escape(f"{file_prefix(run_id)}{os.getpid()}-") + f"({names})")
        with contextlib.suppress(FileNotFoundError):  # no such folder here (not Linux)
            for name in sorted(os.listdir(folder)):
                if mine.fullmatch(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(folder, name))
                        removed.append(name)
    any_run = rf"streamrft-[A-Za-z0-9_-]+-(?P<pid>\d+)-({names})"  # file_prefix(any run id)
    return removed + remove_dead_leftovers(Path(folder), any_run)  # which logs them


def remove_all_leftovers() -> list[str]:
    """Both paths' files of trainers now gone, of any run (``streamrft run``, ``train``
    and ``infra clean`` call this)."""
    return remove_leftovers() + remove_leftovers(slots=LEASE_SLOTS)
