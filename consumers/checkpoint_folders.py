"""Where the checkpoints under a run's ``checkpoints/`` folder are, read from the folder
names and ``latest`` alone (the layout :mod:`streamrft.consumers.checkpoint` writes).

Without torch, so that ``streamrft run`` (resume checks), ``export``, ``score`` and the
replay source find a run's checkpoints without importing it.
"""

from __future__ import annotations

import re
from pathlib import Path

_STEP_DIR = re.compile(r"step_(\d+)")


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` folder under ``root`` as (N, folder), complete or not, oldest
    first."""
    found = []
    for path in root.iterdir():
        m = _STEP_DIR.fullmatch(path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The folder ``latest`` names, or None when there is no complete checkpoint.

    A crash while the step ``latest`` names was being saved again can leave that folder
    aside as ``step_N.prev``; it is returned then.
    """
    marker = root / "latest"
    if not marker.is_file():
        return None
    name = marker.read_text().strip()
    for path in (root / name, root / f"{name}.prev"):
        if (path / "state.json").is_file():
            return path
    return None


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint under ``root`` as (step, folder), oldest first (none: an
    empty list). The one ``latest`` names is included even when a crash left it as
    ``step_N.prev``."""
    folders = step_folders(root) if root.is_dir() else []
    found = [(step, path) for step, path in folders if (path / "state.json").is_file()]
    latest = latest_checkpoint(root)
    if latest is not None and latest not in [path for _, path in found]:  # step_N.prev
        step = _STEP_DIR.match(latest.name)
        found = sorted([*found, (int(step.group(1)) if step else -1, latest)])
    return found
