"""What each role of a run does on Kafka: the topics it writes and reads, the consumer
groups it uses, whether it makes the run's topics. One table (:data:`ROLES`), in two uses:

- **The ACLs.** :func:`acl_rows` turns it into the Kafka ACL operations each role's
  principal needs on one run (``docs/reference/kafka-acls.md`` is generated from it, and
  ``streamrft acls`` prints ``kafka-acls.sh`` lines for a run).
- **Checked against the code.** A process declares its role once (:func:`set_role`, from
  its command) and every Kafka client of :mod:`streamrft.infra.kafka` asks
  :func:`check` before it writes a topic, reads one or names a group: by the topic's kind
  (a replay of another run, ``train --from-run``, reads that run's ``experiences``, which
  the ACLs must grant besides). Something outside the table is logged once as an error;
  with ``STREAMRFT_ACCESS_STRICT=1`` (every test process has it) it raises
  :class:`AccessError`, so the test suite, which runs every role as a real process, fails
  when the code and the table part. A process with no role (a library
  user's application, a test's in-process component) is not checked.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.topics import TopicNames

log = logging.getLogger(__name__)

STRICT_ENV = "STREAMRFT_ACCESS_STRICT"


class AccessError(StreamRFTError):
    """A client went beyond its role's row of :data:`ROLES` (a defect of the code or of the
    table, never of the user's input)."""


@dataclass(frozen=True)
class Access:
    """One role's use of a run's topics (by kind) and consumer groups (by suffix)."""

    doc: str
    """Who plays the role: the commands."""
    writes: tuple[str, ...] = ()
    """Topic kinds it produces to."""
    reads: tuple[str, ...] = ()
    """Topic kinds it reads (group-less or in its group), or whose offsets it asks."""
    groups: tuple[str, ...] = ()
    """Consumer groups (``<prefix>.<run>.<suffix>``) it joins or commits in."""
    group_offsets: tuple[str, ...] = ()
    """Consumer groups whose committed offsets it reads without joining, and may not commit
    in (``record``: the group the trainer vouches for the run's record in, which a process
    joining by run id reads, ``infra/run_record.py``)."""
    creates_topics: bool = False
    """It makes the run's topics when they are missing."""
    lists_topics: bool = False
    """It lists the broker's topics (to find runs, or to check one exists)."""
    every_run: bool = False
    """It reads the topics of every run under the prefix (``streamrft runs``, the
    dashboard), not of one: its reads are granted on the prefix."""


EVENTS_OUT = ("control", "status", "metrics", "dead_letters")

ROLES: dict[str, Access] = {
    "trainer": Access(
        "`streamrft train` (each rank of it), and the trainer `streamrft run` starts",
        writes=EVENTS_OUT,
        reads=("experiences", "control", "status", "tasks"),
        groups=("trainer", "record"),
        group_offsets=("explorers",),
        creates_topics=True,
        lists_topics=True,
    ),
    "explorer": Access(
        "`streamrft explore`",
        writes=("experiences", "samples", *EVENTS_OUT),
        reads=("tasks", "control", "status"),
        groups=("explorers",),
        group_offsets=("record",),
    ),
    "evaluator": Access(
        "`streamrft evaluate`", writes=EVENTS_OUT, reads=("control",), group_offsets=("record",)
    ),
    "serve": Access(
        "`streamrft serve`",
        writes=("experiences", *EVENTS_OUT),
        reads=("control",),
        group_offsets=("record",),
    ),
    "feeder": Access(
        "`streamrft feed`",
        writes=("tasks", "status"),
        reads=("tasks", "control", "status"),
        group_offsets=("record",),
    ),
    "supervisor": Access(
        "`streamrft run` itself (its children take their own roles)",
        writes=("control",),
        reads=("control", "status", "metrics", "dead_letters", "samples"),
        creates_topics=True,
        lists_topics=True,
    ),
    "operator": Access(
        "`streamrft stop`, `streamrft topics --create`, `streamrft score` (its metrics), "
        "`streamrft export --run-id`",
        writes=("control", "metrics"),
        reads=("control", "status"),
        group_offsets=("record",),  # score and export by run id read the run's record
        creates_topics=True,
        lists_topics=True,
    ),
    "watcher": Access(
        "`streamrft status`, `runs`, `tail`, `dashboard`, `export-metrics`, `topics`, "
        "`validate --connect`",
        reads=("tasks", "experiences", "control", "status", "metrics", "dead_letters", "samples"),
        lists_topics=True,
        every_run=True,
    ),
    "app": Access(
        "`streamrft publish` and applications using `streamrft.client`",
        writes=("tasks", "experiences"),
        reads=("control",),
        creates_topics=True,
        lists_topics=True,
    ),
}

