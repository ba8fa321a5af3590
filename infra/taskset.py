"""Read a taskset into :class:`Task` objects, with errors that name the row.

``taskset.path`` (and ``eval.path``) is a JSONL file (one object per line), a Parquet
file (read in record batches, with ``pyarrow``), a folder a Hugging Face ``datasets``
``save_to_disk`` wrote (``taskset.split`` of a dataset dict), read with the hub off, or a
folder of Parquet or JSONL files as a hub's download lays it out, whose files of
``taskset.split`` are read in turn (:mod:`streamrft.infra.data_files`).
A row has a prompt (``taskset.prompt_key``, a dotted path into nested fields, or
``taskset.prompt_template`` filled with the row's fields by name) or a chat
(``taskset.messages_key``: a list of ``{"role", "content"}`` objects), not both; an
answer (``taskset.answer_key``, read through ``taskset.answer_extract`` when set), an id
and a workflow are optional; every other top-level field is kept as a metadata string.
A row whose answer the extractor cannot read is skipped and counted.

``taskset.sources`` lists several such files in place of ``path``, each read with the
section's rules where it sets none of its own (:func:`source_config`), its ids prefixed
with its name (:func:`training_tasks`). Rows are read one at a time (:func:`iter_tasks`):
the feeder never holds a whole taskset; :func:`read_taskset` and
:func:`read_training_set` make lists for the smaller uses (evaluation, SFT warm-up).
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from streamrft.infra.answer_extract import answer_extractor
from streamrft.infra.config import TasksetConfig, TaskSource
from streamrft.infra.data_files import is_saved_dataset, split_files
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ChatMessage, Task

log = logging.getLogger(__name__)

PARQUET_BATCH_ROWS = 1024
"""Rows read from a Parquet file at a time."""
DATA_EXTRA = "pip install -e '.[data]'"


def read_taskset(path: str | Path, cfg: TasksetConfig) -> list[Task]:
    """Every task of ``path`` (see the module docstring), ids checked to be distinct."""
    return read_training_set(msgspec.structs.replace(cfg, path=str(path), sources=[]))


def read_training_set(cfg: TasksetConfig) -> list[Task]:
    """Every training task: of ``taskset.path``, or of each of ``taskset.sources`` in turn
    (once each, ids prefixed), ids checked to be distinct."""
    tasks: list[Task] = []
    seen: set[str] = set()
    for _source, where, task in training_tasks(cfg):
        if task.id in seen:
            raise ConfigError(f"taskset {where}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    return tasks


def training_tasks(cfg: TasksetConfig) -> Iterator[tuple[int, str, Task]]:
    """``(source, where, task)`` of ``taskset.path`` (source 0), or of every source of
    ``taskset.sources`` in order, with ids ``<source name>/<id>``; a file without a task
    is a :class:`ConfigError`."""
    if not cfg.sources:
        for where, task in _non_empty(cfg.path, iter_tasks(cfg.path, cfg)):
            yield 0, where, task
        return
    for index, source in enumerate(cfg.sources):
        rows = iter_tasks(source.path, source_config(cfg, source))
        for where, task in _non_empty(source.path, rows):
            yield index, where, msgspec.structs.replace(task, id=f"{source.label}/{task.id}")


def _non_empty(path: str | Path, rows: Iterator[tuple[str, Task]]) -> Iterator[tuple[str, Task]]:
    empty = True
    for row in rows:
        empty = False
        yield row
    if empty:
        raise ConfigError(f"taskset {path}: no tasks")


def iter_tasks(path: str | Path, cfg: TasksetConfig) -> Iterator[tuple[str, Task]]:
    """``(where, task)`` of each row of ``path`` in order, one row in memory at a time (a
    Parquet file: one record batch). Rows whose answer ``taskset.answer_extract`` cannot
    read are skipped, and their count logged at the end; ids are not checked here."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"taskset: {str(path)!r} does not exist")
    extract = answer_extractor(cfg.answer_extract) if cfg.answer_extract else None
    unanswered = 0
    for where, index, row in read_rows(path, cfg):
        task = _task(row, cfg, where, f"line{index:06d}")
        if extract is not None:
            answer = extract(task.answer)
            if answer is None:
                unanswered += 1
                continue
            task = msgspec.structs.replace(task, answer=answer)
        yield where, task
    if unanswered:
        log.warning(
            "taskset %s: %d rows skipped: taskset.answer_extract %r found no answer in them",
            path,
            unanswered,
            cfg.answer_extract,
        )


