"""Read a JSONL taskset into :class:`Task` objects, with errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

from streamrft.infra.config import TasksetConfig
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task


def read_taskset(path: str | Path, cfg: TasksetConfig) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"taskset: file {str(path)!r} does not exist")
    tasks: list[Task] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"taskset {where}: not valid JSON: {exc}") from exc
            if not isinstance(obj, dict):
                raise ConfigError(f"taskset {where}: expected an object, got {type(obj).__name__}")
            if cfg.prompt_key not in obj:
                raise ConfigError(
                    f"taskset {where}: missing field {cfg.prompt_key!r} (taskset.prompt_key)"
                )
            task_id = str(obj.get(cfg.id_key, f"line{lineno:06d}"))
            if task_id in seen:
                raise ConfigError(f"taskset {where}: duplicate task id {task_id!r}")
            seen.add(task_id)
            extra = {
                k: str(v)
                for k, v in obj.items()
                if k not in (cfg.prompt_key, cfg.answer_key, cfg.id_key, "workflow")
            }
            tasks.append(
                Task(
                    id=task_id,
                    prompt=str(obj[cfg.prompt_key]),
                    answer=str(obj.get(cfg.answer_key, "")),
                    workflow=str(obj.get("workflow", cfg.workflow)),
                    metadata=extra,
                )
            )
    if not tasks:
        raise ConfigError(f"taskset {path}: no tasks")
    return tasks
