"""Sync-style rules (pure)."""

from __future__ import annotations

import pytest

from streamrft.sync.styles import (
    ExplorerSync,
    choose_version,
    explorer_sync,
    required_version,
    trainer_publishes,
)

pytestmark = pytest.mark.unit


def test_first_version_is_awaited_by_every_style():
    for style in ("fixed", "dynamic_by_trainer", "dynamic_by_explorer"):
        plan = explorer_sync(style, 0, -1, 2, 1)
        assert plan.wait_for == 0 and plan.apply and plan.request is None


def test_fixed_waits_for_the_required_version_at_sync_points_only():
    assert explorer_sync("fixed", 3, 0, 2, 1) == ExplorerSync(apply=False)
    plan = explorer_sync("fixed", 4, 0, 2, 1)
    assert plan == ExplorerSync(wait_for=2, target=2, apply=True)
    assert explorer_sync("fixed", 2, 0, 2, 1).apply is False  # needs 0, has 0


def test_dynamic_by_explorer_requests_one_newer_version_every_interval():
    assert explorer_sync("dynamic_by_explorer", 2, 5, 3, 0) == ExplorerSync(apply=False)
    assert explorer_sync("dynamic_by_explorer", 3, 5, 3, 0) == ExplorerSync(request=6, wait_for=6)


def test_dynamic_by_trainer_takes_the_newest_without_waiting():
    plan = explorer_sync("dynamic_by_trainer", 7, 3, 2, 1)
    assert plan.wait_for is None and plan.request is None and plan.target is None
    assert choose_version([0, 2, 4, 6], plan, 3, 1) == 6
    assert choose_version([0, 2], plan, 3, 1) is None  # nothing newer


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


def test_trainer_publishing_rule():
    assert [trainer_publishes("fixed", s, 2, 0) for s in range(1, 5)] == [False, True, False, True]
    assert trainer_publishes("dynamic_by_trainer", 4, 2, 0)
    assert not trainer_publishes("dynamic_by_explorer", 4, 2, 0)
    assert trainer_publishes("dynamic_by_explorer", 3, 2, 1)
