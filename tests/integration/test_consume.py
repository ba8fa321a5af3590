"""The one consume path on the real broker: good records handed on in order, bad ones set
aside with their error, and each way of stopping (handler, quiet stream, stop event)."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrft.infra import admin, kafka
from streamrft.infra.consume import assign_from_beginning, consume, read_topic
from streamrft.schemas.codec import CONTROL
from streamrft.schemas.errors import SchemaError, ServiceError
from streamrft.schemas.events import Shutdown
from tests.harness.fuzz import FuzzMessage, inject

pytestmark = pytest.mark.integration


def _events(n: int) -> list[FuzzMessage]:
    """``n`` control events; every third one is garbage."""
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(FuzzMessage(b"\xc1 garbage %d" % i, key=b"bad"))
        else:
            ev = Shutdown(reason=f"event {i}", created_at=time.time())
            out.append(FuzzMessage(CONTROL.encode(ev), CONTROL.headers(), b"ok"))
    return out


async def _reader(cfg, topic: str):
    reader = kafka.topic_reader(cfg.kafka, "consume-test")
    await kafka.start_client(reader, "consume test")
    await assign_from_beginning(reader, topic)
    return reader


def test_read_topic_returns_every_record_in_order_with_errors(make_config):
    cfg = make_config()
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        await inject(cfg, topics.control, _events(9))
        return await read_topic(cfg.kafka, topics.control, CONTROL, "consume-test")

    records = asyncio.run(scenario())
    assert [r.offset for r in records] == list(range(9))
    bad = [r for r in records if r.error is not None]
    assert [r.offset for r in bad] == [2, 5, 8]
    assert all(isinstance(r.error, SchemaError) and r.obj is None for r in bad)
    assert bad[0].value == b"\xc1 garbage 2"  # kept whole, for a dead letter
    assert [r.obj.reason for r in records if r.error is None] == [
        f"event {i}" for i in range(9) if i % 3 != 2
    ]


def test_consume_stops_on_handler_on_quiet_and_on_stop(make_config):
    cfg = make_config()
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        await inject(cfg, topics.control, _events(9))
        # the handler stops it: the third good record is the last one handled
        seen, bad = [], []
        reader = await _reader(cfg, topics.control)
        try:
            n = await consume(
                reader,
                CONTROL,
                lambda r: (seen.append(r.offset), len(seen) < 3)[1],
                on_bad=bad.append,
            )
        finally:
            await reader.stop()
        stopped_by_handler = (n, seen, [r.offset for r in bad])
        # a quiet stream ends it; on_bad may be async
        bad_async = []

        async def set_aside(rec):
            bad_async.append(rec.offset)

        reader = await _reader(cfg, topics.control)
        try:
            n_all = await consume(reader, CONTROL, lambda r: None, on_bad=set_aside, until_quiet=3)
        finally:
            await reader.stop()
        # a stop event set beforehand: one poll, then it ends (no quiet wait)
        stop = asyncio.Event()
        stop.set()
        reader = await _reader(cfg, topics.control)
        try:
            t0 = time.monotonic()
            await consume(reader, CONTROL, lambda r: None, stop=stop, poll_ms=100)
            stopped_s = time.monotonic() - t0
        finally:
            await reader.stop()
        return stopped_by_handler, (n_all, bad_async), stopped_s

    by_handler, by_quiet, stopped_s = asyncio.run(scenario())
    assert by_handler == (3, [0, 1, 3], [2])
    assert by_quiet == (6, [2, 5, 8])
    assert stopped_s < 5


def test_assign_from_beginning_refuses_a_missing_topic(make_config):
    cfg = make_config()

    async def scenario():
        reader = kafka.topic_reader(cfg.kafka, "consume-test")
        await kafka.start_client(reader, "consume test")
        try:
            await assign_from_beginning(reader, f"{cfg.topics().prefix}.no-such-topic")
        finally:
            await reader.stop()

    with pytest.raises(ServiceError, match="does not exist"):
        asyncio.run(scenario())
