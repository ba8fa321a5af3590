"""An explorer started by hand joins a running ``streamrft run``, works, and leaves.

Its share of the tasks partitions moves to it when it joins and back to the run's own
explorer when it leaves; the run finishes with balanced books.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas.codec import EXPERIENCE_GROUP, STATUS
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


def _statuses(cfg) -> list:
    return asyncio.run(read_history(cfg.kafka, cfg.topics().status, STATUS, "test-status", 2))


def test_an_explorer_started_by_hand_joins_and_leaves_a_running_run(
    services, make_config, tmp_path
):
    runs = tmp_path / "runs"
    run_id = f"elastic-{os.getpid()}-{int(time.time())}"
    steps = 120
    # reads the run's topics on the session broker (only its kafka section is used)
    reader_cfg = make_config(run={"id": run_id})
    run = start_piped(
        run_argv(
            EXAMPLE,
            run_id,
            steps,
            runs,
            services,
            "eval.interval=0",
            "trainer.warmup_sft_steps=20",
            "trainer.max_staleness=2",
            "trainer.idle_timeout_s=900",  # held below while an explorer joins by hand
            explorers=1,
            summary=tmp_path / "s.json",
        ),
        tmp_path,
    )
    hand_log = tmp_path / "hand-explorer.log"
    hand = None
    try:
        explorer_log = runs / run_id / "logs" / "explorer-0.log"
        wait_for(
            lambda: log_has(explorer_log, "explorer-0: holds tasks partitions [0, 1, 2, 3]"),
            run,
            240,
            "explorer-0 to hold every tasks partition",
        )
        # names no broker or object store: it finds the run's from the run folder. The
        # trainer is held until it has its engine: on a busy machine that explorer's start
        # (imports, the model) can take longer than the whole run
        with frozen(child_pid(run_id, "train")):
            hand = start_logged(
                explore_argv(
                    EXAMPLE,
                    run_id,
                    runs,
                    None,
                    f"object_store.access_key={services.access_key}",
                    f"object_store.secret_key={services.secret_key}",
                ),
                hand_log,
                tmp_path,
            )
            wait_for(lambda: log_has(hand_log, ": engine "), hand, 300, "its engine")
        name = f"explorer-{hand.pid}-"

        def hand_worked() -> bool:
            """It holds partitions and finished a step: it applies a version at every step
            boundary (sync_interval 1), and the second comes after the first step's groups
            were published."""
            assert hand.poll() is None, hand_log.read_text()[-3000:]
            text = hand_log.read_text()
            return "holds tasks partitions" in text and text.count(": applied version ") >= 2

        wait_for(hand_worked, run, 180, "the hand-started explorer to take partitions and work")
        hand.send_signal(signal.SIGTERM)
        assert hand.wait(timeout=60) == 0, hand_log.read_text()[-3000:]
        all_four = "explorer-0: holds tasks partitions [0, 1, 2, 3]"
        wait_for(
            lambda: explorer_log.read_text().count(all_four) >= 2,
            run,
            60,
            "explorer-0 to get every tasks partition back",
        )
        _, err = run.communicate(timeout=400)
    except BaseException:
        kill_run(run_id)  # the run's children too: nothing of a failed test outlives it
        raise
    finally:
        for proc in (hand, run):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert run.returncode == 0, err[-3000:]
    assert "broker / object store of run" in hand_log.read_text()

    statuses = _statuses(reader_cfg)
    hand_id = next(s.component for s in statuses if s.component.startswith(name))
    held = [s.detail for s in statuses if s.component == hand_id and s.detail.startswith("tasks")]
    assert held and held[0] != "tasks partitions 0,1,2,3"  # it shared with explorer-0
    # explorer-0: all four, two of them moved to the newcomer, then all four again
    zero = [
        s.detail for s in statuses if s.component == "explorer-0" and s.detail.startswith("tasks")
    ]
    assert zero[-1] == "tasks partitions 0,1,2,3"
    assert any(d != zero[-1] for d in zero), zero

    async def groups_by_explorer() -> Counter:
        topic = reader_cfg.topics().experiences
        groups = await read_history(
            reader_cfg.kafka, topic, EXPERIENCE_GROUP, "test-experiences", 3
        )
        return Counter(g.explorer for g in groups)

    by_explorer = asyncio.run(groups_by_explorer())
    assert by_explorer[hand_id] > 0 and by_explorer["explorer-0"] > 0, by_explorer

    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == steps
    books = s["books"]
    assert books["trained_twice"] == 0
    assert books["newer_than_trainer"] == 0 and books["staler_than_max"] == 0
    assert s["groups_trained"] == steps * 32
    assert s["explorers_stopped"] == sorted(["explorer-0", hand_id])
    assert s["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    assert not processes_mentioning(run_id)
