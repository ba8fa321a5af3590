"""What an application hands the client, checked and made into Kafka records.

Every item of a call is converted and validated (the same rules the explorers' and the
trainer's decoders apply) before any record of that call is built, so a bad item fails
the whole call with a :class:`~streamrft.schemas.errors.SchemaError` that names it, and
nothing of that call is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import msgspec

from streamrft.infra.produce import OutRecord
from streamrft.schemas.codec import EXPERIENCE_GROUP, TASK, Codec
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import ExperienceGroup, Task, validate_group, validate_task
from streamrft.schemas.json_forms import ExperienceGroupJSON, group_from_json

T = TypeVar("T")


def task_of(item: Task | Mapping[str, Any]) -> Task:
    """A :class:`Task`, or a dict of its fields (its JSON form), as a validated Task."""
    task = item if isinstance(item, Task) else msgspec.convert(item, Task)
    return validate_task(task)


def group_of(item: ExperienceGroup | Mapping[str, Any]) -> ExperienceGroup:
    """An :class:`ExperienceGroup`, or a dict in its JSON form (token ids, log-probs and
    the action mask as number lists: :class:`~streamrft.schemas.json_forms.ExperienceGroupJSON`),
    as a validated ExperienceGroup."""
    if isinstance(item, ExperienceGroup):
        return validate_group(item)
    return validate_group(group_from_json(msgspec.convert(item, ExperienceGroupJSON)))


def _name(item: object, index: int, what: str) -> str:
    """``tasks[3] ('arith-7')``: where the item is in the call, and its id when it has one."""
    ident = item.get("id") if isinstance(item, Mapping) else getattr(item, "id", None)
    return f"{what}[{index}]" + (f" ({ident!r:.80})" if isinstance(ident, str) else "")


def _records(
    items: Iterable[Any],
    what: str,
    topic: str,
    codec: Codec[T],
    convert: Callable[[Any], T],
    key: Callable[[T], str],
    max_bytes: int,
) -> list[OutRecord]:
    """One msgpack record per item, each checked; SchemaError naming the first bad one."""
    records = []
    limit = min(codec.max_bytes, max_bytes)  # the codec's own limit is checked by decode
    for i, item in enumerate(items):
        try:
            obj = convert(item)
            value = codec.encode(obj)
            codec.decode(value)  # as its reader will: typed (a struct built by hand) and checked
        except (msgspec.ValidationError, SchemaError, TypeError, ValueError) as exc:
            raise SchemaError(f"{_name(item, i, what)}: {exc}") from exc
        if len(value) > limit:
            raise SchemaError(
                f"{_name(item, i, what)}: {len(value)} bytes encoded, over the limit of "
                f"{limit} bytes (kafka.max_request_bytes and the {codec.name} limit)"
            )
        records.append(OutRecord(topic, value, key(obj).encode(), codec.headers()))
    return records


def task_records(
    tasks: Iterable[Task | Mapping[str, Any]], topic: str, max_bytes: int
) -> list[OutRecord]:
    """The records of ``tasks`` for ``topic``: msgpack, key = task id."""
    return _records(tasks, "tasks", topic, TASK, task_of, lambda t: t.id, max_bytes)


def group_records(
    groups: Iterable[ExperienceGroup | Mapping[str, Any]], topic: str, max_bytes: int
) -> list[OutRecord]:
    """The records of ``groups`` for ``topic``: msgpack, key = task id."""
    return _records(
        groups, "groups", topic, EXPERIENCE_GROUP, group_of, lambda g: g.task_id, max_bytes
    )
