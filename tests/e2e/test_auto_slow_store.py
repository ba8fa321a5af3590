"""``auto`` with a store lane slower than ``synchronizer.keep_versions`` steps: the object
store behind a slow uplink (each store copy takes many training steps), ``keep_versions: 1``.
An explorer on another host (``run.host_id``) that joins while the run trains still finds a
store copy to load, no store copy is announced after its retirement, and the bucket holds no
object of a retired version at the end."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from streamrft.infra.config import load_config, with_run_id
from streamrft.infra.consume import read_history
from streamrft.schemas import CONTROL, ModelVersionReady, VersionsRetired
from streamrft.sync.object_store import make_client
from tests.harness.throttle import throttled
from tests.helpers.cli import run_argv, start_piped
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import log_has, wait_for

pytestmark = pytest.mark.e2e

STEPS = 60
UPLINK = 60_000
"""Bytes per second up to the object store: a version of the default model (~0.55 MB)
takes ~9 s to copy, many steps of batches of 8 groups."""
SETTINGS = (
    "synchronizer.method=auto",
    "synchronizer.keep_versions=1",
    "trainer.warmup_sft_steps=0",
    "eval.interval=0",
    "trainer.save_interval=0",
    "explorer.batch_size=8",
    "trainer.batch_size=8",
)


def _remote_config(services, run_id: str, runs):
    """The run's config, as an explorer on another host sees it (the store unthrottled)."""
    cfg = load_config(
        EXAMPLE,
        [
            *SETTINGS,
            f"run.dir={runs}",
            "run.host_id=elsewhere",
            f"kafka.bootstrap_servers={services.bootstrap_servers}",
            f"object_store.endpoint={services.s3_endpoint}",
            f"object_store.access_key={services.access_key}",
            f"object_store.secret_key={services.secret_key}",
        ],
    )
    return with_run_id(cfg, run_id)


async def _join_and_load(cfg) -> tuple[int, dict]:
    """A late explorer on another host: read the run's history, load the newest version it
    can (a store copy); the version and the explorer's counters."""
    from streamrft.producers.explorer import Explorer

    explorer = Explorer(cfg, 1)
    await explorer.events.start()
    await explorer.view.start()
    try:
        follower = explorer.follower
        loadable = await explorer.view.wait_until(
            lambda: follower.newest() >= 0, 120, asyncio.Event(), "a version it can load"
        )
        assert loadable, "the run ended before a version could be loaded from the store"
        assert await follower.apply_newest()
        return follower.version, explorer.counters.snapshot()
    finally:
        explorer.follower.close()
        await explorer.view.stop()
        await explorer.events.stop()


def test_a_slow_store_lane_keeps_its_copies_for_explorers_elsewhere(services, tmp_path):
    run_id = f"slow-lane-{tmp_path.name[-8:]}"
    runs = tmp_path / "runs"
    with throttled(services.s3_endpoint, UPLINK) as relay:
        slow = dataclasses.replace(services, s3_endpoint=relay.endpoint)
        run = start_piped(
            run_argv(EXAMPLE, run_id, STEPS, runs, slow, *SETTINGS, summary=tmp_path / "s.json"),
            tmp_path,
        )
        try:
            log = runs / run_id / "logs" / "trainer.log"
            # by step 10 the lane is a few copies behind shared memory's newest
            wait_for(lambda: log_has(log, "trainer: step 10 "), run, 300, "step 10")
            version, counters = asyncio.run(_join_and_load(_remote_config(services, run_id, runs)))
            _, err = run.communicate(timeout=500)
            assert run.returncode == 0, err[-3000:]
        finally:
            if run.poll() is None:
                run.kill()
        uploaded = relay.sent

    # the late explorer loaded a copy made while the run trained, from the store
    assert 0 <= version < STEPS, version
    assert counters.get("versions_applied_object_store") == 1, counters
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == STEPS
    books = s["books"]
    assert books == {**books, "trained_twice": 0, "newer_than_trainer": 0, "staler_than_max": 0}

    cfg = _remote_config(services, run_id, runs)
    control = asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "slow-lane"))
    retired: set[int] = set()
    copies = []
    for event in control:  # in the order the views read them
        if isinstance(event, VersionsRetired):
            retired.update(event.versions)
        elif isinstance(event, ModelVersionReady) and event.method == "object_store":
            assert event.version not in retired, f"store copy of {event.version} after retirement"
            copies.append(event.version)
    shared = [
        e.version for e in control if isinstance(e, ModelVersionReady) and e.method == "shared"
    ]
    assert shared == list(range(STEPS + 1))
    # the lane really was slower than keep_versions steps: it skipped most versions
    assert len(copies) >= 2 and copies[-1] == STEPS and len(copies) < STEPS // 2, copies
    assert retired and uploaded >= sum(
        e.bytes for e in control if isinstance(e, ModelVersionReady) and e.method == "object_store"
    )

    client = make_client(cfg.object_store)
    names = client.list_objects(cfg.object_store.bucket, prefix=f"{run_id}/", recursive=True)
    folders = {o.object_name.split("/")[1] for o in names if not o.is_dir}
    held = {int(f.removeprefix("v")) for f in folders if f.startswith("v")}
    assert STEPS in held, folders
    assert not held & retired, f"objects of retired versions left: {sorted(held & retired)}"