_role: str | None = None
_reported: set[tuple[str, str, str]] = set()


def set_role(role: str | None) -> None:
    """This process's role (None: not checked); a name not in :data:`ROLES` is a defect."""
    global _role
    if role is not None and role not in ROLES:
        raise AccessError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    _role = role


def role() -> str | None:
    return _role


def check(action: str, name: str) -> None:
    """Before a client of this process's role writes (``write``) or reads (``read``) topic
    ``name``, names consumer group ``name`` (``group``), commits offsets in it without
    joining it (``commit``) or makes topics (``create``)."""
    if _role is None:
        return
    if _permitted(ROLES[_role], action, name):
        return
    key = (_role, action, name)
    message = (
        f"role {_role} may not {action} {name!r} by the access table (infra/access.py); "
        "the run's Kafka ACLs would refuse it"
    )
    if os.environ.get(STRICT_ENV) == "1":
        raise AccessError(message)
    if key not in _reported:
        _reported.add(key)
        log.error("%s", message)


def _permitted(access: Access, action: str, name: str) -> bool:
    if action == "create":
        return access.creates_topics
    if action == "list":
        return access.lists_topics
    if action in ("group", "commit"):
        suffix = name.rpartition(".")[2]
        return suffix in access.groups or (action == "group" and suffix in access.group_offsets)
    kind = TopicNames.kind_of(name)
    return kind in (access.writes if action == "write" else access.reads)


@dataclass(frozen=True)
class AclRow:
    """One Kafka ACL: ``operation`` on the resource ``kind`` named ``name`` (``pattern``
    ``literal`` or ``prefixed``) for the principal of ``role``."""

    role: str
    kind: str
    """``topic``, ``group`` or ``cluster``."""
    pattern: str
    name: str
    operation: str
    """Kafka's operation name: ``WRITE``, ``READ``, ``DESCRIBE``, ``CREATE``."""


def acl_rows(topics: TopicNames, roles: tuple[str, ...] = tuple(ROLES)) -> list[AclRow]:
    """The ACLs the principals of ``roles`` need on run ``topics`` (Apache Kafka's
    authorizer: a produce needs WRITE, a fetch READ, metadata and offsets DESCRIBE, a
    group member READ on its group, reading a group's offsets DESCRIBE on it; producers
    are not idempotent, so no IdempotentWrite)."""
    rows: list[AclRow] = []
    for name in roles:
        a = ROLES[name]
        ops: dict[str, set[str]] = {}
        for kind in a.writes:
            ops.setdefault(topics.of(kind), set()).update({"WRITE", "DESCRIBE"})
        for kind in () if a.every_run else a.reads:
            ops.setdefault(topics.of(kind), set()).update({"READ", "DESCRIBE"})
        rows += [
            AclRow(name, "topic", "literal", topic, op)
            for topic, topic_ops in sorted(ops.items())
            for op in sorted(topic_ops)
        ]
        for suffix in a.groups:
            rows += [
                AclRow(name, "group", "literal", topics.group(suffix), op)
                for op in ("DESCRIBE", "READ")
            ]
        rows += [
            AclRow(name, "group", "literal", topics.group(suffix), "DESCRIBE")
            for suffix in a.group_offsets
        ]
        if a.creates_topics:
            rows.append(
                AclRow(name, "topic", "prefixed", f"{topics.prefix}.{topics.run}.", "CREATE")
            )
        if a.every_run:
            rows.append(AclRow(name, "topic", "prefixed", f"{topics.prefix}.", "READ"))
        if a.lists_topics:  # a metadata request lists only the topics one may describe
            rows.append(AclRow(name, "topic", "prefixed", f"{topics.prefix}.", "DESCRIBE"))
    return rows
