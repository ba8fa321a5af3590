"""``auto``'s store lane with the real broker and a real store behind a slow uplink: the
version it is writing is pinned (retention keeps it), and one retired all the same while it
is written is dropped: what was written is deleted, it is not announced, and the lane goes
on with the newest."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from streamrft.infra.consume import read_history
from streamrft.schemas import CONTROL, ModelVersionReady
from streamrft.sync.auto import AutoSender
from streamrft.sync.object_store import make_client
from tests.harness.throttle import throttled
from tests.helpers.waits import until
from tests.integration.test_shared_sync import _trainer

pytestmark = pytest.mark.integration

UPLINK = 10_000
"""Bytes per second up to the store: a version of the test model takes seconds to copy."""


def test_a_version_retired_while_the_lane_writes_it_is_dropped_and_deleted(make_config):
    cfg = make_config(synchronizer={"method": "auto", "style": "dynamic_by_trainer"})
    with throttled(cfg.object_store.endpoint, UPLINK) as relay:
        slow = msgspec.structs.replace(
            cfg, object_store=msgspec.structs.replace(cfg.object_store, endpoint=relay.endpoint)
        )

        async def scenario() -> set[int]:
            async with _trainer(slow) as (model, publisher, counters):
                sender = publisher.sender
                assert isinstance(sender, AutoSender)
                first = await publisher.publish(0)
                assert first.method == "shared"
                # the lane is uploading version 0: a third of its bytes went up
                await until(
                    lambda: relay.sent > first.bytes // 3 and sender.pinned() == {0},
                    120,
                    "upload",
                    every=0.02,
                )
                await asyncio.to_thread(sender.retire, [0])  # as the trainer does, one step on
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                await publisher.publish(1)
                await publisher.drain()
                assert counters["store_copies_dropped"] == 1
                assert counters["store_copies"] == 1
                return sender.pinned()

        pinned = asyncio.run(scenario())
    assert pinned == {1}  # the newest store copy
    control = asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "lane-test"))
    copies = [e.version for e in control if isinstance(e, ModelVersionReady)]
    stored = [
        e.version for e in control if isinstance(e, ModelVersionReady) and e.method != "shared"
    ]
    assert sorted(copies) == [0, 1, 1] and stored == [1]
    client = make_client(cfg.object_store)
    names = client.list_objects(cfg.object_store.bucket, prefix=f"{cfg.run.id}/", recursive=True)
    assert {o.object_name.split("/")[1] for o in names if not o.is_dir} == {"v00000001"}
