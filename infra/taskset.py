"""Read a JSONL taskset into :class:`Task` objects, with errors that name the line.

A line is an object with a prompt (``taskset.prompt_key``) or a chat
(``taskset.messages_key``: a list of ``{"role", "content"}`` objects), not both; an
answer, an id and a workflow are optional; every other field is kept as a metadata string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streamrft.infra.config import TasksetConfig
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ChatMessage, Task


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
            task = _task(obj, cfg, where, f"line{lineno:06d}")
            if task.id in seen:
                raise ConfigError(f"taskset {where}: duplicate task id {task.id!r}")
            seen.add(task.id)
            tasks.append(task)
    if not tasks:
        raise ConfigError(f"taskset {path}: no tasks")
    return tasks


def _task(obj: dict[str, Any], cfg: TasksetConfig, where: str, default_id: str) -> Task:
    has_prompt, has_messages = cfg.prompt_key in obj, cfg.messages_key in obj
    fields = (
        f"{cfg.prompt_key!r} (taskset.prompt_key) or {cfg.messages_key!r} (taskset.messages_key)"
    )
    if not (has_prompt or has_messages):
        raise ConfigError(f"taskset {where}: missing field {fields}")
    if has_prompt and has_messages:
        raise ConfigError(f"taskset {where}: has both fields {fields}; give one")
    known = (cfg.prompt_key, cfg.messages_key, cfg.answer_key, cfg.id_key, "workflow")
    return Task(
        id=str(obj.get(cfg.id_key, default_id)),
        prompt=str(obj[cfg.prompt_key]) if has_prompt else "",
        answer=str(obj.get(cfg.answer_key, "")),
        workflow=str(obj.get("workflow", cfg.workflow)),
        metadata={k: str(v) for k, v in obj.items() if k not in known},
        messages=_messages(obj[cfg.messages_key], cfg, where) if has_messages else [],
    )


def _messages(value: Any, cfg: TasksetConfig, where: str) -> list[ChatMessage]:
    """The chat of a line: a non-empty list of objects with string ``role`` and ``content``."""
    field = f"{cfg.messages_key!r} (taskset.messages_key)"
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"taskset {where}: {field} must be a non-empty list of "
            '{"role": ..., "content": ...} objects'
        )
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(f"taskset {where}: {field}[{i}] is not an object")
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or not role:
            raise ConfigError(f"taskset {where}: {field}[{i}] needs a non-empty string 'role'")
        if not isinstance(content, str):
            raise ConfigError(f"taskset {where}: {field}[{i}] needs a string 'content'")
        messages.append(ChatMessage(role=role, content=content))
    return messages
