"""The run's record, published when its trainer starts (``infra/run_record.py`` says what
it holds and how a joining process reads it): topics made if missing, the record written to
the object store (``s3://<bucket>/<run>/run.yaml``) when the run has one, then announced on
the control topic and vouched for in the run's record group, again every day while the
trainer runs (:class:`VouchRenewal`)."""

from __future__ import annotations

import asyncio
import logging
import threading

import msgspec
import yaml

from streamrft.app.resume import resume_conflicts
from streamrft.infra import admin
from streamrft.infra.bus import EventSender
from streamrft.infra.config import Config, task_paths
from streamrft.infra.run_record import (
    RECORD_NAME,
    Vouch,
    commit_vouch,
    differing,
    fetch_record,
    make_record,
    record_text,
    vouch,
    vouched,
)
from streamrft.schemas.errors import ConfigError, ServiceError, StreamRFTError, SyncError
from streamrft.schemas.events import RunDefined

log = logging.getLogger(__name__)

VOUCH_RENEW_S = 24 * 3600.0
"""How often a running trainer commits its vouch again (Kafka forgets it
``offsets.retention.minutes`` after its commit: 7 days by default)."""


async def publish_record(cfg: Config, renew: bool = False) -> RunDefined:
    """Make the run's topics if no process has (idempotent); refuse a resume that changes
    a field the run must keep, whichever host defined it (``app/resume.py``, against the
    trainer's newest record on the broker); then write, announce and vouch for the record
    (with ``renew``, again every :data:`VOUCH_RENEW_S` while this process runs). A store
    that cannot take it is a warning: the control topic still carries it."""
    await admin.ensure_topics(cfg.kafka, cfg.topics(), cfg.explorer.count)
    previous = await newest_record(cfg)
    record = await asyncio.to_thread(make_record, cfg)  # reads the task files through, once
    check_against_record(cfg, previous, record.fingerprints)
    if cfg.object_store.endpoint:
        try:
            record.store_uri = await asyncio.to_thread(_store, cfg, record)
        except (SyncError, ServiceError) as exc:
            log.warning("the run's record was not written to the object store: %s", exc)
    async with EventSender(cfg, "trainer", "trainer") as sender:
        await sender.control(record)
    at = await vouch(cfg.kafka, cfg.topics(), record)
    if renew:
        VouchRenewal(cfg, at).start()
    log.info(
        "run %s defined on its control topic (offset %d, vouched for)%s: join with --run-id "
        "%s --bootstrap %s",
        cfg.run.id,
        at.offset,
        f" and at {record.store_uri}" if record.store_uri else "",
        cfg.run.id,
        cfg.kafka.bootstrap_servers,
    )
    return record


async def keep_vouched(cfg: Config, every_s: float = VOUCH_RENEW_S) -> VouchRenewal | None:
    """A trainer started from the run's record (no config: it publishes none) keeps that
    record vouched for while it runs, as :func:`publish_record` does its own: committed
    again now and every ``every_s`` (:class:`VouchRenewal`). None, with a warning, when
    no record is vouched for any more or the broker does not answer."""
    try:
        held = await vouched(cfg.kafka, cfg.topics())
        if not held:
            log.warning("run %s: no record of it is vouched for; not renewing", cfg.topics().run)
            return None
        partition, offset = min(held.items())  # the control topic has one partition
        renewal = VouchRenewal(cfg, Vouch(partition, offset), every_s)
        if not await renewal.renew_once():
            return None
    except StreamRFTError as exc:
        log.warning("the run's record was not vouched for again: %s", exc)
        return None
    renewal.start()
    return renewal


class VouchRenewal(threading.Thread):
    """Commits the trainer's vouch ``at`` again every ``every_s`` while the process runs (a
    daemon thread, with an event loop of its own), until the record group holds a newer
    record's offset (another trainer of the run took over). A broker away is tried again
    after a 24th of the period."""

    def __init__(self, cfg: Config, at: Vouch, every_s: float = VOUCH_RENEW_S) -> None:
        super().__init__(name="run record vouch", daemon=True)
        self.cfg, self.at, self.every_s = cfg, at, every_s
        self.stopped = threading.Event()

    def run(self) -> None:
        wait = self.every_s
        while not self.stopped.wait(wait):
            try:
                if not asyncio.run(self.renew_once()):
                    return
                wait = self.every_s
            except StreamRFTError as exc:
                log.warning("the run's record was not vouched for again: %s", exc)
                wait = self.every_s / 24

    async def renew_once(self) -> bool:
        """Commit the vouch again unless a newer one is held; whether it was."""
        topics = self.cfg.topics()
        held = (await vouched(self.cfg.kafka, topics)).get(self.at.partition, -1)
        if held > self.at.offset:
            log.info("a newer record of run %s is vouched for: not renewing ours", topics.run)
            return False
        await commit_vouch(self.cfg.kafka, topics, self.at)
        return True


async def newest_record(cfg: Config) -> RunDefined | None:
    """The run's newest record its trainer vouched for on its broker, None for a new run."""
    try:
        return await fetch_record(cfg.kafka, cfg.topics())
    except ConfigError:
        return None


def check_against_record(
    cfg: Config, previous: RunDefined | None, fingerprints: dict[str, str]
) -> None:
    """A :class:`ConfigError` naming each field of :data:`FIXED_ON_RESUME` that ``cfg``
    changes from the run's record. Where the files lie and which device a process uses
    are each host's own business: a task file is compared by its bytes (``fingerprints``:
    of the ones here, as :func:`~streamrft.infra.run_record.make_record` took them), the
    model by its shape when the checkpoint loads."""
    if previous is None:
        return
    before = yaml.safe_load(previous.config_yaml) or {}
    mine = msgspec.to_builtins(cfg)
    for tree in (before, mine):
        tree.get("model", {}).pop("path", None)
        tree.get("model", {}).pop("device", None)
        tree.get("taskset", {}).pop("path", None)
        for source in tree.get("taskset", {}).get("sources", []) or []:
            source.pop("path", None)
    paths = task_paths(cfg)
    differ = [
        f"{field}: {paths[field]}" for field in differing(fingerprints, previous.fingerprints)
    ]
    if differ:
        raise ConfigError(
            f"run {cfg.run.id} is defined on its broker with other task files than "
            + "; ".join(differ)
            + " (use the run's files, or start a new run id)"
        )
    conflicts = resume_conflicts(before, mine)
    if conflicts:
        raise ConfigError(
            f"run {cfg.run.id} is defined on its broker and cannot resume with a changed "
            + "; ".join(conflicts)
            + " (keep these fields, or start a new run id)"
        )


def _store(cfg: Config, record: RunDefined) -> str:
    from streamrft.sync.object_store import S3Store

    store = S3Store(cfg.object_store, create_bucket=True)
    key = f"{cfg.run.id}/{RECORD_NAME}"
    store.put(key, record_text(record).encode(), "text/yaml")
    return store.uri(key)
