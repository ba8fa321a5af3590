"""A signalled trainer does not outlive its drain deadline waiting for a checkpoint upload:
the object store behind a slow uplink (a checkpoint takes many minutes to upload), the
trainer stopped with SIGTERM while one is on its way. It gives the upload up after
``STOP_DRAIN_S``, says so, and exits; the offsets committed are those of the last
checkpoint that did reach the store, never those of the one abandoned."""

from __future__ import annotations

import asyncio
import signal

import pytest
from aiokafka import TopicPartition

from streamrft.consumers.checkpoint_store import CheckpointStore
from streamrft.infra import admin, kafka
from streamrft.infra.config import load_config, with_run_id
from streamrft.schemas.codec import EXPERIENCE_GROUP
from tests.harness.fuzz import FuzzMessage, inject
from tests.harness.throttle import throttled
from tests.helpers.cli import overrides, start_logged, streamrft_cmd
from tests.helpers.groups import make_group
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import log_has, wait_for

pytestmark = pytest.mark.e2e

FAST = 1e9
SLOW = 2_000
"""Bytes per second up to the store once slowed: a checkpoint of the default model
(~1.6 MB: weights and AdamW moments) takes ~13 minutes."""
SETTINGS = (
    "synchronizer.method=filesystem",  # versions beside the run: the store holds checkpoints
    "trainer.checkpoint_store=object_store",
    "trainer.save_interval=1",
    "trainer.batch_size=2",
    "trainer.max_staleness=100",
    "trainer.warmup_sft_steps=0",
    "eval.in_trainer=false",
    "kafka.partitions=1",
)


def _config(services, run_id: str, runs, endpoint: str):
    cfg = load_config(
        EXAMPLE,
        [
            *SETTINGS,
            f"run.dir={runs}",
            f"kafka.bootstrap_servers={services.bootstrap_servers}",
            f"object_store.endpoint={endpoint}",
            f"object_store.access_key={services.access_key}",
            f"object_store.secret_key={services.secret_key}",
        ],
    )
    return with_run_id(cfg, run_id)


def _trainer(services, run_id: str, runs, endpoint: str, log, settings=SETTINGS):
    """``streamrft train`` of run ``run_id`` with ``settings``, the store at ``endpoint``."""
    argv = streamrft_cmd(
        "train",
        str(EXAMPLE),
        "--run-id",
        run_id,
        *overrides(
            *settings,
            f"run.dir={runs}",
            f"kafka.bootstrap_servers={services.bootstrap_servers}",
            f"object_store.endpoint={endpoint}",
            f"object_store.access_key={services.access_key}",
            f"object_store.secret_key={services.secret_key}",
        ),
    )
    return start_logged(argv, log, log.parent)


def _send(cfg, tasks: list[str]) -> None:
    groups = [make_group(cfg.run.id, t, 0, 4, rewards=[0, 1, 0, 1]) for t in tasks]
    msgs = [FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers()) for g in groups]
    asyncio.run(inject(cfg, cfg.topics().experiences, msgs))


def _first_step_stored(cfg, trainer, log) -> None:
    """Step 1 trained on groups a and b, and its checkpoint in the store."""
    _send(cfg, ["a", "b"])
    wait_for(
        lambda: log_has(log, "checkpoint step_00000001 in the store"),
        trainer,
        240,
        "the first checkpoint in the store",
    )


def _stopped(trainer, log) -> None:
    """SIGTERM to the trainer; it exits 0 (a drain past its deadline would keep it)."""
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=180) == 0, log.read_text()[-3000:]


async def _committed(cfg) -> int | None:
    topics = cfg.topics()
    reader = kafka.experience_consumer(
        cfg.kafka, topics.experiences, topics.group("trainer"), "t-look"
    )
    await kafka.start_client(reader, "look")
    try:
        return await reader.committed(TopicPartition(topics.experiences, 0))
    finally:
        await reader.stop()


