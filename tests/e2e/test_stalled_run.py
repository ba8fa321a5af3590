"""A trainer whose stream went idle tells a finished run from a stalled one: with every
task explored it exits 0; with tasks left that no explorer works on it exits
``EXIT_STALLED`` and says what is left (before: 0, "finishing", either way)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from aiokafka import AIOKafkaConsumer

from streamrft.app.process import EXIT_STALLED
from streamrft.infra import admin, kafka
from streamrft.infra.config import credentials_env, to_yaml
from streamrft.producers.feeder import Feeder
from tests.helpers.cli import env, streamrft_cmd

pytestmark = pytest.mark.e2e

SETTINGS = {
    "trainer": {
        "idle_timeout_s": 4.0,
        "warmup_sft_steps": 0,
        "save_interval": 0,
        "max_restarts": 0,
    },
    "taskset": {"total_epochs": 1},
    "eval": {"interval": 0},
}


def _feed(cfg) -> int:
    async def go():
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        return await Feeder(cfg).run()

    return asyncio.run(go())


def _explore_everything(cfg) -> None:
    """What explorers that did all the work leave: every task read and committed by the
    run's explorers group (no experience made: the trainer sees an idle stream)."""

    async def go():
        topics = cfg.topics()
        consumer = AIOKafkaConsumer(
            topics.tasks,
            bootstrap_servers=cfg.kafka.bootstrap_servers,
            group_id=topics.explorers_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await kafka.start_client(consumer, "test explorer")
        try:
            read, deadline = 0, time.monotonic() + 60
            while read < 100 and time.monotonic() < deadline:
                batches = await consumer.getmany(timeout_ms=500)
                read += sum(len(b) for b in batches.values())
            await consumer.commit()
        finally:
            await consumer.stop()
        assert read == 100

    asyncio.run(go())


def _train(cfg, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    secrets = {k: v for k, v in credentials_env(cfg).items() if v is not None}
    environ = {**env(), **secrets}
    return subprocess.run(
        streamrft_cmd("train", str(path)), env=environ, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip


def test_tasks_left_unexplored_end_the_run_as_stalled(make_config, tmp_path):
    cfg = make_config(**SETTINGS)
    assert _feed(cfg) == 100
    done = _train(cfg, tmp_path)
    assert done.returncode == EXIT_STALLED, done.stderr[-3000:]
    (tmp_path / "stderr.txt").write_text(done.stderr)
    assert "100 tasks on" in done.stderr and "were never explored" in done.stderr
    assert "0 explorer(s) heard from" in done.stderr


def test_a_run_whose_tasks_were_all_explored_ends_well(make_config, tmp_path):
    cfg = make_config(**SETTINGS)
    assert _feed(cfg) == 100
    _explore_everything(cfg)
    done = _train(cfg, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every task was explored" in done.stderr
