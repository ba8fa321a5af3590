"""Which versions an evaluator evaluates (``producers/evaluator.due_version``): pure."""

from __future__ import annotations

import pytest

from streamrft.producers.evaluator import due_version, turn

pytestmark = pytest.mark.unit


def test_version_zero_and_every_multiple_in_order_when_it_keeps_up():
    seen, done = [], -1
    for newest in range(0, 13):  # one version at a time, evaluated before the next
        version, skipped = due_version(range(newest + 1), done, every=4)
        if version is not None:
            assert skipped == 0
            seen.append(version)
            done = version
    assert seen == [0, 4, 8, 12]


def test_one_that_falls_behind_takes_the_newest_due_and_counts_the_rest():
    assert due_version(range(0, 11), -1, every=2) == (10, 5)  # 0, 2, 4, 6, 8 passed over
    assert due_version(range(0, 11), 4, every=2) == (10, 2)  # 6, 8 passed over
    assert due_version(range(0, 11), 10, every=2) == (None, 0)
    assert due_version([], -1, every=1) == (None, 0)


def test_the_last_version_is_due_once_the_run_has_ended():
    announced = [0, 3, 6, 7]
    assert due_version(announced, 6, every=3) == (None, 0)  # 7 is not a multiple of 3
    assert due_version(announced, 6, every=3, final=True) == (7, 0)
    assert due_version(announced, 7, every=3, final=True) == (None, 0)  # done already
    # behind at the end: the last one, the due ones before it counted as passed over
    assert due_version(announced, -1, every=3, final=True) == (7, 3)


def test_evaluators_share_the_due_versions_by_turn():
    taken: dict[int, list[int]] = {i: [] for i in range(3)}
    for i in range(3):
        done = -1
        for newest in range(25):  # keeping up: one version at a time
            version, _ = due_version(range(newest + 1), done, every=5, index=i, group=3)
            if version is not None:
                taken[i].append(version)
                done = version
    assert taken == {0: [0, 15], 1: [5, 20], 2: [10]}
    # the last version (not a multiple) belongs to the turn it falls in: ceil(23 / 5) = 5
    assert turn(23, 5) == 5 and turn(25, 5) == 5 and turn(0, 5) == 0
    assert due_version(range(0, 24), 20, every=5, index=2, group=3, final=True) == (23, 0)
    assert due_version(range(0, 24), 20, every=5, index=1, group=3, final=True) == (None, 0)
