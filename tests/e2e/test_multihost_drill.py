"""The multi-host drill (``tests/harness/multihost.py``): four simulated hosts sharing only
the broker and the object store; an explorer host lost, another joining late, the
trainer's host lost mid-run and the trainer started again on another host from the run's
record and the store's checkpoint. Nothing trained twice, nothing lost, and it learned."""

from __future__ import annotations

import pytest

from tests.harness.hosts import unavailable
from tests.harness.multihost import KILL_A_AT, STEPS, run_drill

pytestmark = pytest.mark.e2e
WHY_NOT = unavailable()


@pytest.mark.skipif(WHY_NOT is not None, reason=f"simulated hosts: {WHY_NOT}")
def test_a_run_outlives_its_trainers_host(tmp_path):
    result = run_drill(tmp_path)
    books = result["books"]
    assert books["tasks_fed"] == 100 * 4 and books["final_step"] == STEPS
    assert books["tasks_lost"] == 0 and books["duplicates_trained"] == 0
    assert books["tasks_trained"] == books["tasks_fed"]  # max_staleness 1000: none dropped
    assert books["dead_letters"] == 0
    assert result["exit_codes"] == {"trainer": 0, "explorer-0": 0, "explorer-2": 0}
    # host A was lost between two checkpoints; B resumed from the one in the store, before it
    assert KILL_A_AT <= result["lost_at_step"] < STEPS
    assert 0 < result["stored_checkpoint"] <= result["resumed_at_step"] < result["lost_at_step"]
    # the weights went by the broadcast over the bridge, from host A and then from host B
    # (listed in synchronizer.nccl_hosts), and by the store when a broadcast failed
    hosts = result["hosts"]
    received = result["explorer0_broadcasts_from"]
    assert received.get(hosts["a"], 0) > 0 and received.get(hosts["b"], 0) > 0, received
    applied = result["explorer_versions"]
    assert applied["explorer-0"].get("versions_refused", 0) == 0
    assert applied["explorer-2"].get("versions_applied", 0) > 0  # the late joiner worked
    # it learned: the last evaluation (on host B) above the first (on host A)
    assert result["eval_last"] > result["eval_first"]
