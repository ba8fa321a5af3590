"""Config dicts and config files for the config tests."""

from __future__ import annotations

from pathlib import Path

import yaml

TASKSET = {"taskset": {"path": "tasks.jsonl"}}
"""The one section a config needs: a taskset path (not read by ``from_dict``)."""


def cfg_of(**sections) -> dict:
    """A config dict of ``sections`` plus a taskset, for ``from_dict``."""
    return {**TASKSET, **sections}


def write_config(folder: Path, data: dict | str, taskset: bool = True) -> Path:
    """Write ``data`` (a dict, or YAML text) to ``folder/config.yaml`` and return its path;
    ``taskset``: also write a one-task ``folder/data/tasks.jsonl``."""
    folder.mkdir(parents=True, exist_ok=True)
    if taskset:
        (folder / "data").mkdir(exist_ok=True)
        (folder / "data" / "tasks.jsonl").write_text(
            '{"id": "t", "prompt": "1+1=", "answer": "2"}\n'
        )
    path = folder / "config.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path
