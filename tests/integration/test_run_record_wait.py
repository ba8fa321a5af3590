"""A process joining by run id before the run's trainer has started (no topics yet) waits
for the run's record instead of failing; with no record at all it says what to do."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.app.run_record import publish_record
from streamrft.infra.run_record import fetch_record
from streamrft.schemas.errors import ConfigError

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
