"""Which tasks an epoch holds: one task set in the order runs have always had, several
mixed in the stated proportions, each covered pass by pass, repeats told apart."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from streamrft.producers.task_mix import epoch_order, mixed_epoch, shares, split_item

pytestmark = pytest.mark.unit


def test_one_task_set_keeps_the_shuffle_runs_have_always_had():
    for n, epoch, seed in ((10, 0, 0), (100, 3, 7), (1, 0, 5)):
        old = list(range(n))  # the feeder's order before the task file: a shuffled list
        random.Random(seed * 7919 + epoch).shuffle(old)
        assert list(epoch_order(n, epoch, seed, True)) == old
    assert list(epoch_order(5, 2, 0, False)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("weights", "total", "expected"),
    [
        ([1, 1, 1], 10, [4, 3, 3]),  # remainders tie: the earlier source first
        ([3, 1], 100, [75, 25]),
        ([1, 2], 7, [2, 5]),  # 2.33 and 4.67: the larger remainder rounds up
        ([0.5, 0.25, 0.25], 8, [4, 2, 2]),
        ([1, 1000], 10, [0, 10]),  # a share under half a task may be none this epoch
    ],
)
def test_shares_are_the_weights_in_whole_tasks(weights, total, expected):
    assert shares(weights, total) == expected


def _items(sizes, weights, total, epoch, seed=0, shuffle=True):
    rows = sum(sizes)
    return [split_item(x, rows) for x in mixed_epoch(sizes, weights, total, epoch, seed, shuffle)]


def _source(row, sizes):
    for s, size in enumerate(sizes):
        if row < size:
            return s
        row -= size
    raise AssertionError(row)


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_epoch_holds_each_source_in_its_share(shuffle):
    sizes, weights, total = [30, 10, 7], [1, 3, 1], 50
    for epoch in range(4):
        items = _items(sizes, weights, total, epoch, shuffle=shuffle)
        assert len(items) == total
        by_source = Counter(_source(row, sizes) for row, _ in items)
        assert [by_source[s] for s in range(3)] == shares(weights, total) == [10, 30, 10]
        assert len(set(items)) == total  # a row taken twice in an epoch: another repeat number


def test_a_source_is_covered_pass_by_pass_across_epochs():
    """Source 0 (30 rows, 10 an epoch) is covered whole every 3 epochs, no row twice
    before all came once; source 1 (10 rows, 30 an epoch) comes 3 times an epoch, each row
    with repeats 0, 1 and 2; source 2 (7 rows, 10 an epoch) runs over its pass boundary."""
    sizes = [30, 10, 7]
    seen0: list[int] = []
    taken2: Counter = Counter()
    for epoch in range(7):
        items = _items(sizes, [1, 3, 1], 50, epoch)
        seen0 += [row for row, _ in items if row < 30]
        ones = Counter(row for row, _ in items if 30 <= row < 40)
        assert set(ones) == set(range(30, 40)) and set(ones.values()) == {3}
        assert sorted(r for row, r in items if 30 <= row < 40) == sorted([0, 1, 2] * 10)
        taken2.update(row for row, _ in items if row >= 40)
        # after every epoch no row of source 2 came twice more often than another
        assert max(taken2.values()) - min(taken2[r] for r in range(40, 47)) <= 1
        twice = Counter(row for row, _ in items if row >= 40)
        repeats = {row: sorted(r for x, r in items if x == row) for row in twice}
        assert all(repeats[row] == list(range(twice[row])) for row in twice)
    for p in range(2):  # 70 taken: two whole passes of source 0 first
        assert sorted(seen0[30 * p : 30 * (p + 1)]) == list(range(30))
    assert taken2 == Counter({row: 10 for row in range(40, 47)})  # 70 taken: 10 passes


def test_the_same_seed_gives_the_same_epochs_and_another_seed_another_order():
    a = _items([20, 5], [1, 1], 25, 1, seed=3)
    assert a == _items([20, 5], [1, 1], 25, 1, seed=3)
    assert a != _items([20, 5], [1, 1], 25, 1, seed=4)
    assert sorted(a) != a  # shuffled together, not source after source


def test_without_shuffling_the_sources_are_interleaved_evenly_in_file_order():
    items = _items([8, 4], [2, 1], 12, 0, shuffle=False)
    assert [row for row, _ in items] == [0, 8, 1, 2, 9, 3, 4, 10, 5, 6, 11, 7]
    for k in range(1, 13):  # every prefix holds source 0's share within one task
        assert abs(sum(row < 8 for row, _ in items[:k]) - 2 * k / 3) <= 1


def test_a_negative_seed_mixes_like_any_other():
    items = _items([6, 4], [6, 4], 10, 0, seed=-3)
    assert sorted(items) == [(row, 0) for row in range(10)]
    assert items != _items([6, 4], [6, 4], 10, 0, seed=3)
