"""The feeder's progress is durable: a feeder killed mid-epoch goes on from its last
acknowledged chunk, and a resumed run whose statuses have expired never publishes its
taskset again (finding L7), on the real broker."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter

import pytest

from streamrft.infra import admin
from streamrft.infra.consume import read_topic
from streamrft.producers import feeder as feeder_module
from streamrft.producers.feeder import Feeder, progress_path
from streamrft.schemas.codec import TASK
from streamrft.schemas.errors import ConfigError

pytestmark = pytest.mark.integration

EPOCHS = 2


def _published(cfg) -> Counter:
    records = asyncio.run(read_topic(cfg.kafka, cfg.topics().tasks, TASK, "progress-test"))
    return Counter((r.obj.id, r.obj.epoch) for r in records)


def _feed(cfg) -> int:
    async def go():
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        return await Feeder(cfg).run()

    return asyncio.run(go())


class Killed(Exception):
    """The feeder's process dying between two chunks."""


def test_a_feeder_killed_mid_epoch_goes_on_from_its_last_chunk(make_config, monkeypatch):
    cfg = make_config(taskset={"total_epochs": EPOCHS}, kafka={"partitions": 3})
    monkeypatch.setattr(feeder_module, "FEED_CHUNK", 30)
    real_send, calls = feeder_module.send_all, []

    async def dies_at_the_sixth_chunk(*args, **kwargs):
        calls.append(len(args[1]))
        if len(calls) == 6:
            raise Killed
        return await real_send(*args, **kwargs)

    monkeypatch.setattr(feeder_module, "send_all", dies_at_the_sixth_chunk)
    with pytest.raises(Killed):
        _feed(cfg)
    # 100 tasks: chunks of 30, 30, 30, 10 (epoch 0), 30 of epoch 1, then the kill
    assert calls == [30, 30, 30, 10, 30, 30]
    assert json.loads(progress_path(cfg).read_text()) == {
        "epoch": 1,
        "sent": 30,
        "tasks": 100,
        "rows": [100],
    }
    monkeypatch.setattr(feeder_module, "send_all", real_send)
    assert _feed(cfg) == 70  # the rest of epoch 1, no more
    published = _published(cfg)
    assert len(published) == 100 * EPOCHS and set(published.values()) == {1}
    assert json.loads(progress_path(cfg).read_text()) == {
        "epoch": 2,
        "sent": 0,
        "tasks": 100,
        "rows": [100],
    }


def test_a_resumed_run_whose_statuses_expired_publishes_nothing_again(make_config, monkeypatch):
    cfg = make_config(taskset={"total_epochs": EPOCHS})
    assert _feed(cfg) == 100 * EPOCHS

    async def statuses_expired(_cfg) -> int:  # what the status topic says past retention
        return 0

    monkeypatch.setattr(feeder_module, "epochs_already_published", statuses_expired)
    assert _feed(cfg) == 0
    assert set(_published(cfg).values()) == {1}


def test_a_new_broker_gets_the_taskset_again_and_a_changed_taskset_is_refused(make_config):
    run = {"id": f"t-{uuid.uuid4().hex[:12]}"}
    cfg = make_config(run=run, taskset={"total_epochs": 1})
    assert _feed(cfg) == 100
    # same run folder, topics that never held a record (an embedded broker on memory
    # storage starts empty): the progress file cannot be right, the feeder starts over
    fresh = make_config(run=run, taskset={"total_epochs": 1}, kafka={"topic_prefix": "again"})
    assert progress_path(fresh) == progress_path(cfg)
    assert _feed(fresh) == 100
    progress_path(cfg).write_text(json.dumps({"epoch": 0, "sent": 40, "tasks": 77}))
    with pytest.raises(ConfigError, match="a taskset of 77 tasks"):
        _feed(cfg)
    progress_path(cfg).write_text("{not json")
    with pytest.raises(ConfigError, match="remove the file"):
        _feed(cfg)
