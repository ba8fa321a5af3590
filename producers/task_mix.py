"""Which tasks an epoch holds, and in which order: index arithmetic only, no I/O.

One task set (``taskset.path``): every task once per epoch, shuffled with the seed
``run.seed * 7919 + epoch`` (:func:`epoch_order`).

Several (``taskset.sources``): an epoch of ``total`` tasks gives source ``s`` the share
:func:`shares` computes from the weights. Each source is read as an endless stream of
passes over its rows (each pass a fresh permutation when shuffling, seeded by the run's
seed, the source and the pass), and epoch ``e`` takes the next ``share`` items of it: a
source smaller than its share is repeated within the epoch, a larger one is covered over
several epochs, and no row comes twice before every row has come once. The epoch's items
are then shuffled together (or, without shuffling, interleaved evenly by position).

An item of a mixed epoch is one integer: ``row + repeat * rows``, where ``row`` indexes
the sources' rows laid end to end (source 0's first) and ``repeat`` is how many times that
row came earlier in the same epoch, so that a row taken twice in one epoch carries two
different task ids (:func:`split_item`).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

import numpy as np


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> array:
    """The rows of one task set of ``n`` tasks in epoch ``epoch``'s order (8 bytes a
    task)."""
    order = array("q", range(n))
    if shuffle:
        random.Random(seed * 7919 + epoch).shuffle(order)
    return order


def shares(weights: Sequence[float], total: int) -> list[int]:
    """Whole tasks per source out of ``total``, proportional to ``weights``: the floors,
    then one more each for the largest remainders (ties to the earlier source)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _rng(*key: int) -> np.random.Generator:
    """A generator seeded by ``key`` (the run's seed may be negative: taken modulo 2^64)."""
    return np.random.default_rng([k % 2**64 for k in key])


def _pass(size: int, seed: int, source: int, number: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    return _rng(seed, 1, source, number).permutation(size)


def _repeats(items: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """How often each item's row came earlier in this epoch: each pass holds a row once,
    and the first pass of the epoch may be a tail that lacks it."""
    if len(numbers) == 0:
        return numbers
    first = numbers == numbers[0]
    repeats = numbers - numbers[0]
    later = ~first
    repeats[later] -= ~np.isin(items[later], items[first])
    return repeats


def mixed_epoch(
    sizes: Sequence[int],
    weights: Sequence[float],
    total: int,
    epoch: int,
    seed: int,
    shuffle: bool,
) -> np.ndarray:
    """Epoch ``epoch`` of sources of ``sizes`` rows mixed by ``weights`` into ``total``
    tasks: its items in order (see the module docstring)."""
    rows = sum(sizes)
    starts = np.cumsum([0, *sizes[:-1]])
    parts, keys = [], []
    for s, (size, count) in enumerate(zip(sizes, shares(weights, total), strict=True)):
        first, end = epoch * count, (epoch + 1) * count  # positions in the source's stream
        pieces, numbers = [], []
        for number in range(first // size, -(-end // size)):  # the passes the share touches
            lo, hi = max(first, number * size), min(end, (number + 1) * size)
            pieces.append(
                _pass(size, seed, s, number, shuffle)[lo - number * size : hi - number * size]
            )
            numbers.append(np.full(hi - lo, number, dtype=np.int64))
        items = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        passes = np.concatenate(numbers) if numbers else np.empty(0, dtype=np.int64)
        parts.append(starts[s] + items + _repeats(items, passes) * rows)
        keys.append((np.arange(count) + 0.5) / count)
    merged = np.concatenate(parts)
    if shuffle:
        return merged[_rng(seed, 2, epoch).permutation(len(merged))]
    return merged[np.argsort(np.concatenate(keys), kind="stable")]


def split_item(item: int, rows: int) -> tuple[int, int]:
    """``(row, repeat)`` of a mixed epoch's ``item`` over sources of ``rows`` rows in all."""
    repeat, row = divmod(int(item), rows)
    return row, repeat
