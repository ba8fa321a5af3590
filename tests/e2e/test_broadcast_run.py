"""The nccl method (gloo on CPU) end to end: two explorers, and a third that joins late."""

from __future__ import annotations

import asyncio
import re

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import CONTROL, METRICS, ModelVersionReady
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


def test_broadcast_to_explorers_and_a_late_joiner(services, make_config, tmp_path):
    run_id = f"bcast-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    steps = 60
    common = [
        "synchronizer.method=nccl",
        "synchronizer.sync_offset=0",
        "trainer.max_staleness=0",
        "synchronizer.sync_timeout=60",
        "trainer.warmup_sft_steps=20",
        "eval.interval=0",
        "explorer.count=2",
        "trainer.idle_timeout_s=900",  # held below for as long as the late joiner needs
    ]
    run = start_piped(
        run_argv(EXAMPLE, run_id, steps, runs, services, *common, summary=tmp_path / "s.json"),
        tmp_path,
    )
    late = None
    try:
        log = runs / run_id / "logs" / "trainer.log"
        wait_for(lambda: log_has(log, "trainer: step 1 "), run, 240, "training to start")
        late_log = tmp_path / "late.log"
        # the trainer is held until the late joiner has its engine: on a busy machine that
        # explorer's start (imports, the model) can take longer than the whole run
        with frozen(child_pid(run_id, "train")):
            late = start_logged(
                explore_argv(EXAMPLE, run_id, runs, services, *common, index=2),
                late_log,
                tmp_path,
            )
            wait_for(lambda: log_has(late_log, "explorer-2: engine"), late, 300, "the joiner")
        _, err = run.communicate(timeout=500)
        assert run.returncode == 0, err[-3000:]
        assert late.wait(timeout=120) == 0, late_log.read_text()[-3000:]
    except BaseException:
        kill_run(run_id)  # the run's children too: nothing of a failed test outlives it
        raise
    finally:
        for p in (run, late):
            if p is not None and p.poll() is None:
                p.kill()
    import json

    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == steps and s["books"]["trained_twice"] == 0
    assert s["books"]["max_staleness_seen"] == 0

    cfg = make_config(run={"id": run_id})
    control = asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "bcast-test"))
    versions = [e for e in control if isinstance(e, ModelVersionReady)]
    broadcasts = [e for e in versions if e.method == "nccl"]
    assert len(broadcasts) >= steps - 2  # v0 (and a fallback at most) went through the store
    groups = [re.search(r"members=([^&]*)", e.uri).group(1) for e in broadcasts]
    # the first groups hold the explorers heard from by then (the first version may go to
    # one of the two alone), then both; the late joiner makes a third
    both = groups.index("explorer-0,explorer-1")  # ValueError: never a group of both
    assert all(g in ("explorer-0", "explorer-1") for g in groups[:both]), groups[:both]
    assert any("explorer-2" in g for g in groups)  # the late joiner got a new group epoch
    epochs = {e.uri for e in broadcasts}
    assert len(epochs) >= 2

    # every explorer's weights equal the trainer's: on-policy steps recompute the very
    # log-probs the explorers sampled with
    metrics = asyncio.run(read_history(cfg.kafka, cfg.topics().metrics, METRICS, "bcast-metrics"))
    diffs = [
        m.values["train/logprob_max_abs_diff"]
        for m in metrics
        if m.component == "trainer" and "train/logprob_max_abs_diff" in m.values
    ]
    assert len(diffs) == steps and max(diffs) < 1e-4, diffs
    # ... and so does the mismatch metric, over every trained token (all of the version held)
    mismatch = [m.values for m in metrics if m.component == "trainer" and "train/loss" in m.values]
    assert all(v["train/rollout_logprob_diff_tokens"] > 0 for v in mismatch)
    assert max(v["train/rollout_logprob_diff_max"] for v in mismatch) < 1e-4
    # the per-step staleness distribution: every trained group was 0 versions old
    for m in metrics:
        if m.component == "trainer" and "train/loss" in m.values:
            dist = {k: v for k, v in m.values.items() if k.startswith("train/staleness_groups_")}
            assert dist == {"train/staleness_groups_0": 32.0}, dist
    text = (tmp_path / "late.log").read_text()
    assert re.search(r"explorer-2: applied version \d+ \(nccl\)", text), text[-2000:]
    assert not processes_mentioning(run_id)