def source_config(cfg: TasksetConfig, source: TaskSource) -> TasksetConfig:
    """How the rows of ``source`` are read: the ``taskset`` section with the fields the
    source sets itself."""
    names = [f.name for f in msgspec.structs.fields(TaskSource)]
    own = {
        name: getattr(source, name)
        for name in names
        if name not in ("path", "weight", "name") and getattr(source, name) is not None
    }
    return msgspec.structs.replace(cfg, path=source.path, sources=[], **own)


def read_rows(path: Path, cfg: TasksetConfig) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """``(where, 1-based index, row)`` of each row of a JSONL or Parquet file, a saved
    dataset folder, or the files of ``taskset.split`` in a folder as a hub's download lays
    it out (:mod:`streamrft.infra.data_files`; rows numbered across its files)."""
    if path.is_dir() and is_saved_dataset(path):
        yield from _dataset_rows(path, cfg.split)
    elif path.is_dir():
        index = 0
        for file in split_files(path, cfg.split):
            for where, _, row in _file_rows(file):
                index += 1
                yield where, index, row
    else:
        yield from _file_rows(path)


def _file_rows(path: Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
    return _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
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
            yield where, lineno, obj


def _parquet_rows(path: Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"taskset {path}: reading Parquet needs pyarrow: {DATA_EXTRA}") from None
    try:
        reader = pq.ParquetFile(path)
        index = 0
        for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                index += 1
                yield f"{path} row {index}", index, row
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"taskset {path}: not a readable Parquet file: {exc}") from exc


def _dataset_rows(path: Path, split: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never the network
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"taskset {path}: reading a datasets folder needs datasets: {DATA_EXTRA}"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                f"taskset.split: {split!r} is not a split of {path} "
                f"(it has {', '.join(sorted(loaded))})"
            )
        loaded = loaded[split]
    for index, row in enumerate(loaded, start=1):
        yield f"{path} row {index}", index, dict(row)


_ABSENT = object()


def field(row: dict[str, Any], dotted: str, default: Any = _ABSENT) -> Any:
    """The value at ``dotted`` (``a.b.c``: nested objects) in ``row``, else ``default``
    (KeyError without one). A key holding a dot itself is found as it is first."""
    if dotted in row:
        return row[dotted]
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            if default is _ABSENT:
                raise KeyError(dotted)
            return default
        value = value[part]
    return value


def _has(row: dict[str, Any], dotted: str) -> bool:
    try:
        field(row, dotted)
    except KeyError:
        return False
    return True


def _task(obj: dict[str, Any], cfg: TasksetConfig, where: str, default_id: str) -> Task:
    has_messages = _has(obj, cfg.messages_key)
    has_prompt = cfg.prompt_template is not None or _has(obj, cfg.prompt_key)
    if has_messages and cfg.prompt_key == cfg.messages_key and cfg.prompt_template is None:
        # one field named by both keys (verl's `prompt` column): a list is the chat
        has_messages = isinstance(field(obj, cfg.messages_key), list)
        has_prompt = not has_messages
    fields = (
        f"{cfg.prompt_key!r} (taskset.prompt_key) or {cfg.messages_key!r} (taskset.messages_key)"
    )
    if not (has_prompt or has_messages):
        raise ConfigError(f"taskset {where}: missing field {fields}")
    if has_prompt and has_messages:
        raise ConfigError(f"taskset {where}: has both fields {fields}; give one")
    known = (cfg.prompt_key, cfg.messages_key, cfg.answer_key, cfg.id_key, "workflow")
    return Task(
        id=str(field(obj, cfg.id_key, default_id)),
        prompt=_prompt(obj, cfg, where) if has_prompt else "",
        answer=str(field(obj, cfg.answer_key, "")),
        workflow=str(obj.get("workflow", cfg.workflow)),
        metadata={k: _text(v) for k, v in obj.items() if k not in known},
        messages=_messages(field(obj, cfg.messages_key), cfg, where) if has_messages else [],
    )


