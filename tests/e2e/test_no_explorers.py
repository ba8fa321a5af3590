"""``streamrft run --explorers 0``: the run starts trainer and feeder only, says how to add
explorers, and an explorer started by hand (here another process; on another host it would
be the same command) does all the exploring."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import explore_argv, run_argv, start_logged, start_piped
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import log_has, wait_for

pytestmark = pytest.mark.e2e


def test_a_run_without_explorers_trains_on_a_hand_started_one(services, tmp_path):
    run_id = f"noexp-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    steps = 6
    settings = ["eval.interval=0"]
    summary = tmp_path / "s.json"
    run = start_piped(
        run_argv(EXAMPLE, run_id, steps, runs, services, *settings, explorers=0, summary=summary),
        tmp_path,
    )
    hand = None
    try:
        supervisor_log = runs / run_id / "logs" / "trainer.log"
        wait_for(lambda: supervisor_log.exists(), run, 240, "the trainer to start")
        assert not (runs / run_id / "logs" / "explorer-0.log").exists()
        hand = start_logged(
            explore_argv(EXAMPLE, run_id, runs, services, *settings, index=0),
            tmp_path / "hand.log",
            tmp_path,
        )
        wait_for(lambda: log_has(supervisor_log, "trainer: step 1 "), run, 240, "a first step")
        _, err = run.communicate(timeout=500)
        assert run.returncode == 0, err[-3000:]
        hand.wait(timeout=60)
    finally:
        for p in (run, hand):
            if p is not None and p.poll() is None:
                p.kill()
    assert "no explorer started (explorer.count 0)" in err
    assert "placement trainer on cpu" in err
    s = json.loads(summary.read_text())
    assert s["steps"] == steps and s["books"]["trained_twice"] == 0
    assert s["groups_trained"] == steps * 32  # the example's batch, all from the hand explorer
    assert not (runs / run_id / "logs" / "explorer-0.log").exists()
