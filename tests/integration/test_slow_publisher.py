"""A publisher slower than the training steps, under each sync style: the object store
behind a slow uplink (~2.2 s per version of the default model, a few tenths of a second
per step), real processes. Nothing deadlocks, no batch is trained staler than allowed,
the books balance, versions are skipped only by a newer one replacing a queued one, and
the last version is always sent."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import CONTROL, EXPERIENCE_GROUP, ModelVersionReady
from streamrft.sync.styles import required_version
from tests.harness.throttle import throttled
from tests.helpers.cli import env, run_argv, style_settings
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.integration

STEPS = 12
UPLINK = 250_000
"""Bytes per second up to the object store: a version of the default model (~0.55 MB)
takes ~2.2 s to publish."""


def _run(services, make_config, tmp_path, style: str, interval: int, offset: int, stale: int):
    run_id = f"slow-{style.replace('_', '-')}-{tmp_path.name[-8:]}"
    with throttled(services.s3_endpoint, UPLINK) as relay:
        proc = subprocess.run(
            run_argv(
                EXAMPLE,
                run_id,
                STEPS,
                tmp_path / "runs",
                dataclasses.replace(services, s3_endpoint=relay.endpoint),
                "synchronizer.method=object_store",
                *style_settings(style, interval, offset, stale),
                summary=tmp_path / "s.json",
            ),
            env=env(),
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp_path,
        )
        uploaded = relay.sent
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == STEPS
    books = summary["books"]
    assert books == {**books, "trained_twice": 0, "newer_than_trainer": 0, "staler_than_max": 0}
    assert summary["versions_rejected"] == {"explorer-0": 0}

    cfg = make_config(run={"id": run_id})

    async def read():
        topics = cfg.topics()
        groups = await read_history(
            cfg.kafka, topics.experiences, EXPERIENCE_GROUP, "slow-test", until_quiet=5
        )
        control = await read_history(cfg.kafka, topics.control, CONTROL, "slow-test-control")
        return groups, control

    groups, control = asyncio.run(read())
    announced = [ev for ev in control if isinstance(ev, ModelVersionReady)]
    versions = sorted(ev.version for ev in announced)
    assert versions == sorted(set(versions)) and versions[0] == 0, versions  # each once
    # the uplink really was slower than the steps: every byte announced went through it
    assert uploaded >= sum(ev.bytes for ev in announced)
    used = {}
    for g in groups:
        used.setdefault(g.explorer_step, set()).add(g.model_version)
    assert all(len(v) == 1 for v in used.values()), used  # one version per explorer step
    return versions, [used[e].pop() for e in sorted(used)], summary


def test_fixed_with_an_offset_skips_replaced_versions_and_sends_the_last(
    services, make_config, tmp_path
):
    versions, used, _ = _run(services, make_config, tmp_path, "fixed", 1, 3, 3)
    # the trainer ran ahead of its publisher: queued versions were replaced by newer ones
    assert len(versions) < STEPS + 1, versions
    assert versions[-1] == STEPS  # the last one is drained at the end
    for e, v in enumerate(used):  # never older than the batch rule allows
        assert v >= required_version(e, 1, 3) and v in versions, (e, used)


def test_dynamic_by_trainer_keeps_within_the_staleness(services, make_config, tmp_path):
    versions, used, _ = _run(services, make_config, tmp_path, "dynamic_by_trainer", 1, 0, 3)
    assert len(versions) < STEPS + 1 and versions[-1] == STEPS, versions
    assert used == sorted(used) and set(used) <= set(versions), used
    assert all(v >= e - 3 for e, v in enumerate(used)), used  # the backpressure held


def test_dynamic_by_explorer_gets_what_it_asked_for(services, make_config, tmp_path):
    versions, used, _ = _run(services, make_config, tmp_path, "dynamic_by_explorer", 2, 0, 3)
    assert used == sorted(used) and set(used) <= set(versions), used
    assert all(v >= e - 3 for e, v in enumerate(used)), used
