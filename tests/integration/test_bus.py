"""The event bus on the real broker: the sender reports its owner's position, the control
view keeps a read-only picture of the run, and a reader that fails says so loudly."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrft.infra import admin
from streamrft.infra.bus import ControlView, Counters, EventSender, Position
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import STATUS
from streamrft.schemas.errors import ServiceError
from streamrft.schemas.events import ModelVersionReady, RunState, StatusEvent, SyncRequest
from tests.harness.fuzz import FuzzMessage, inject

pytestmark = pytest.mark.integration


def _version(v: int) -> ModelVersionReady:
    return ModelVersionReady(
        version=v,
        method="object_store",
        uri=f"s3://b/r/v{v:08d}/manifest.json",
        manifest_sha256="ab" * 32,
        bytes=1,
        step=v,
        created_at=time.time(),
    )


def test_sender_reports_the_owners_position_and_counters(make_config):
    cfg = make_config()
    topics = cfg.topics()
    where = {"step": 0}

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        counters = Counters()
        sender = EventSender(
            cfg, "explorer-7", "explorer", counters, lambda: Position(where["step"], 3)
        )
        async with sender:
            counters.add("groups_published", 4)
            where["step"] = 5
            await sender.status(RunState.WAITING_SYNC, "needs version >= 4")
            counters.add("groups_published")
            await sender.status()  # the state stays until changed
        return await read_history(cfg.kafka, topics.status, STATUS, "status-reader")

    first, second = asyncio.run(scenario())
    assert isinstance(first, StatusEvent)
    assert (first.step, first.version, first.state) == (5, 3, RunState.WAITING_SYNC)
    assert first.counters == {"groups_published": 4}
    assert second.state == RunState.WAITING_SYNC and second.counters == {"groups_published": 5}


def test_view_keeps_versions_requests_and_peers(make_config):
    cfg = make_config()
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        mine = EventSender(cfg, "trainer", "trainer")
        view = ControlView(cfg, "trainer", mine.dead_letter, listen_status=True)
        peer = EventSender(cfg, "explorer-0", "explorer", position=lambda: Position(2, 1))
        await mine.start()
        await view.start()
        await peer.start()
        try:
            await peer.control(_version(1))
            await peer.control(_version(2))
            for v in (1, 3):
                req = SyncRequest(explorer="explorer-0", min_version=v, created_at=time.time())
                await peer.control(req)
            await peer.status()
            stop = asyncio.Event()
            await view.wait_until(lambda: view.live_peers("explorer", 30), 30, stop, "peer")
            # one entry per explorer: its highest request
            await view.wait_until(lambda: view.requests_above(2), 30, stop, "reqs")
            assert [r.min_version for r in view.requests_above(-1)] == [3]
            with pytest.raises(TypeError):
                view.versions[9] = _version(9)  # read-only for callers
            return sorted(view.versions), view.requests_above(2), view.live_peers("explorer", 30)
        finally:
            await peer.stop()
            await view.stop()
            await mine.stop()

    versions, pending, peers = asyncio.run(scenario())
    assert versions == [1, 2]
    assert [r.min_version for r in pending] == [3]  # the request for >= 1 is answered by 2
    assert peers == ["explorer-0"]


def test_a_failed_control_reader_fails_the_waiter_with_its_cause(make_config):
    """A failure other than a bad record (here: the dead letter for a bad record cannot be
    sent) ends the reader; whoever waits on the view gets the cause at once, not a
    misleading "no usable model version" after the sync timeout."""
    cfg = make_config(synchronizer={"sync_timeout": 120.0})
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        never_started = EventSender(cfg, "explorer-0", "explorer")
        view = ControlView(cfg, "explorer-0", never_started.dead_letter)
        await view.start()
        try:
            await inject(cfg, topics.control, [FuzzMessage(b"\xc1 not msgpack")])
            t0 = time.monotonic()
            with pytest.raises(ServiceError, match="control-topic reader failed") as err:
                await view.wait_until(lambda: False, 120.0, asyncio.Event(), "a version")
            return time.monotonic() - t0, err.value
        finally:
            await view.stop()

    waited, error = asyncio.run(scenario())
    assert waited < 30, waited  # not the 120 s sync timeout
    assert "not started" in str(error.__cause__)  # the real cause travels with it