def test_a_signalled_trainer_gives_up_a_slow_upload_at_its_deadline(services, tmp_path):
    run_id = f"stop-upload-{tmp_path.name[-8:]}"
    runs = tmp_path / "runs"
    cfg = _config(services, run_id, runs, services.s3_endpoint)
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    log = tmp_path / "trainer.log"
    with throttled(services.s3_endpoint, FAST) as relay:
        trainer = _trainer(services, run_id, runs, relay.endpoint, log)
        try:
            _first_step_stored(cfg, trainer, log)  # at full speed
            relay.rate = SLOW
            _send(cfg, ["c", "d"])  # step 2: its checkpoint creeps up the slow uplink
            wait_for(lambda: log_has(log, "step_00000002\n"), trainer, 240, "the second checkpoint")
            # the deadline is 10 s; the upload would take ~13 minutes: an exit at all is
            # the point (a process waiting for its upload thread would still be running)
            _stopped(trainer, log)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    text = log.read_text()
    assert "upload unfinished after 10 s; it is abandoned" in text, text[-3000:]
    # the offsets of step 1's checkpoint, the one in the store; none of step 2's
    assert asyncio.run(_committed(cfg)) == 2
    assert [step for step, _ in CheckpointStore(cfg).complete()] == [1]
    assert (runs / run_id / "checkpoints" / "step_00000002").is_dir()  # on this host's disk


AUTO_SETTINGS = tuple(s for s in SETTINGS if not s.startswith(("synchronizer.", "trainer.check")))
"""The same run with ``auto``'s store lane, checkpoints on this host's disk."""


def test_a_signalled_trainer_does_not_wait_for_autos_store_lane(services, tmp_path):
    """``synchronizer.method: auto`` copies each version to the store in the background; a
    signal leaves that copy behind (other hosts get the next run's versions): the trainer
    exits at once, not after an upload that takes minutes up a slow uplink."""
    run_id = f"stop-lane-{tmp_path.name[-8:]}"
    runs = tmp_path / "runs"
    cfg = _config(services, run_id, runs, services.s3_endpoint)
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    log = tmp_path / "trainer.log"
    with throttled(services.s3_endpoint, SLOW / 2) as relay:  # a version: minutes
        settings = (*AUTO_SETTINGS, "synchronizer.method=auto", "trainer.checkpoint_store=local")
        trainer = _trainer(services, run_id, runs, relay.endpoint, log, settings)
        try:
            _send(cfg, ["a", "b"])
            wait_for(lambda: log_has(log, "step_00000001\n"), trainer, 240, "step 1's checkpoint")
            # version 0's store copy alone needs ~8 minutes at this rate: a trainer that
            # waits for its upload thread is still running long after this timeout
            _stopped(trainer, log)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    assert asyncio.run(_committed(cfg)) == 2  # step 1's offsets: its checkpoint is on disk


def test_a_store_that_never_answers_holds_neither_the_steps_nor_a_signalled_trainer(
    services, tmp_path
):
    """The poison record's copy in the store is written off the training loop: with the
    store behind a relay that takes every request and answers none (after the first
    checkpoint), the trainer trains step after step (it waits once, briefly, for the
    record of a batch in flight, then not while the store does not keep up), each record
    on this host's disk, and a SIGTERM ends it within its drain deadline."""
    import json

    from streamrft.consumers.poison import RECORD
    from tests.harness.throttle import lagged

    run_id = f"stop-silent-{tmp_path.name[-8:]}"
    runs = tmp_path / "runs"
    cfg = _config(services, run_id, runs, services.s3_endpoint)
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    log = tmp_path / "trainer.log"
    with lagged(services.s3_endpoint) as relay:
        trainer = _trainer(services, run_id, runs, relay.endpoint, log)
        try:
            _first_step_stored(cfg, trainer, log)  # the store answers
            relay.delay_s = 24 * 3600.0  # from now on: taken, never answered
            _send(cfg, ["c", "d", "e", "f", "g", "h", "i", "j"])  # steps 2 to 5
            # a trainer that wrote the store's copy in its loop would spend minutes on
            # step 2's record alone (the store client's timeouts and retries)
            wait_for(lambda: log_has(log, "step_00000005\n"), trainer, 240, "step 5")
            _stopped(trainer, log)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    text = log.read_text()
    assert "the poison record is not written to" in text, text[-3000:]
    assert "upload unfinished after 10 s; it is abandoned" in text, text[-3000:]
    assert "stopping with the last poison record not in" in text, text[-3000:]
    local = json.loads((runs / run_id / "checkpoints" / RECORD).read_text())
    stored = json.loads(CheckpointStore(cfg).read_record(RECORD))
    assert local["batch"] == [] and local["seq"] > stored["seq"]  # every step's, on disk
    assert asyncio.run(_committed(cfg)) == 2  # step 1's checkpoint, the last one stored
