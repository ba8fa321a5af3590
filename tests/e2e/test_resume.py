"""A trainer killed with SIGKILL resumes from its checkpoint: nothing lost, nothing twice."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas.codec import EXPERIENCE_GROUP
from tests.helpers.cli import run_argv, run_ok, start_piped
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import child_pid, kill_at_step, processes_mentioning

pytestmark = pytest.mark.e2e


def _trainer_pid(run_id: str) -> int | None:
    return child_pid(run_id, "train")


def test_trainer_killed_then_resumed_keeps_the_books(services, make_config, tmp_path):
    """Killed a few steps after its checkpoint: the resumed trainer numbers its versions
    past every version announced and goes on from the batches the explorer reached, so
    the batches sampled after the restart keep the batch rule (version = batch - 1)."""
    runs = tmp_path / "runs"
    run_id = f"resume-{os.getpid()}-{int(time.time())}"
    common = [
        "trainer.save_interval=15",
        "eval.interval=0",
        "trainer.warmup_sft_steps=20",
    ]
    first = start_piped(
        run_argv(
            EXAMPLE,
            run_id,
            1000,
            runs,
            services,
            *common,
            # no automatic restart here (the trainer_kill drill covers that): the run fails
            # and is resumed by hand, as after a lost machine
            "trainer.max_restarts=0",
            summary=tmp_path / "first.json",
        ),
        tmp_path,
    )
    ckpts = runs / run_id / "checkpoints"
    # the trainer logs step 20 five steps after its checkpoint at 15, the next is at 30
    log = runs / run_id / "logs" / "trainer.log"
    err = kill_at_step(first, log, 20, lambda: _trainer_pid(run_id), 120)
    assert first.returncode == 2 and "trainer exited with code -9" in err
    killed_at = json.loads((tmp_path / "first.json").read_text())["steps"]
    resumed_from = int((ckpts / "latest").read_text().split("_")[1])
    assert resumed_from == 15 and killed_at >= 20, (killed_at, resumed_from)

    total = resumed_from + 12
    run_ok(
        run_argv(EXAMPLE, run_id, total, runs, services, *common, summary=tmp_path / "second.json"),
        tmp_path,
    )
    s = json.loads((tmp_path / "second.json").read_text())
    log = (runs / run_id / "logs" / "trainer.log").read_text()
    assert f"resumed from {ckpts / f'step_{resumed_from:08d}'} at step {resumed_from}" in log
    assert s["steps"] == total
    # steps redone after the kill replace the lost attempt's ledger entries; every
    # effective step trained distinct groups, none newer than the trainer, none too stale
    books = s["books"]
    assert books["steps_in_ledger"] == total
    assert books["trained_twice"] == 0
    assert books["newer_than_trainer"] == 0 and books["staler_than_max"] == 0
    assert s["groups_trained"] == total * 32
    assert s["experiences_trained"] == total * 32 * 8  # counters restored from the checkpoint
    assert s["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    # versions keep rising across the crash: none was announced twice with other weights
    assert s["versions_rejected"] == {"explorer-0": 0}
    assert not processes_mentioning(run_id)
    # the batches sampled only after the restart (the explorer ran at most one batch
    # ahead of the killed trainer) were sampled with the version their batch needs
    cfg = make_config(run={"id": run_id})
    groups = asyncio.run(
        read_history(cfg.kafka, cfg.topics().experiences, EXPERIENCE_GROUP, "t-resume", 3)
    )
    after = [g for g in groups if g.batch >= killed_at + 2]
    assert after and all(g.model_version == g.batch - 1 for g in after), [
        (g.batch, g.model_version) for g in after if g.model_version != g.batch - 1
    ][:10]


def _explorer_pid(run_id: str, index: int) -> int | None:
    return child_pid(run_id, "explore", f"--index {index} ")


def test_explorer_killed_mid_run_is_restarted_and_nothing_is_lost(services, tmp_path):
    runs = tmp_path / "runs"
    run_id = f"explorer-kill-{os.getpid()}-{int(time.time())}"
    steps = 100  # long enough for the restarted explorer to rejoin and work
    proc = start_piped(
        run_argv(
            EXAMPLE,
            run_id,
            steps,
            runs,
            services,
            "explorer.count=2",
            "eval.interval=0",
            "trainer.warmup_sft_steps=20",
            "trainer.max_staleness=2",
            summary=tmp_path / "s.json",
        ),
        tmp_path,
    )
    log = runs / run_id / "logs" / "trainer.log"
    err = kill_at_step(proc, log, 10, lambda: _explorer_pid(run_id, 1), 400)
    assert proc.returncode == 0, err[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["restarts"] == {"explorer-1": 1}
    assert s["steps"] == steps
    assert s["books"]["trained_twice"] == 0 and s["books"]["staler_than_max"] == 0
    assert s["groups_trained"] == steps * 32
    # the restarted explorer came back: its new process synced weights (its counters start
    # from zero) and it stopped cleanly at the end
    assert "explorer-1 exited with code -9; restart 1 of 3" in err
    assert s["versions_applied"]["explorer-1"] >= 1
    assert s["explorers_stopped"] == ["explorer-0", "explorer-1"]
    assert not processes_mentioning(run_id)
