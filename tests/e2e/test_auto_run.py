"""The default sync method, ``auto``, end to end with a mixed fleet: the run's explorer on the
trainer's host reads every version from shared memory, an explorer that says it is on
another host (``run.host_id``) joins later and reads the store copies; the books balance
and nothing is left in /dev/shm."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import CONTROL, ModelVersionReady
from streamrft.sync.shared import SHM_DIR, file_prefix
from tests.helpers.cli import explore_argv, run_argv, start_logged, start_piped
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import (
    child_pid,
    frozen,
    kill_run,
    log_has,
    processes_mentioning,
    wait_for,
)

pytestmark = pytest.mark.e2e


def test_auto_serves_a_mixed_fleet(services, make_config, tmp_path):
    run_id = f"auto-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    steps = 80
    common = [
        "synchronizer.method=auto",
        "trainer.warmup_sft_steps=10",
        "eval.interval=0",
        "trainer.max_staleness=4",
        "explorer.count=1",
        "trainer.idle_timeout_s=900",  # held below for as long as the remote explorer needs
    ]
    run = start_piped(
        run_argv(EXAMPLE, run_id, steps, runs, services, *common, summary=tmp_path / "s.json"),
        tmp_path,
    )
    cfg = make_config(run={"id": run_id})
    remote = None
    try:
        log = runs / run_id / "logs" / "trainer.log"
        wait_for(lambda: log_has(log, "trainer: step 1 "), run, 240, "training to start")
        # the trainer is held until the remote explorer has its engine: on a busy machine
        # that explorer's start (imports, the model) can take longer than the whole run
        remote_log = tmp_path / "remote.log"
        with frozen(child_pid(run_id, "train")):
            remote = start_logged(
                explore_argv(
                    EXAMPLE, run_id, runs, services, *common, "run.host_id=elsewhere", index=1
                ),
                remote_log,
                tmp_path,
            )
            wait_for(lambda: log_has(remote_log, "explorer-1: engine"), remote, 300, "remote")
        _, err = run.communicate(timeout=500)
        assert run.returncode == 0, err[-3000:]
        remote.wait(timeout=120)
    except BaseException:
        kill_run(run_id)  # the run's children too: nothing of a failed test outlives it
        raise
    finally:
        for p in (run, remote):
            if p is not None and p.poll() is None:
                p.kill()

    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == steps
    books = s["books"]
    assert books == {**books, "trained_twice": 0, "newer_than_trainer": 0, "staler_than_max": 0}

    control = asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "auto-test"))
    events = [e for e in control if isinstance(e, ModelVersionReady)]
    shared = sorted(e.version for e in events if e.method == "shared")
    stored = sorted(e.version for e in events if e.method == "object_store")
    assert shared == list(range(steps + 1))  # every version, announced from shared memory
    assert (
        stored and set(stored) <= set(shared) and stored[-1] == steps
    )  # the last reached the store
    assert all(e.uri.startswith("shm://") for e in events if e.method == "shared")

    local = (runs / run_id / "logs" / "explorer-0.log").read_text()
    applied_local = re.findall(r"explorer-0: applied version \d+ \((\w+)\)", local)
    assert applied_local and set(applied_local) == {"shared"}, applied_local
    far = (tmp_path / "remote.log").read_text()
    applied_far = re.findall(r"explorer-1: applied version (\d+) \((\w+)\)", far)
    assert len(applied_far) >= 2, far[-2000:]
    assert {m for _, m in applied_far} == {"object_store"}  # never another host's memory
    assert s["versions_rejected"].get("explorer-1", 0) == 0

    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(file_prefix(run_id))]
    assert not processes_mentioning(run_id)
