""":class:`StreamRFTClient`: an application's connection to a run's topics.

It publishes tasks (``<prefix>.<run>.tasks``) and experience groups
(``<prefix>.<run>.experiences``) and follows the model versions the trainer announces on
``<prefix>.<run>.control``. Every Kafka option comes from :mod:`streamrft.infra.kafka`
(the producer of tasks and groups: acks=all; the group-less reader of control topics),
every send goes through the one produce path (:func:`streamrft.infra.produce.send_all`),
every read through the one consume path (:mod:`streamrft.infra.consume`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from streamrft.client.messages import group_records, task_records
from streamrft.infra import admin, kafka
from streamrft.infra.config import Config, load_config, with_endpoints, with_run_id
from streamrft.infra.consume import Record, assign_from_beginning, poll
from streamrft.infra.endpoints import INFRA_DIR, resolve
from streamrft.infra.produce import OutRecord, send_all
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.errors import ConfigError, ServiceError
from streamrft.schemas.events import ModelVersionReady
from streamrft.schemas.experience import ExperienceGroup, Task
from streamrft.schemas.topics import TopicNames

log = logging.getLogger(__name__)

POLL_MS = 200
"""How long one read of the control topic waits for records."""
QUIET_POLLS = 3
"""Reading the history of the control topic ends after this many empty reads in a row,
even short of the end offsets seen at the start (the embedded broker's end offset can be
wrong after a multi-record batch)."""


def client_config(
    run_id: str | None,
    bootstrap_servers: str | None = None,
    config: Config | str | Path | None = None,
    run_dir: str | Path | None = None,
) -> Config:
    """The config a client uses: ``config`` (a :class:`Config` or a YAML file; None: the
    defaults) for the topic prefix and the Kafka settings (TLS, SASL), ``run_dir`` in place
    of its ``run.dir``, the run ``run_id`` (or the config's ``run.id``), and the broker:
    ``bootstrap_servers``, else the config's, else found the way ``streamrft explore
    --run-id`` finds it (the run's embedded services or resolved config in
    ``<run.dir>/<run id>``, then ``streamrft infra up``'s in ``<run.dir>/infra``)."""
    if config is None:
        cfg = Config()
    else:
        cfg = config if isinstance(config, Config) else load_config(config)
    if run_dir is not None:
        cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, dir=str(run_dir)))
    if not (run_id or cfg.run.id):
        raise ConfigError("run_id: name the run to publish to (`streamrft run` prints its id)")
    cfg = with_run_id(cfg, run_id)
    if bootstrap_servers:
        return with_endpoints(cfg, bootstrap_servers, None)
    if not cfg.kafka.bootstrap_servers:
        cfg, source = resolve(cfg, joining=True)
        if not cfg.kafka.bootstrap_servers:
            raise ServiceError(
                f"run {cfg.run.id}: no broker found in {cfg.run_dir} or "
                f"{Path(cfg.run.dir) / INFRA_DIR}; pass bootstrap_servers, a config naming "
                "kafka.bootstrap_servers, or the run_dir of the running run"
            )
        log.info("broker of %s: %s", source, cfg.kafka.bootstrap_servers)
    return cfg


