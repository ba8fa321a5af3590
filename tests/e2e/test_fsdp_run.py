"""``streamrft run`` with a 2-rank FSDP2 trainer (gloo): it trains, and when one rank is
killed the supervisor restarts the group from its checkpoint with nothing trained twice."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers.cli import run_argv, start_piped
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import kill_at_step, processes_mentioning

pytestmark = pytest.mark.e2e


def _rank_pid(run_id: str, rank: int) -> int | None:
    """The trainer rank ``rank`` of run ``run_id`` (the launcher has no RANK)."""
    for pid in processes_mentioning(run_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in cmd and f"RANK={rank}".encode() in environ:
            return pid
    return None


def test_two_rank_trainer_survives_a_killed_rank(services, tmp_path):
    runs = tmp_path / "runs"
    run_id = f"fsdp-{os.getpid()}-{int(time.time())}"
    steps, batch = 60, 16
    proc = start_piped(
        run_argv(
            EXAMPLE,
            run_id,
            steps,
            runs,
            services,
            "trainer.nproc=2",
            f"trainer.batch_size={batch}",
            f"explorer.batch_size={batch}",
            "trainer.save_interval=8",
            "eval.interval=0",
            "trainer.warmup_sft_steps=60",
            "trainer.lr=5e-4",  # the example's rate before its 150-step recipe: learns in 60
            summary=tmp_path / "s.json",
        ),
        tmp_path,
    )
    # step 10 is logged two steps past the checkpoint at 8; the next is at 16
    log = runs / run_id / "logs" / "trainer.log"
    err = kill_at_step(proc, log, 10, lambda: _rank_pid(run_id, 1), 300)
    text = log.read_text()
    assert proc.returncode == 0, (err[-3000:], text[-3000:])
    s = json.loads((tmp_path / "s.json").read_text())
    # the launcher saw rank 1 die, stopped rank 0 and failed; the supervisor restarted the
    # group, which resumed from the checkpoint at step 8 and finished the run
    assert "trainer rank 1 exited with code -9" in text
    assert s["restarts"] == {"trainer": 1}
    ckpt = runs / run_id / "checkpoints" / "step_00000008"
    assert f"resumed from {ckpt} at step 8" in text
    assert s["steps"] == steps
    # the books: the steps redone after the kill replace the lost attempt's entries
    books = s["books"]
    assert books["steps_in_ledger"] == steps
    assert books["trained_twice"] == 0
    assert books["newer_than_trainer"] == 0 and books["staler_than_max"] == 0
    assert s["groups_trained"] == steps * batch
    assert s["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    # it learned (seen: greedy accuracy 0.36 -> 0.67, sampled reward 0.24 -> 0.36), from
    # versions the explorer applied
    assert s["eval_accuracy_last"] >= s["eval_accuracy_first"] + 0.15, s["eval_accuracy"]
    assert s["mean_reward_last"] > s["mean_reward_first"]
    assert s["versions_applied"]["explorer-0"] >= steps // 2
    assert not processes_mentioning(run_id)
