"""A process joining by run id takes the run definition its trainer vouched for (the record's
control offset, committed in the run's record group, where only the trainer's role may
commit), never one another role published on the control topic, which every role of a run
but the feeder may write (``infra/run_record.py``, "Whose record").

The session's embedded broker has no ACLs: the roles are the access table's, checked in
strict mode in every test process, as the ACLs generated from it would check them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest
import yaml

from streamrft.app.run_record import VouchRenewal, publish_record
from streamrft.infra import access, admin
from streamrft.infra.access import AccessError
from streamrft.infra.bus import EventSender
from streamrft.infra.run_record import (
    RECORD_GROUP,
    Vouch,
    commit_vouch,
    fetch_record,
    make_record,
    vouch,
    vouched,
)
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.events import RunDefined
from tests.helpers.waits import until

pytestmark = pytest.mark.integration

EVIL = "http://203.0.113.7:9000"  # where a forged record sends the joiners' store requests


@pytest.fixture
def as_role():
    before = access.role()
    yield access.set_role
    access.set_role(before)


def _forged(record: RunDefined) -> RunDefined:
    """``record`` with the object store moved to :data:`EVIL`, published later."""
    data = yaml.safe_load(record.config_yaml)
    data["object_store"]["endpoint"] = EVIL
    return msgspec.structs.replace(
        record, config_yaml=yaml.safe_dump(data), created_at=time.time() + 1
    )


def test_a_run_definition_another_role_publishes_on_control_is_not_taken(
    make_config, as_role, caplog
):
    cfg = make_config()
    caplog.set_level(logging.INFO, "streamrft.infra.run_record")

    async def go() -> tuple[RunDefined, RunDefined, RunDefined]:
        as_role("trainer")
        published = await publish_record(cfg)
        as_role("explorer")  # WRITE on control, as the table and the ACLs give it
        forged = _forged(published)
        async with EventSender(cfg, "explorer-0", "explorer") as sender:
            await sender.control(forged)
        with pytest.raises(AccessError, match="may not commit"):  # the ACLs would refuse it
            await vouch(cfg.kafka, cfg.topics(), forged)
        return published, forged, await fetch_record(cfg.kafka, cfg.topics())

    published, forged, fetched = asyncio.run(go())
    assert fetched == published and fetched != forged
    assert yaml.safe_load(fetched.config_yaml)["object_store"]["endpoint"] != EVIL
    group = cfg.topics().group(RECORD_GROUP)
    assert f"the trainer's record at {cfg.topics().control} offset 0" in caplog.text
    assert f"vouched for in group {group}" in caplog.text
    assert (
        "1 run definition(s) on" in caplog.text and "offset 1 sent as 'explorer-0'" in caplog.text
    )


def test_a_control_topic_without_the_trainer_s_record_defines_no_run(make_config, as_role):
    cfg = make_config()

    async def go() -> None:
        await admin.ensure_topics(cfg.kafka, cfg.topics())  # as the supervisor does
        as_role("serve")
        async with EventSender(cfg, "serve-1", "serve") as sender:
            await sender.control(make_record(cfg))  # whole and plausible, from the wrong role
        as_role("explorer")
        await fetch_record(cfg.kafka, cfg.topics(), wait_s=0)

    with pytest.raises(ConfigError, match=r"1 run definition\(s\) .* none vouched for"):
        asyncio.run(go())


def test_the_vouch_is_renewed_until_a_newer_record_is_vouched_for(make_config, as_role):
    cfg = make_config()
    topics = cfg.topics()

    async def go() -> VouchRenewal:
        as_role("trainer")
        first = await publish_record(cfg)
        second = await publish_record(cfg)  # a resumed trainer: its record is the newer
        assert await vouched(cfg.kafka, topics) == {0: 1}
        assert await fetch_record(cfg.kafka, topics) == second != first
        renewal = VouchRenewal(cfg, Vouch(0, 1), every_s=0.2)
        await commit_vouch(cfg.kafka, topics, Vouch(0, 0))  # as if forgotten, or stale
        assert await renewal.renew_once()
        assert await vouched(cfg.kafka, topics) == {0: 1}  # committed again
        await commit_vouch(cfg.kafka, topics, Vouch(0, 5))  # a newer trainer's record
        assert not await renewal.renew_once()
        renewal.start()  # its loop ends by itself, leaving the newer one
        await until(lambda: not renewal.is_alive(), 60, "the renewal to stop")
        assert await vouched(cfg.kafka, topics) == {0: 5}
        return renewal

    asyncio.run(go())


@pytest.mark.parametrize("joiner", ["operator", "explorer", "serve", "evaluator", "feeder"])
def test_every_role_that_joins_by_run_id_reads_the_trainer_s_record(make_config, as_role, joiner):
    """``export`` and ``score`` with ``--run-id`` and ``--bootstrap`` (the operator's role)
    read the run's definition as the run's processes do: the record group's offset
    (DESCRIBE on it), never a commit in it."""
    cfg = make_config()

    async def go() -> tuple[RunDefined, RunDefined]:
        as_role("trainer")
        published = await publish_record(cfg)
        as_role(joiner)
        fetched = await fetch_record(cfg.kafka, cfg.topics())
        with pytest.raises(AccessError, match="may not commit"):
            await commit_vouch(cfg.kafka, cfg.topics(), Vouch(0, 0))
        return published, fetched

    published, fetched = asyncio.run(go())
    assert fetched == published


def test_a_trainer_started_from_the_record_keeps_it_vouched_for(make_config, as_role):
    """``streamrft train --run-id ID --bootstrap HOST`` (no config: a trainer moved to
    another host) publishes no record of its own: the one it took must stay vouched for
    while it runs, or Kafka forgets it a week after the first trainer's last renewal and
    no process can join the run any more."""
    from streamrft.app.run_record import keep_vouched

    cfg = make_config()
    topics = cfg.topics()

    async def go() -> VouchRenewal:
        as_role("trainer")
        await publish_record(cfg)
        taken = await publish_record(cfg)  # the first trainer's newest, at offset 1
        assert await fetch_record(cfg.kafka, topics) == taken  # what the new trainer starts from
        renewal = await keep_vouched(cfg, every_s=0.2)
        assert renewal is not None and renewal.at == Vouch(0, 1) and renewal.is_alive()
        await commit_vouch(cfg.kafka, topics, Vouch(0, 0))  # as if forgotten, or stale
        await until_vouched(cfg, {0: 1})  # committed again by the renewal
        renewal.stopped.set()
        return renewal

    renewal = asyncio.run(go())
    renewal.join(60)
    assert not renewal.is_alive()


async def until_vouched(cfg, offsets: dict[int, int], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (held := await vouched(cfg.kafka, cfg.topics())) != offsets:
        assert time.monotonic() < deadline, f"vouched: {held}, expected {offsets}"
        await asyncio.sleep(0.1)
