"""Checkpoints in the store: a run trained on "host A" (its own run folder) leaves its
checkpoints in the object store; the same run started on "host B" (another run folder,
nothing copied) fetches the newest one, resumes at its step and trains on, nothing trained
twice."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_argv, run_ok
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e

FAST = (
    "eval.interval=0",
    "trainer.save_interval=2",
    "trainer.warmup_sft_steps=0",
    "trainer.batch_size=8",
    "explorer.batch_size=8",
)


def test_a_trainer_on_another_host_resumes_from_the_stores_checkpoint(services, tmp_path):
    run_id = f"moved-{tmp_path.name[-10:]}"
    host_a, host_b = tmp_path / "a" / "runs", tmp_path / "b" / "runs"
    run_ok(run_argv(EXAMPLE, run_id, 4, host_a, services, *FAST), tmp_path)
    trainer_a = (host_a / run_id / "logs" / "trainer.log").read_text()
    assert "checkpoint step_00000004 in the store" in trainer_a

    summary = tmp_path / "b.json"
    run_ok(run_argv(EXAMPLE, run_id, 6, host_b, services, *FAST, summary=summary), tmp_path)
    trainer_b = (host_b / run_id / "logs" / "trainer.log").read_text()
    assert "checkpoint step_00000004 fetched from the store" in trainer_b
    assert "resumed from" in trainer_b and "at step 4" in trainer_b
    assert "trainer: step 5 " in trainer_b or "step 6" in trainer_b
    s = json.loads(summary.read_text())
    assert s["steps"] == 6 and s["books"]["trained_twice"] == 0
    local = sorted(p.name for p in (host_b / run_id / "checkpoints").glob("step_*"))
    assert local[-1] == "step_00000006" and "step_00000004" in local