class _RowFields(string.Formatter):
    """``str.format`` over a row whose field names are dotted paths into nested fields
    (``{extra_info.question}``), as ``taskset.prompt_key`` reads them; ``[key]`` after a
    name indexes as Python's own format does (``{extra_info[question]}``, ``{choices[0]}``)."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        head, bracket, rest = field_name.partition("[")
        if not head or head.isdigit():
            raise ConfigError(
                "taskset.prompt_template: each {...} names a field of the row ({question}, "
                "{extra_info.question}); a brace of the text itself is doubled ({{ and }})"
            )
        try:
            value = field(kwargs, head)
        except KeyError:
            raise _Missing(head) from None
        for is_attr, key in _index_parts(bracket + rest, field_name):
            try:
                value = field(value, key) if is_attr else value[key]
            except (KeyError, IndexError, TypeError):
                raise _Missing(field_name) from None
        return value, head


_PART = re.compile(r"\[([^\]]+)\]|\.([^.\[]+)")


def _index_parts(tail: str, field_name: str) -> Iterator[tuple[bool, Any]]:
    """``(is_attr, key)`` of each ``[key]`` (a number as an int, as Python's format takes
    it) or ``.name`` of what follows a template field's name."""
    at = 0
    while at < len(tail):
        part = _PART.match(tail, at)
        if part is None:
            raise ConfigError(f"taskset.prompt_template: {{{field_name}}} is not a field name")
        key, name = part.groups()
        yield (False, int(key) if key.isdigit() else key) if name is None else (True, name)
        at = part.end()


class _Missing(Exception):
    """A template's field the row lacks (its name)."""


_ROW_FIELDS = _RowFields()


def _prompt(obj: dict[str, Any], cfg: TasksetConfig, where: str) -> str:
    """``taskset.prompt_template`` filled with the row's fields, or the prompt field."""
    if cfg.prompt_template is None:
        return str(field(obj, cfg.prompt_key))
    try:
        return _ROW_FIELDS.vformat(cfg.prompt_template, (), obj)
    except _Missing as exc:
        raise ConfigError(
            f"taskset {where}: taskset.prompt_template names {str(exc)!r} , which the row lacks "
            f"(it has {_fields_of(obj)})"
        ) from None
    except (IndexError, ValueError, AttributeError, KeyError) as exc:
        raise ConfigError(f"taskset.prompt_template: {exc}") from None


def _fields_of(row: dict[str, Any], prefix: str = "") -> str:
    """The row's field names, a nested object's as dotted paths."""
    names = []
    for key, value in row.items():
        name = f"{prefix}{key}"
        names.append(_fields_of(value, f"{name}.") if isinstance(value, dict) and value else name)
    return ", ".join(sorted(names))


def _text(value: Any) -> str:
    """A metadata value as a string: a nested object or list as JSON, anything else as
    ``str`` gives it."""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _messages(value: Any, cfg: TasksetConfig, where: str) -> list[ChatMessage]:
    """The chat of a row: a non-empty list of objects with string ``role`` and ``content``."""
    field_name = f"{cfg.messages_key!r} (taskset.messages_key)"
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"taskset {where}: {field_name} must be a non-empty list of "
            '{"role": ..., "content": ...} objects'
        )
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(f"taskset {where}: {field_name}[{i}] is not an object")
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or not role:
            raise ConfigError(f"taskset {where}: {field_name}[{i}] needs a non-empty string 'role'")
        if not isinstance(content, str):
            raise ConfigError(f"taskset {where}: {field_name}[{i}] needs a string 'content'")
        messages.append(ChatMessage(role=role, content=content))
    return messages
