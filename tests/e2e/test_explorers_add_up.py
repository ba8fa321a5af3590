"""N explorers share each training step's batch instead of each making its own.

Read back from the run's topics: every group was sampled with the version its batch
needs, the trainer trained batch after batch in order, nothing went stale with the
default ``max_staleness: 1``, and a batch whose tasks an explorer held when it died is
finished by the explorer that inherits its partitions.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict

import pytest

from streamrft.sync.styles import batch_version
from tests.helpers.cli import explore_argv, run_argv, run_ok, start_logged, start_piped
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import log_has, processes_mentioning, wait_for
from tests.helpers.topics import groups_and_trainer_metrics

pytestmark = pytest.mark.e2e


def _check_books(groups: list, metrics: list, steps: int, per_batch: int) -> dict[int, dict]:
    """The trainer trained batch s - 1 whole at step s, each group once; every group
    published is trained, a copy of one trained (a duplicate), or of a batch past the last
    step (the explorers run at most one batch ahead). Returns the groups by batch and id."""
    by_batch: dict[int, dict] = defaultdict(dict)
    for g in groups:
        assert g.batch >= 0, g.id  # the feeder stamped every task
        by_batch[g.batch].setdefault(g.id, g)
    ledger = {m.step: [row.group_id for row in m.trained] for m in metrics if m.trained}
    assert sorted(ledger) == list(range(1, steps + 1))
    for step, ids in ledger.items():
        assert len(ids) == len(set(ids)) == per_batch, step
        assert set(ids) == set(by_batch[step - 1]), f"step {step} did not train batch {step - 1}"
    assert max(by_batch) <= steps + 1, sorted(by_batch)  # never more than the bound ahead
    final = next(m.values for m in reversed(metrics) if "trainer/stale_dropped" in m.values)
    assert final["trainer/stale_dropped"] == 0
    assert final.get("trainer/batches_forced", 0) == 0
    return by_batch


def test_two_explorers_share_every_batch_and_nothing_goes_stale(services, make_config, tmp_path):
    steps, run_id = 24, f"addup-{os.getpid()}-{int(time.time())}"
    run_ok(
        run_argv(
            EXAMPLE,
            run_id,
            steps,
            tmp_path / "runs",
            services,
            "eval.interval=0",
            "trainer.warmup_sft_steps=10",
            explorers=2,
            summary=tmp_path / "s.json",
        ),
        tmp_path,
    )
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["stale_dropped"] == 0 and summary["groups_trained"] == steps * 32
    assert summary["books"]["trained_twice"] == 0 and summary["books"]["staler_than_max"] == 0

    groups, metrics = groups_and_trainer_metrics(make_config(run={"id": run_id}))
    by_batch = _check_books(groups, metrics, steps, 32)
    # fixed style, sync_offset 1: batch b is sampled with version b - 1, by whoever takes it
    for g in groups:
        assert g.model_version == batch_version(g.batch, 1, 1), (g.id, g.batch, g.model_version)
    # one explorer step samples one batch; both explorers took shares of most batches
    steps_batches: dict[tuple[str, int], set[int]] = defaultdict(set)
    for g in groups:
        steps_batches[(g.explorer, g.explorer_step)].add(g.batch)
    assert all(len(b) == 1 for b in steps_batches.values()), steps_batches
    shared = [b for b in range(steps) if len({g.explorer for g in by_batch[b].values()}) == 2]
    assert len(shared) >= steps // 2, shared
    # the books: published = trained + duplicates + what was ahead of the last step
    published = {g.id for g in groups}
    trained = {gid for b in range(steps) for gid in by_batch[b]}
    ahead = {gid for b in by_batch if b >= steps for gid in by_batch[b]}
    assert published == trained | ahead and not trained & ahead
    assert summary["duplicates_dropped"] <= len(groups) - len(published)


def test_a_batch_an_explorer_died_in_is_finished_by_the_one_that_inherits_it(
    services, make_config, tmp_path
):
    """An explorer started by hand joins the run, works, and is killed (SIGKILL) in the
    middle of sampling its share of a batch. After the session timeout its partitions
    move to explorer-0, which was waiting for the version that needs that batch: it takes
    the dead explorer's tasks again, samples them (with the newer version it holds), and
    the trainer trains the batch whole, in order, with nothing stale."""
    steps, per_batch = 40, 16
    runs, run_id = tmp_path / "runs", f"inherit-{os.getpid()}-{int(time.time())}"
    simulated = (
        "explorer.engine=simulated",
        # a sleep per token, whatever the CPU: 16 tasks x 8 rollouts x 4 tokens = 2.6 s a
        # batch, 1.3 s for a half share
        "explorer.simulated_seconds_per_token=0.005",
        f"explorer.batch_size={per_batch}",
    )
    run = start_piped(
        run_argv(
            EXAMPLE,
            run_id,
            steps,
            runs,
            services,
            "eval.interval=0",
            "trainer.warmup_sft_steps=0",
            f"trainer.batch_size={per_batch}",
            *simulated,
            explorers=1,
            summary=tmp_path / "s.json",
        ),
        tmp_path,
    )
    hand_log, hand = tmp_path / "hand.log", None
    try:
        explorer_log = runs / run_id / "logs" / "explorer-0.log"
        wait_for(
            lambda: log_has(explorer_log, "holds tasks partitions [0, 1, 2, 3]"),
            run,
            240,
            "explorer-0 to hold every tasks partition",
        )
        hand = start_logged(
            explore_argv(
                EXAMPLE,
                run_id,
                runs,
                services,
                f"trainer.batch_size={per_batch}",
                *simulated,
                # 4 times slower: its half share takes 5 s, the window the kill must land
                # in once its sampling has begun, whatever the load on the machine
                "explorer.simulated_seconds_per_token=0.02",
            ),
            hand_log,
            tmp_path,
        )

        def applied() -> int:
            assert hand.poll() is None, hand_log.read_text()[-3000:]
            return hand_log.read_text().count(": applied version ")

        wait_for(lambda: applied() >= 3, run, 240, "the hand-started explorer to work")
        before = applied()
        wait_for(lambda: applied() > before, run, 60, "its next batch")  # sampling it now
        hand.send_signal(signal.SIGKILL)
        hand.wait(timeout=30)
        _, err = run.communicate(timeout=600)
    finally:
        for proc in (hand, run):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert run.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["stale_dropped"] == 0 and summary["books"]["trained_twice"] == 0

    groups, metrics = groups_and_trainer_metrics(make_config(run={"id": run_id}))
    by_batch = _check_books(groups, metrics, steps, per_batch)
    hand_id = next(g.explorer for g in groups if g.explorer != "explorer-0")
    assert all(g.model_version >= batch_version(g.batch, 1, 1) for g in groups)
    # the batch the hand explorer died in: explorer-0 sampled its own share with the
    # batch's version, and the inherited share later, with a newer one
    last = max(g.batch for g in groups if g.explorer == hand_id)
    finished = [
        b
        for b in range(last, steps)
        if any(g.model_version > batch_version(b, 1, 1) for g in by_batch[b].values())
    ]
    assert finished, "no batch was finished by the explorer that inherited the partitions"
    assert {g.explorer for g in by_batch[finished[0]].values()} == {"explorer-0"}
    assert not processes_mentioning(run_id)
