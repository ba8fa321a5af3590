"""Fault drills on real processes: each fault is injected into a running job, the job
finishes, and the books read back from the topics balance (see tests.harness.drills)."""

from __future__ import annotations

import pytest

from tests.harness.drills import DRILLS, STEPS, TASKS, run_drill

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name", list(DRILLS))
def test_drill_recovers_and_the_books_balance(name, tmp_path):
    r = run_drill(name, tmp_path)
    detail = r.detail
    assert r.exit_code == 0, (r, (tmp_path / name / f"{name}.log").read_text()[-4000:])
    assert detail["final_step"] == DRILLS[name].steps
    assert r.tasks_fed == TASKS
    assert r.tasks_trained == TASKS - r.tasks_dropped
    assert r.tasks_lost == 0
    assert r.duplicates_trained == 0
    assert detail["foreign_trained"] == 0
    assert r.dead_letters_unaccounted == 0
    assert detail["dead_letters_missing"] == 0
    assert r.recovered, r
    if name == "explorer_kill":
        assert detail["restarts"]["explorer-0"] >= 1
    elif name == "trainer_kill":
        assert detail["restarts"]["trainer"] >= 1
    elif name == "corrupt_shard":
        assert sum(detail["versions_rejected"].values()) >= 1
    elif name == "poison_batch":  # 2 oversized groups at intake, 1 batch after 2 kills
        assert detail["restarts"]["trainer"] >= 2
        assert detail["set_aside"] == detail["killed_batch"] and len(detail["set_aside"]) == 20
        assert r.dead_letters == 2 + 20
    elif name == "hostile":  # 4 groups dead-lettered, 7 announcements refused or rejected
        assert r.dead_letters == 4
        for where, why in detail["expected_reasons"].items():
            assert why in detail["dead_letter_reasons"][where], (where, detail)
        for version, kind in detail["expected_kinds"].items():
            said = detail["rejected"][version]
            assert said is not None and said[0] == kind and said[1], (version, said)
    elif name == "fuzz":
        assert detail["injected"] >= 1000
        assert r.dead_letters == detail["injected"]  # each invalid message: one dead letter
    else:
        assert r.dead_letters == 0
    if name == "store_outage":  # a publish or a fetch was retried through the outage
        retries = detail["retries"]
        assert retries["publish_retries"] + retries["store_unavailable"] >= 1, retries
    elif name == "broker_restart":  # a new broker process, after a real outage, mid-run
        assert detail["service_was_down"] and detail["service_back"], detail
        assert detail["step_at_fault"] < STEPS
        assert r.recover_s is not None  # the trainer stepped after the broker was back
