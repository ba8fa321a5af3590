"""What the trainer holds between consuming and training. Pure logic, no I/O.

- Deduplicates by experience id (at-least-once delivery upstream), remembering the most
  recent ``dedup_window`` ids (:class:`SeenIds`).
- Drops groups more than ``max_staleness`` versions behind, counted.
- Hands out batches in batch order (:attr:`ExperienceGroup.batch`): a step takes the
  groups of the oldest batch buffered, and waits while that batch is incomplete (fewer of
  its groups arrived than a step takes: the rest are still being explored), unless the
  caller forces it (nothing arrived for ``trainer.batch_wait_s``). Groups without a batch
  (an application's) go first, in arrival order, and wait for nothing.
- Tracks, per partition, the offset from which a restart must read again: the lowest
  offset still buffered (not trained), or the next offset when nothing is buffered.

Why a window is enough: a restart resumes each partition at the offset the checkpoint
stored, so records before it are never read again; what can still arrive is a new copy
of a group published later (an explorer that crashed after publishing and explored the
task again, the feeder sending an epoch again after a broker outage, two explorers after
a rebalance). Such a copy comes soon after the original, within a window of recent ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from streamrft.consumers.state import DIGEST_SIZE, TrainerState, id_digest, offsets_list
from streamrft.infra.config import TrainerConfig
from streamrft.schemas.experience import ExperienceGroup

PartitionKey = tuple[str, int]


class SeenIds:
    """The most recent ``window`` experience ids, as digests (``state.id_digest``).

    Adding beyond ``window`` forgets the oldest: a copy of an experience that arrives more
    than ``window`` ids after its original is not recognised.
    """

    def __init__(self, window: int, digests: bytes = b"") -> None:
        self.window = window
        self._order: deque[bytes] = deque()
        self._set: set[bytes] = set()
        self.add(digests[i : i + DIGEST_SIZE] for i in range(0, len(digests), DIGEST_SIZE))

    def any_of(self, digests: Iterable[bytes]) -> bool:
        return any(d in self._set for d in digests)

    def add(self, digests: Iterable[bytes]) -> None:
        for d in digests:
            if d not in self._set:
                self._order.append(d)
                self._set.add(d)
        while len(self._order) > self.window:
            self._set.discard(self._order.popleft())

    def encode(self, leave_out: set[bytes]) -> bytes:
        """The remembered digests, oldest first, concatenated, without ``leave_out``."""
        return b"".join(d for d in self._order if d not in leave_out)

    def __len__(self) -> int:
        return len(self._order)


def _digests(group: ExperienceGroup) -> list[bytes]:
    return [id_digest(e.id) for e in group.experiences]


@dataclass
class Buffered:
    group: ExperienceGroup
    partition: PartitionKey
    offset: int
    seq: int
    """Arrival order."""

    @property
    def order(self) -> tuple[int, int]:
        """Batch first (unstamped, -1, before any), then arrival."""
        return (max(self.group.batch, -1), self.seq)


ARRIVALS_KEPT = 4096
"""Batches whose arrival counts are remembered (the newest; older ones are long done)."""


@dataclass
class ExperienceBuffer:
    max_staleness: int
    dedup_window: int = TrainerConfig().dedup_window
    seen: SeenIds = field(init=False)
    queue: deque[Buffered] = field(default_factory=deque)
    next_offsets: dict[PartitionKey, int] = field(default_factory=dict)
    duplicates_dropped: int = 0
    stale_dropped: int = 0
    arrived: dict[int, int] = field(default_factory=dict)
    """Per batch index: groups that arrived (not duplicates), trained, dropped or buffered."""
    trained_through: int = -1
    """Highest batch index trained so far: an older batch still buffered is the rest of a
    batch trained in part (a forced step, a restart), and waits for nothing more."""
    _seq: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.seen = SeenIds(self.dedup_window)

    def skip(self, partition: PartitionKey, offset: int) -> None:
        """A record consumed but not offered (dead-lettered): a restart resumes after it."""
        self.next_offsets[partition] = max(self.next_offsets.get(partition, 0), offset + 1)

    def offer(self, group: ExperienceGroup, partition: PartitionKey, offset: int) -> bool:
        """Take a consumed group; False when it was a duplicate (already seen)."""
        self.skip(partition, offset)
        digests = _digests(group)
        if self.seen.any_of(digests):
            self.duplicates_dropped += 1
            return False
        self.seen.add(digests)
        self._seq += 1
        self.queue.append(Buffered(group, partition, offset, self._seq))
        if group.batch >= 0:
            self.arrived[group.batch] = self.arrived.get(group.batch, 0) + 1
            if len(self.arrived) > ARRIVALS_KEPT:
                del self.arrived[min(self.arrived)]
        return True

    def drop_stale(self, version: int) -> list[ExperienceGroup]:
        """Remove and return buffered groups older than ``version - max_staleness``."""
        keep, dropped = deque(), []
        for item in self.queue:
            if version - item.group.model_version > self.max_staleness:
                dropped.append(item.group)
            else:
                keep.append(item)
        self.queue = keep
        self.stale_dropped += len(dropped)
        return dropped

    def take(self, n: int, force: bool = False) -> list[ExperienceGroup] | None:
        """The first ``n`` buffered groups in batch order; None when fewer are buffered, or
        when the oldest batch among them has had fewer than ``n`` groups arrive (the rest
        are still being explored) and ``force`` is not set."""
        if len(self.queue) < n:
            return None
        chosen = sorted(self.queue, key=lambda item: item.order)[:n]
        oldest = min((i.group.batch for i in chosen if i.group.batch >= 0), default=None)
        if not force and oldest is not None and not self.complete(oldest, n):
            return None
        taken = {id(item) for item in chosen}
        self.queue = deque(item for item in self.queue if id(item) not in taken)
        self.trained_through = max([self.trained_through] + [i.group.batch for i in chosen])
        return [item.group for item in chosen]

    def complete(self, batch: int, n: int) -> bool:
        """Whether nothing more of ``batch`` is worth waiting for: ``n`` of its groups
        arrived, or a later batch was trained already."""
        return self.arrived.get(batch, 0) >= n or batch < self.trained_through

    def waiting_for(self) -> int | None:
        """The oldest batch buffered (None: none stamped), the one a step waits on."""
        return min((i.group.batch for i in self.queue if i.group.batch >= 0), default=None)

    def __len__(self) -> int:
        return len(self.queue)

    def resume_offsets(self) -> dict[PartitionKey, int]:
        """Per partition, where a restarted trainer must resume reading."""
        offsets = dict(self.next_offsets)
        for item in self.queue:
            offsets[item.partition] = min(offsets[item.partition], item.offset)
        return offsets

    # -- checkpoints -----------------------------------------------------------------------
    def dedup_state(self) -> bytes:
        """The dedup window as :attr:`TrainerState.seen`: the ids of groups still buffered
        are left out, since a restart reads those groups again from the resume offsets."""
        queued = {d for item in self.queue for d in _digests(item.group)}
        return self.seen.encode(leave_out=queued)

    def state(self, *, step: int, version: int, counters: Mapping[str, float]) -> TrainerState:
        """The trainer's checkpoint state: this buffer's part plus the loop's own."""
        return TrainerState(
            step=step,
            version=version,
            offsets=offsets_list(self.resume_offsets()),
            seen=self.dedup_state(),
            counters=dict(counters),
            duplicates_dropped=self.duplicates_dropped,
            stale_dropped=self.stale_dropped,
            trained_through=self.trained_through,
        )

    def restore(self, state: TrainerState) -> None:
        """Go on from ``state`` (in place: other components hold this buffer), emptied: the
        dedup window (cut to the newest ``dedup_window`` ids if it was larger), the drop
        counters, and the resume offsets as next offsets, so a partition nothing is read
        from keeps its offset in the next checkpoint."""
        self.queue.clear()
        self.arrived.clear()  # the batches read again arrive again
        self.seen = SeenIds(self.dedup_window, state.seen)
        self.next_offsets = state.resume_offsets()
        self.duplicates_dropped = state.duplicates_dropped
        self.stale_dropped = state.stale_dropped
        self.trained_through = state.trained_through
