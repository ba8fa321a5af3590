"""Sync-style rules (pure)."""

from __future__ import annotations

import pytest

from streamrft.sync.styles import (
    ExplorerSync,
    Schedule,
    batch_version,
    choose_version,
    explorer_sync,
    required_version,
    staleness_floor,
    trainer_publishes,
    trainer_version_at,
)

pytestmark = pytest.mark.unit


def test_first_version_is_awaited_by_every_style():
    for style in ("fixed", "dynamic_by_trainer", "dynamic_by_explorer", "fully_async"):
        plan = explorer_sync(Schedule(style, 2, 1, 2), 0, 0, -1)
        assert plan.wait_for == 0 and plan.apply and plan.request is None


def test_fixed_samples_every_batch_of_an_interval_with_the_version_of_its_first():
    fixed = Schedule("fixed", sync_interval=2, sync_offset=1, max_staleness=2)
    # the explorer's own step plays no part: only the batch counts
    assert explorer_sync(fixed, 3, 17, 0) == ExplorerSync(wait_for=0, target=0, apply=False)
    assert explorer_sync(fixed, 4, 0, 0) == ExplorerSync(wait_for=2, target=2, apply=True)
    assert explorer_sync(fixed, 5, 1, 2) == ExplorerSync(wait_for=2, target=2, apply=False)
    assert explorer_sync(fixed, 2, 0, 0).apply is False  # needs 0, has 0
    assert [batch_version(b, 2, 1) for b in range(8)] == [0, 0, 0, 0, 2, 2, 4, 4]
    assert [batch_version(b, 1, 1) for b in range(5)] == [0, 0, 1, 2, 3]


def test_dynamic_by_explorer_requests_one_newer_version_every_interval():
    style = Schedule("dynamic_by_explorer", sync_interval=3, sync_offset=0, max_staleness=3)
    assert explorer_sync(style, 7, 2, 5) == ExplorerSync(apply=False)
    assert explorer_sync(style, 7, 3, 5) == ExplorerSync(request=6, wait_for=6)
    # never a version that needs the explorer's own batch trained (a small explorer step)
    assert explorer_sync(style, 5, 3, 5) == ExplorerSync(apply=False)


def test_dynamic_by_explorer_without_weights_asks_for_what_its_batch_needs():
    style = Schedule("dynamic_by_explorer", sync_interval=3, sync_offset=0, max_staleness=3)
    assert explorer_sync(style, 10, 0, -1) == ExplorerSync(request=7, wait_for=7)
    assert explorer_sync(style, 2, 0, -1) == ExplorerSync(wait_for=0)  # version 0 is out


def test_dynamic_by_explorer_asks_when_too_far_ahead_of_its_version():
    style = Schedule("dynamic_by_explorer", sync_interval=3, sync_offset=0, max_staleness=3)
    # batch 10 is trained with at most version 10: sampled with 5 it would be 5 behind
    assert explorer_sync(style, 10, 1, 5) == ExplorerSync(request=7, wait_for=7)
    # at a sync point the newer of the two
    assert explorer_sync(style, 10, 3, 6) == ExplorerSync(request=7, wait_for=7)
    assert explorer_sync(style, 10, 3, 8) == ExplorerSync(request=9, wait_for=9)


def test_dynamic_by_trainer_takes_the_newest_and_waits_only_when_ahead():
    style = Schedule("dynamic_by_trainer", sync_interval=2, sync_offset=1, max_staleness=2)
    plan = explorer_sync(style, 5, 7, 3)  # trained with version 4: 3 is fresh enough
    assert plan.wait_for is None and plan.request is None and plan.target is None
    assert choose_version([0, 2, 4, 6], plan, 3, 1) == 6
    assert choose_version([0, 2], plan, 3, 1) is None  # nothing newer
    # batch 7 is trained with version 6: it needs a version >= 4 (backpressure)
    assert explorer_sync(style, 7, 7, 3) == ExplorerSync(wait_for=4)


@pytest.mark.parametrize(
    "style", ["fixed", "dynamic_by_trainer", "dynamic_by_explorer", "fully_async"]
)
@pytest.mark.parametrize(("interval", "offset"), [(1, 0), (1, 1), (2, 1), (3, 2), (4, 0)])
def test_no_batch_is_sampled_staler_than_the_trainer_allows(style, interval, offset):
    """Whatever version a plan lets a batch be sampled with is within ``max_staleness``
    of the version the trainer holds when it trains that batch (the smallest staleness
    the config check allows)."""
    staleness = offset + interval - 1
    schedule = Schedule(style, interval, offset, staleness)
    for batch in range(40):
        lowest = explorer_sync(schedule, batch, batch, 0).wait_for or 0
        if style == "fixed":
            assert lowest == batch_version(batch, interval, offset)
        assert lowest >= staleness_floor(schedule, batch)
        assert trainer_version_at(schedule, batch) - lowest <= staleness, batch


def test_choose_honours_the_target_while_fresh_enough():
    plan = ExplorerSync(wait_for=4, target=4)
    assert choose_version([0, 2, 4, 5], plan, 2, 1) == 4
    # a trainer fed by several explorers ran ahead: the target would be dropped as stale
    assert choose_version([0, 2, 4, 5, 6, 7], plan, 2, 1) == 7
    # versions jumped on a trainer resume: the first one above the target
    assert choose_version([0, 2, 9], ExplorerSync(wait_for=4, target=4), 2, 10) == 9
    assert choose_version([0, 2, 4], ExplorerSync(apply=False), 0, 1) is None


def test_required_version_table():
    assert [required_version(e, 2, 1) for e in range(8)] == [0, 0, 0, 2, 2, 4, 4, 6]
    assert [required_version(e, 1, 0) for e in range(4)] == [0, 1, 2, 3]
    assert [required_version(e, 3, 2) for e in range(7)] == [0, 0, 0, 0, 0, 3, 3]


def test_fully_async_takes_the_newest_at_every_step_and_waits_only_at_the_floor():
    style = Schedule("fully_async", sync_interval=1, sync_offset=1, max_staleness=2)
    for step in range(6):  # never a request, a target or an exact version
        plan = explorer_sync(style, step, step, max(0, step - 1))
        assert plan.request is None and plan.target is None and plan.apply
        assert plan.wait_for is None or plan.wait_for == step - 2
    assert choose_version([0, 1, 2, 3], explorer_sync(style, 3, 3, 0), 0, 2) == 3
    # batch 6 is trained with version 6: version 3 is too stale, it waits for 4
    assert explorer_sync(style, 6, 6, 3) == ExplorerSync(wait_for=4)
    assert trainer_publishes("fully_async", 3, 1, 0)
    assert [trainer_publishes("fully_async", s, 2, 0) for s in range(1, 5)] == [
        False,
        True,
        False,
        True,
    ]


def test_trainer_publishing_rule():
    assert [trainer_publishes("fixed", s, 2, 0) for s in range(1, 5)] == [False, True, False, True]
    assert trainer_publishes("dynamic_by_trainer", 4, 2, 0)
    assert not trainer_publishes("dynamic_by_explorer", 4, 2, 0)
    assert trainer_publishes("dynamic_by_explorer", 3, 2, 1)
