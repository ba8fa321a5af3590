"""The trainer's books, audited from its ledger with memory that does not grow per event.

Every trainer step's metrics event carries its ledger: the groups it trained and the
version each was sampled with. The run summary checks them: every group trained once,
none newer than the trainer, none staler than ``trainer.max_staleness``. Keeping every
event for that (what the monitor did) grows with the run; here the newest
``WINDOW_STEPS`` steps are kept as compact digests (a step redone after a resume from an
older checkpoint replaces its lost attempt, which only a recent step can be), and older
steps are folded into counters and one sorted array of 64-bit group-id digests: 8 bytes
per group the run trained, the least that can still tell a group trained twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from streamrft.schemas.events import MetricsEvent

WINDOW_STEPS = 2000
"""Steps kept whole (replaceable by a redo); older ones are folded (``monitor.ledger_steps``)."""


@dataclass(frozen=True)
class _Step:
    digests: np.ndarray
    """uint64 digest of each trained row's group id."""
    newer: int
    staler: int
    max_stale: int


def _digest(group_id: str) -> int:
    return xxhash.xxh3_64_intdigest(group_id.encode())


def _merge(ids: np.ndarray, twice: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` (sorted, distinct) and ``twice`` (those seen more than once) with ``new``."""
    values, counts = np.unique(np.concatenate([ids, new]), return_counts=True)
    return values, np.union1d(twice, values[counts > 1])


class Books:
    """The audit of a run's ledger: :meth:`add` each trainer metrics event, :meth:`audit`
    at the end."""

    def __init__(
        self, max_staleness: int, window: int = WINDOW_STEPS, fold: int | None = None
    ) -> None:
        """``fold``: steps folded at once, when the window is that many past its size (each
        fold sorts the digests of the whole run once); default a quarter of the window."""
        fold = max(1, window // 4) if fold is None else fold
        self.max_staleness = max_staleness
        self.window_steps, self.fold_steps = window, fold
        self.window: dict[int, _Step] = {}
        """Step -> its digests and counts, for the newest ``window_steps`` steps."""
        self.folded_steps = 0
        self.folded_newest = -1
        """The newest step folded: a redo of a step at or below it is counted again."""
        self._ids = np.empty(0, np.uint64)
        self._twice = np.empty(0, np.uint64)
        self._newer = self._staler = self._max_stale = 0

    def add(self, ev: MetricsEvent) -> None:
        """Record a step's ledger (a step seen before replaces its earlier attempt)."""
        if not ev.trained:
            return
        stale = np.fromiter((ev.version - r.model_version for r in ev.trained), np.int64)
        digests = np.fromiter((_digest(r.group_id) for r in ev.trained), np.uint64)
        self.window[ev.step] = _Step(
            digests,
            int((stale < 0).sum()),
            int((stale > self.max_staleness).sum()),
            max(0, int(stale.max())),
        )
        if len(self.window) >= self.window_steps + self.fold_steps:
            self._fold(sorted(self.window)[: self.fold_steps])

    def _fold(self, steps: list[int]) -> None:
        folding = [self.window.pop(s) for s in steps]
        self._ids, self._twice = _merge(
            self._ids, self._twice, np.concatenate([s.digests for s in folding])
        )
        self._newer += sum(s.newer for s in folding)
        self._staler += sum(s.staler for s in folding)
        self._max_stale = max([self._max_stale, *(s.max_stale for s in folding)])
        self.folded_steps += len(folding)
        self.folded_newest = max(self.folded_newest, steps[-1])

    def audit(self) -> tuple[dict[str, int], int]:
        """The books, and how many distinct groups were trained."""
        steps = list(self.window.values())
        window = [s.digests for s in steps]
        ids, twice = _merge(
            self._ids, self._twice, np.concatenate([np.empty(0, np.uint64), *window])
        )
        books = {
            "trained_twice": len(twice),
            "newer_than_trainer": self._newer + sum(s.newer for s in steps),
            "staler_than_max": self._staler + sum(s.staler for s in steps),
            "max_staleness_seen": max([self._max_stale, *(s.max_stale for s in steps)]),
            "steps_in_ledger": self.folded_steps + len(steps),
            "ledger_window_steps": len(steps),
        }
        return books, len(ids)
