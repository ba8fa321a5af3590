"""A run defined by its id and its broker: the record a joining process reads instead of a
file of the run's.

The trainer publishes a :class:`~streamrft.schemas.events.RunDefined` on the run's control
topic when it starts (the resolved config, secrets ``***``; a fingerprint of each task
file), and writes the same record to the object store (``<run>/run.yaml``; the app layer
does that part). A process started elsewhere with ``--run-id ID --bootstrap HOST:PORT`` and
no config (:func:`fetch_record`, :func:`config_of_record`) takes the newest record, its
credentials from its own environment, and its local ``-o`` overrides (device, engine,
threads, a task file's local path...). A feeder checks its task files against the
record's fingerprints (:func:`check_fingerprints`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml

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
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.errors import ConfigError, ServiceError
from streamrft.schemas.events import RunDefined
from streamrft.schemas.topics import TopicNames

RECORD_NAME = "run.yaml"
"""The record's name under the run's prefix in the object store."""
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


async def fetch_record(kafka: KafkaConfig, topics: TopicNames, wait_s: float = 0.0) -> RunDefined:
    """The newest record on the run's control topic, waiting up to ``wait_s`` for one to
    appear (a run whose trainer has not started yet); a :class:`ConfigError` saying what to
    do when there is none."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            events = await read_history(kafka, topics.control, CONTROL, "streamrft-run-record")
        except ServiceError:  # no control topic yet: no record yet
            if time.monotonic() >= deadline:
                raise
            events = []
        records = [ev for ev in events if isinstance(ev, RunDefined)]
        if records:
            return records[-1]  # the last published (the topic's order, not the clocks)
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"run {topics.run}: no record of it on the broker {kafka.bootstrap_servers} "
                f"(topic {topics.control}): its trainer publishes one when it starts; check "
                "the run id and the broker, or give the run's config file"
            )
        await asyncio.sleep(2.0)


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
