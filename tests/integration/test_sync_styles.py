"""Each sync style, end to end with real processes: the versions every explorer step used,
read back from the experiences, status and control topics, follow the style's rules."""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections import defaultdict

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import (
    CONTROL,
    EXPERIENCE_GROUP,
    STATUS,
    ModelVersionReady,
    RunState,
    SyncRequest,
)
from streamrft.sync.styles import required_version
from tests.helpers.cli import env, run_argv, style_settings
from tests.helpers.paths import EXAMPLE
from tests.helpers.topics import groups_and_trainer_metrics

pytestmark = pytest.mark.integration

STEPS = 10


def _run(services, tmp_path, style: str, interval: int, offset: int, staleness: int):
    run_id = f"style-{style.replace('_', '-')}-{tmp_path.name[-8:]}"
    proc = subprocess.run(
        run_argv(
            EXAMPLE,
            run_id,
            STEPS,
            tmp_path / "runs",
            services,
            *style_settings(style, interval, offset, staleness),
        ),
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_id


def _read(make_config, run_id):
    cfg = make_config(run={"id": run_id})
    topics = cfg.topics()

    async def read():
        groups = await read_history(
            cfg.kafka, topics.experiences, EXPERIENCE_GROUP, "style-test", until_quiet=5
        )
        control = await read_history(cfg.kafka, topics.control, CONTROL, "style-test-control")
        status = await read_history(cfg.kafka, topics.status, STATUS, "style-test-status")
        return groups, control, status

    groups, control, status = asyncio.run(read())
    per_step: dict[int, set[int]] = defaultdict(set)
    for g in groups:
        assert g.explorer == "explorer-0"
        per_step[g.explorer_step].add(g.model_version)
    assert all(len(v) == 1 for v in per_step.values()), per_step  # one version per step
    versions = [per_step[e].pop() for e in sorted(per_step)]
    assert sorted(per_step) == list(range(len(versions)))
    return versions, control, status


def test_fixed_interval_2_offset_1_uses_the_predicted_versions(services, make_config, tmp_path):
    run_id = _run(services, tmp_path, "fixed", interval=2, offset=1, staleness=2)
    versions, control, _ = _read(make_config, run_id)
    assert len(versions) >= STEPS
    # step e samples with the version required at its last sync point
    predicted = [required_version(e - e % 2, 2, 1) for e in range(len(versions))]
    assert versions == predicted, (versions, predicted)
    assert predicted[:8] == [0, 0, 0, 0, 2, 2, 4, 4]
    published = _published(control)
    assert published == list(range(0, STEPS + 1, 2))


def _published(control) -> list[int]:
    """The versions announced, each once: under the default ``auto`` method a version is
    announced from shared memory, and again when its store copy is written (the store lane
    may skip some); every version has its shared-memory announcement."""
    events = [ev for ev in control if isinstance(ev, ModelVersionReady)]
    shared = sorted(ev.version for ev in events if ev.method == "shared")
    assert shared == sorted({ev.version for ev in events}), events
    return shared


def test_dynamic_by_explorer_syncs_only_when_asked(services, make_config, tmp_path):
    run_id = _run(services, tmp_path, "dynamic_by_explorer", interval=3, offset=0, staleness=3)
    versions, control, status = _read(make_config, run_id)
    requests = [ev for ev in control if isinstance(ev, SyncRequest)]
    published = _published(control)

    # the explorer asks at steps 3, 6, 9, each time for a newer version, and in between
    # only when batch e would otherwise be sampled more than max_staleness (3) versions
    # below the one it is trained with (at most e): the backpressure
    def request_at(e: int) -> int | None:
        """The version step e asks for, given the version the step before it used."""
        floor = e - 3
        if e % 3 == 0:
            return max(versions[e - 1] + 1, floor)
        return floor if versions[e - 1] < floor else None

    # the step after the last one seen may have asked too (see below)
    asked = [r for e in range(1, len(versions) + 1) if (r := request_at(e)) is not None]
    for e in range(1, len(versions)):
        assert e - 3 <= versions[e] <= e, versions  # never further ahead than allowed
        wanted = request_at(e)
        if wanted is None:
            assert versions[e] == versions[e - 1], (e, versions)
        else:
            assert versions[e] >= wanted, (e, versions)
    assert versions[0] == 0
    # one request per step that asks; the step after the last one seen may have sent its
    # request as the run ended, before any of its groups reached the topic
    assert len(asked) - 1 <= len(requests) <= len(asked)
    assert [r.min_version for r in requests] == asked[: len(requests)]
    # the trainer published only when asked: version 0, one per request, and none unasked
    assert len(requests) <= len(published) <= 1 + len(requests)
    assert any(s.component == "explorer-0" and s.state == RunState.WAITING_SYNC for s in status)


def test_dynamic_by_trainer_explorer_waits_only_for_v0_or_when_too_far_ahead(
    services, make_config, tmp_path
):
    run_id = _run(services, tmp_path, "dynamic_by_trainer", interval=2, offset=0, staleness=4)
    versions, control, status = _read(make_config, run_id)
    published = _published(control)
    assert published == list(range(0, STEPS + 1, 2))
    assert versions == sorted(versions) and set(versions) <= set(published)
    # the trainer marked REQUIRE_SYNC for every version after the first, and only for
    # those (a heartbeat sent while the mark stands repeats it, so versions are compared)
    marks = sorted(
        {s.version for s in status if s.component == "trainer" and s.state == RunState.REQUIRE_SYNC}
    )
    assert marks == published[1:]
    # the explorer waits only for version 0, or when it is so far ahead of the trainer that
    # its batch would be dropped as stale (the backpressure): batch b is trained with
    # version b - b % 2, so it needs one >= b - b % 2 - 4
    waits = [
        s
        for s in status
        if s.component == "explorer-0" and s.state == RunState.WAITING_SYNC and s.detail
    ]  # heartbeats while waiting repeat the state without a detail
    assert waits
    for wait in waits:
        batch, need = map(
            int, re.fullmatch(r"batch (\d+) needs version >= (\d+)", wait.detail).groups()
        )
        assert need == max(0, batch - batch % 2 - 4), wait.detail
    assert all(v >= e - e % 2 - 4 for e, v in enumerate(versions)), versions


def test_fully_async_explorer_takes_the_newest_and_the_trainer_waits_for_no_batch(
    services, make_config, tmp_path
):
    run_id = _run(services, tmp_path, "fully_async", interval=1, offset=1, staleness=2)
    versions, control, status = _read(make_config, run_id)
    published = _published(control)
    # a version waiting to be sent is replaced by a newer one (the trainer does not wait
    # for the explorer's batches); the first and the last are always sent
    assert published == sorted(set(published)) and published[0] == 0 and published[-1] >= STEPS
    # each step on the newest version announced: never older than the step before, never
    # more than max_staleness (2) below the version its batch is trained with (its index)
    assert versions == sorted(versions) and set(versions) <= set(published)
    assert all(v >= e - 2 for e, v in enumerate(versions)), versions
    assert not [s for s in status if s.component == "trainer" and s.state == RunState.REQUIRE_SYNC]
    _, metrics = groups_and_trainer_metrics(make_config(run={"id": run_id}))
    trained = [row.group_id for m in metrics for row in m.trained]
    assert len(trained) == len(set(trained)) == STEPS * 8  # each group of each step once
    final = next(m.values for m in reversed(metrics) if "trainer/stale_dropped" in m.values)
    assert final["trainer/stale_dropped"] == 0