class StreamRFTClient:
    """An application's connection to the run ``run_id``: publish tasks and experience
    groups, follow model versions.

    Use it as ``async with StreamRFTClient(run_id, "host:9092") as client:`` (or call
    :meth:`start` and :meth:`stop`; stop is safe to call twice). Without
    ``bootstrap_servers`` the broker comes from ``config`` or from the run's folder (see
    :func:`client_config`; :meth:`from_run` says it shorter). ``client_id`` names the app
    to the broker.
    """

    def __init__(
        self,
        run_id: str | None,
        bootstrap_servers: str | None = None,
        config: Config | str | Path | None = None,
        *,
        run_dir: str | Path | None = None,
        client_id: str = "streamrft-client",
    ) -> None:
        self.cfg = client_config(run_id, bootstrap_servers, config, run_dir)
        """The resolved config (run id, broker, Kafka settings)."""
        self.topics: TopicNames = self.cfg.topics()
        """The run's topic names."""
        self.client_id = client_id
        self._producer: AIOKafkaProducer | None = None
        self._readers: set[AIOKafkaConsumer] = set()

    @classmethod
    def from_run(
        cls,
        run_id: str,
        run_dir: str | Path = "runs",
        config: Config | str | Path | None = None,
        client_id: str = "streamrft-client",
    ) -> StreamRFTClient:
        """The client of the running run ``run_id`` whose folder lies under ``run_dir``
        (``run.dir`` of the run's config): its broker is read from there, as
        ``streamrft explore --run-id`` reads it."""
        return cls(run_id, None, config, run_dir=run_dir, client_id=client_id)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect the producer (retrying while the broker is not reachable yet)."""
        producer = kafka.data_producer(self.cfg.kafka, self.client_id)
        await kafka.start_client(producer, f"{self.client_id} producer")
        self._producer = producer

    async def stop(self) -> None:
        """Flush and close the producer and every open version reader; safe twice."""
        for reader in list(self._readers):
            await self._close(reader)
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def __aenter__(self) -> StreamRFTClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def ensure_topics(self) -> list[str]:
        """Create the run's topics that do not exist yet, as ``streamrft run`` creates them
        (for an app that publishes before the run starts); returns the names created."""
        return await admin.ensure_topics(self.cfg.kafka, self.topics)

    # -- publishing --------------------------------------------------------------------------
    async def publish_tasks(self, tasks: Iterable[Task | Mapping[str, Any]]) -> int:
        """Publish ``tasks`` (:class:`Task` structs, or dicts of a task's fields) to the
        run's tasks topic, msgpack, key = task id, acks=all; returns how many were sent.

        Every task is validated first: a bad one raises
        :class:`~streamrft.schemas.errors.SchemaError` naming it (``tasks[2] ('t-7'): ...``)
        and nothing of this call is sent. A broker outage is ridden out for up to
        ``run.outage_timeout_s`` (then :class:`~streamrft.schemas.errors.ServiceError`);
        a retried call may deliver a task twice (at-least-once).
        """
        records = task_records(tasks, self.topics.tasks, self.cfg.kafka.max_request_bytes)
        return await self._send(records, "tasks")

    async def publish_groups(self, groups: Iterable[ExperienceGroup | Mapping[str, Any]]) -> int:
        """Publish experience ``groups`` (:class:`ExperienceGroup` structs, e.g. from
        :func:`~streamrft.client.make_group`, or dicts in the JSON form of the JSON Schema:
        number arrays for ``tokens``, ``logprobs``, ``action_mask``) to the run's
        experiences topic, msgpack, key = task id, acks=all; returns how many were sent.

        Validation and delivery as in :meth:`publish_tasks`; the trainer deduplicates by
        experience id, so a group sent twice is trained once.
        """
        records = group_records(groups, self.topics.experiences, self.cfg.kafka.max_request_bytes)
        return await self._send(records, "experience groups")

    async def _send(self, records: list[OutRecord], what: str) -> int:
        if self._producer is None:
            raise ServiceError(f"{self.client_id}: not started (use `async with` or start())")
        if not records:
            return 0
        return await send_all(
            self._producer,
            records,
            f"{self.client_id}: publishing {len(records)} {what}",
            self.cfg.run.outage_timeout_s,
        )

    # -- model versions ----------------------------------------------------------------------
    async def latest_version(self) -> ModelVersionReady | None:
        """The newest model version announced so far (None: none yet), read from the
        beginning of the control topic."""
        reader = await self._open_control()
        try:
            history = await self._history(reader)
        finally:
            await self._close(reader)
        return history[-1] if history else None

    async def versions(self, from_beginning: bool = False) -> AsyncIterator[ModelVersionReady]:
        """Every model version as the trainer announces it, for as long as the caller
        iterates: ``async for event in client.versions(): ...``.

        It starts with the newest version announced so far (if any), then yields each new
        announcement; with ``from_beginning``, every announcement since the run began.
        A version may be announced twice (a broadcast's object-store fallback): the later
        event replaces the earlier. Raises :class:`~streamrft.schemas.errors.ServiceError`
        when the run's control topic does not exist (the run has not started).
        """
        reader = await self._open_control()
        try:
            if not from_beginning:
                history = await self._history(reader)
                if history:
                    yield history[-1]
            while True:
                for event in _versions_in(await poll(reader, CONTROL, POLL_MS)):
                    yield event
        finally:
            await self._close(reader)

    async def _open_control(self) -> AIOKafkaConsumer:
        """A group-less reader of the control topic, at its first offset."""
        reader = kafka.topic_reader(self.cfg.kafka, f"{self.client_id}-versions")
        await kafka.start_client(reader, f"{self.client_id} control reader")
        self._readers.add(reader)
        try:
            await assign_from_beginning(reader, self.topics.control)
        except BaseException:
            await self._close(reader)
            raise
        return reader

    async def _close(self, reader: AIOKafkaConsumer) -> None:
        if reader in self._readers:
            self._readers.discard(reader)
            await reader.stop()

    @staticmethod
    async def _history(reader: AIOKafkaConsumer) -> list[ModelVersionReady]:
        """The versions announced so far, in order: read up to the end offsets seen now,
        or until :data:`QUIET_POLLS` reads in a row came back empty."""
        ends = await reader.end_offsets(list(reader.assignment()))
        seen: list[ModelVersionReady] = []
        quiet = 0
        while quiet < QUIET_POLLS and any(
            [await reader.position(tp) < end for tp, end in ends.items()]
        ):
            records = await poll(reader, CONTROL, POLL_MS)
            quiet = 0 if records else quiet + 1
            seen += _versions_in(records)
        return seen


def _versions_in(records: list[Record]) -> list[ModelVersionReady]:
    """The version announcements among ``records``; one that does not decode is logged and
    skipped (the run's own components dead-letter it)."""
    out = []
    for rec in records:
        if rec.error is not None:
            log.warning("skipping %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, rec.error)
        elif isinstance(rec.obj, ModelVersionReady):
            out.append(rec.obj)
    return out
