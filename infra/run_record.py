"""A run defined by its id and its broker: the record a joining process reads instead of a
file of the run's.

The trainer publishes a :class:`~streamrft.schemas.events.RunDefined` on the run's control
topic when it starts (the resolved config, secrets ``***``; a fingerprint of each task
file), and writes the same record to the object store (``<run>/run.yaml``; the app layer
does that part). A process started elsewhere with ``--run-id ID --bootstrap HOST:PORT`` and
no config (:func:`fetch_record`, :func:`config_of_record`) takes the trainer's record, its
credentials from its own environment, and its local ``-o`` overrides (device, engine,
threads, a task file's local path...). A feeder checks its task files against the
record's fingerprints (:func:`check_fingerprints`).

**Whose record.** Explorers, serve processes, evaluators and operators may write the control
topic too, so a ``RunDefined`` there proves nothing of its writer. The trainer vouches for
its own (:func:`vouch`): it commits the record's control offset in the run's record group
(``<prefix>.<run>.record``, :data:`RECORD_GROUP`), which no process joins and only the
trainer's role may commit in (the access table grants the other roles DESCRIBE on it, never
READ: Kafka's ACLs then refuse their commits). A joiner takes the record at that offset and
nothing else, and logs where it came from; every other ``RunDefined`` is ignored, named in a
warning. Kafka forgets the offsets of a group no one joins ``offsets.retention.minutes``
after their commit (7 days by default), so a running trainer commits it again every day
(``app/run_record.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from streamrft.infra import access
from streamrft.infra.config import (
    Config,
    KafkaConfig,
    apply_overrides,
    config_from_data,
    default_fs_dir,
    fill_credentials,
    parse_override,
    task_paths,
    to_yaml,
)
from streamrft.infra.consume import Record, assign_from_beginning, read_to_end
from streamrft.infra.kafka import group_reader, start_client
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.errors import ConfigError, ServiceError
from streamrft.schemas.events import RunDefined
from streamrft.schemas.topics import TopicNames

log = logging.getLogger(__name__)

RECORD_NAME = "run.yaml"
"""The record's name under the run's prefix in the object store."""
RECORD_GROUP = "record"
"""Suffix of the consumer group the trainer vouches for its record in (see the module
docstring)."""
CLIENT = "streamrft-run-record"
READ_TIMEOUT_S = 120.0
"""How long reading the control topic to its end (where the run's record is) may take
before it is an error: generous, for a slow or loaded broker (the read ends at the end
offset the topic had when it began, never after a quiet spell)."""
CHUNK = 1 << 20


def fingerprint(path: str | Path) -> str:
    """``sha256:<hex>`` of a file's bytes, or of a folder's files (each one's path relative
    to the folder and its bytes, in name order)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def make_record(cfg: Config, store_uri: str = "") -> RunDefined:
    """The record of run ``cfg`` (its task files fingerprinted: read through once)."""
    return RunDefined(
        config_yaml=to_yaml(cfg),
        fingerprints={
            field: fingerprint(path)
            for field, path in task_paths(cfg).items()
            if Path(path).exists()
        },
        store_uri=store_uri,
        created_at=time.time(),
    )


def record_text(record: RunDefined) -> str:
    """The record as the store keeps it: the config, then its fingerprints as comments."""
    lines = [f"# {field}: {digest}" for field, digest in record.fingerprints.items()]
    head = "# streamrft run record: the resolved config (secrets ***) and its task files\n"
    return head + "".join(f"{line}\n" for line in lines) + record.config_yaml


def joining_kafka(bootstrap: str, overrides: list[str] | None = None) -> KafkaConfig:
    """The broker settings a joining process reads the record with: ``bootstrap``, the
    ``kafka.*`` of ``overrides`` (a topic prefix, TLS or SASL settings) and the credentials
    of the environment (``STREAMRFT_KAFKA_*``)."""
    data: dict[str, Any] = {}
    fill_credentials(data, ("kafka",))
    apply_overrides(data, [o for o in overrides or [] if parse_override(o)[0][0] == "kafka"])
    kafka = data.setdefault("kafka", {})
    kafka["bootstrap_servers"] = bootstrap
    try:
        return msgspec.convert(kafka, KafkaConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"kafka: {exc}") from exc


@dataclass(frozen=True)
class Vouch:
    """Where the trainer's record lies: the control topic's partition and offset."""

    partition: int
    offset: int


async def vouch(kafka: KafkaConfig, topics: TopicNames, record: RunDefined) -> Vouch:
    """Commit, in the run's record group, the control offset of ``record`` (just published
    by this process, the run's trainer; its newest copy there): joiners take that record
    and no other. :class:`~streamrft.infra.access.AccessError` for a role other than the
    trainer's (in strict mode), as the ACLs would refuse it."""
    access.check("commit", topics.group(RECORD_GROUP))
    records = await read_to_end(kafka, topics.control, CONTROL, CLIENT, READ_TIMEOUT_S)
    mine = [r for r in records if r.error is None and r.obj == record]
    if not mine:
        raise ServiceError(f"the run's record is not on {topics.control} after its publication")
    at = Vouch(mine[-1].partition, mine[-1].offset)
    await commit_vouch(kafka, topics, at)
    return at


async def commit_vouch(kafka: KafkaConfig, topics: TopicNames, at: Vouch) -> None:
    """Commit ``at`` in the run's record group (again: see the module docstring)."""
    access.check("commit", topics.group(RECORD_GROUP))
    reader = group_reader(kafka, topics.group(RECORD_GROUP), CLIENT)
    await start_client(reader, "run record")
    try:
        tp = TopicPartition(topics.control, at.partition)
        reader.assign([tp])
        await reader.commit({tp: at.offset})
    except KafkaError as exc:
        raise ServiceError(f"vouching for the run's record in {tp}: {exc}") from exc
    finally:
        await reader.stop()


async def vouched(kafka: KafkaConfig, topics: TopicNames) -> dict[int, int]:
    """The control partitions' offsets the run's record group holds (the trainer's record);
    empty when none. ServiceError when there is no control topic yet."""
    reader = group_reader(kafka, topics.group(RECORD_GROUP), CLIENT)
    await start_client(reader, "run record")
    try:
        await assign_from_beginning(reader, topics.control)
        offsets = {tp.partition: await reader.committed(tp) for tp in reader.assignment()}
    except KafkaError as exc:
        raise ServiceError(f"reading {topics.group(RECORD_GROUP)}: {exc}") from exc
    finally:
        await reader.stop()
    return {part: offset for part, offset in offsets.items() if offset is not None}


@dataclass(frozen=True)
class Found:
    """The run definitions on the control topic: the trainer's (None: none vouched for),
    and the others."""

    trainers: Record | None
    others: list[Record]


async def find_records(kafka: KafkaConfig, topics: TopicNames) -> Found:
    """The ``RunDefined`` records on the run's control topic, the trainer's apart (the one
    at the offset its record group holds). ServiceError when there is no control topic."""
    offsets = await vouched(kafka, topics)  # before the topic: the record is older
    records = await read_to_end(kafka, topics.control, CONTROL, CLIENT, READ_TIMEOUT_S)
    defined = [r for r in records if r.error is None and isinstance(r.obj, RunDefined)]
    trainers = [r for r in defined if offsets.get(r.partition) == r.offset]
    return Found(trainers[0] if trainers else None, [r for r in defined if r not in trainers])


async def fetch_record(kafka: KafkaConfig, topics: TopicNames, wait_s: float = 0.0) -> RunDefined:
    """The trainer's record on the run's control topic (see the module docstring), waiting
    up to ``wait_s`` for one to appear (a run whose trainer has not started yet); a
    :class:`ConfigError` saying what to do when there is none. Where it came from, and
    any other record ignored, is logged."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = await find_records(kafka, topics)
        except ServiceError:  # no control topic yet: no record yet
            if time.monotonic() >= deadline:
                raise
            found = Found(None, [])
        if found.trainers is not None:
            _log_origin(topics, found)
            return found.trainers.obj
        if time.monotonic() >= deadline:
            if found.others:
                _log_origin(topics, found)
                raise ConfigError(
                    f"run {topics.run}: {len(found.others)} run definition(s) on "
                    f"{topics.control}, none vouched for by the run's trainer (group "
                    f"{topics.group(RECORD_GROUP)}): not taken. A trainer vouches for its "
                    "record when it starts; give the run's config file, or restart its trainer"
                )
            raise ConfigError(
                f"run {topics.run}: no record of it on the broker {kafka.bootstrap_servers} "
                f"(topic {topics.control}): its trainer publishes one when it starts; check "
                "the run id and the broker, or give the run's config file"
            )
        await asyncio.sleep(2.0)


def _log_origin(topics: TopicNames, found: Found) -> None:
    if found.trainers is not None:
        log.info(
            "run %s: its definition is the trainer's record at %s offset %d (vouched for in "
            "group %s)",
            topics.run,
            topics.control,
            found.trainers.offset,
            topics.group(RECORD_GROUP),
        )
    if found.others:
        log.warning(
            "run %s: %d run definition(s) on %s ignored, not the trainer's: %s",
            topics.run,
            len(found.others),
            topics.control,
            ", ".join(
                f"offset {r.offset} sent as {(r.key or b'?').decode(errors='replace')!r}"
                for r in found.others[:10]
            ),
        )


HOST_FIELDS = (
    ("run", "host_id"),
    ("run", "dir"),
    ("monitor", "http_port"),
    ("monitor", "http_host"),
    ("monitor", "http_allowed_hosts"),
)
"""Fields of the record that belong to the recording process and its host: which host it
is (same-host shared memory), its run folder (a path there), where it serves its probes
(a joiner on the same host would find the port taken). A joining process finds its own
(``run.dir``: ``runs`` in its working folder, unless ``-o`` says; no probes unless ``-o
monitor.http_port=...``)."""


def config_of_record(
    record: RunDefined,
    overrides: list[str] | None = None,
    base: Path | None = None,
    check_files: bool = False,
) -> Config:
    """The run's config from its record: credentials from this process's environment
    (``STREAMRFT_S3_*``, ``STREAMRFT_KAFKA_*``), then ``overrides`` (relative paths taken
    from ``base``, the working folder by default). What names the recording process's own
    host (:data:`HOST_FIELDS`) is left out: this process finds its own."""
    try:
        data = yaml.safe_load(record.config_yaml)
    except yaml.YAMLError as exc:
        raise ConfigError(f"the run's record is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("the run's record: top level must be a mapping")
    sync, run = data.get("synchronizer"), data.get("run")
    # the filesystem method's shared folder, as the run has it (run.dir stays behind)
    if isinstance(sync, dict) and isinstance(run, dict) and run.get("dir"):
        sync["fs_dir"] = sync.get("fs_dir") or str(default_fs_dir(run["dir"]))
    for section, key in HOST_FIELDS:
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    return config_from_data(
        data,
        base or Path.cwd(),
        overrides,
        source="the run's record (its secrets are not in it)",
        check_files=check_files,
    )


def differing(mine: dict[str, str], recorded: dict[str, str]) -> list[str]:
    """The fields whose task files both fingerprint and whose fingerprints differ."""
    return [field for field, digest in mine.items() if recorded.get(field, digest) != digest]


def check_fingerprints(cfg: Config, record: RunDefined) -> None:
    """A :class:`ConfigError` naming the field when a task file ``cfg`` reads is missing
    here or differs from the one the run was defined with (a copy under another path is
    given with ``-o taskset.path=...``: it is compared by field, not by path)."""
    paths = task_paths(cfg)
    for field, path in paths.items():
        if not Path(path).exists():
            raise ConfigError(f"{field}: {path!r} does not exist here; give its local copy with -o")
    mine = {field: fingerprint(path) for field, path in paths.items()}
    changed = differing(mine, record.fingerprints)
    if changed:
        field = changed[0]
        raise ConfigError(
            f"{field}: {paths[field]!r} is not the run's task file: its sha256 differs from "
            "the one the run was defined with (another version of the data?)"
        )
