"""What the trainer holds between consuming and training. Pure logic, no I/O.

- Deduplicates by experience id (at-least-once delivery upstream), remembering the most
  recent ``dedup_window`` ids (:class:`SeenIds`).
- Drops groups more than ``max_staleness`` versions behind, counted.
- With ``dynamic_sampling`` (DAPO), drops a group whose rewards are all equal when it
  arrives (no signal for a group-relative advantage), counted as
  ``zero_variance_dropped``: it counts as arrived for its batch (so nobody waits for it),
  its offset is done (it never holds back a resume offset) and its ids are remembered in
  the dedup window, as a trained group's are. The step does not train a short batch: it
  waits for more groups, taking the following batch's to fill up (the batch order below
  lets it, since the batch it dropped from is complete).
- Hands out batches by the run's sample strategy (``sampling.py``); the ``default`` one
  takes them in batch order (:attr:`ExperienceGroup.batch`): a step takes the
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
from streamrft.consumers.strategies import (
    BatchOrder,
    Buffered,
    PartitionKey,
    SampleStrategy,
    SamplingOptions,
    has_signal,
)
from streamrft.infra.config import TrainerConfig
from streamrft.infra.expert import EXPERT_WORKFLOW
from streamrft.schemas.experience import ExperienceGroup

__all__ = ["ARRIVALS_KEPT", "Buffered", "ExperienceBuffer", "PartitionKey", "SeenIds"]


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
    strategy: SampleStrategy = field(
        default_factory=lambda: BatchOrder(SamplingOptions()), kw_only=True
    )
    """Chooses each step's groups (``algorithm.sample_strategy``; default: batch order)."""
    dynamic_sampling: bool = field(default=False, kw_only=True)
    """Drop groups whose rewards are all equal on arrival (``algorithm.dynamic_sampling``)."""
    zero_variance_dropped: int = 0
    """Groups dropped by ``dynamic_sampling``."""
    last_replayed: int = 0
    """Groups of the last batch taken that were trained before (``priority_replay``)."""
    last_positions: list[tuple[PartitionKey, int]] = field(default_factory=list)
    """Where each stream group of the last batch taken was read (partition, offset)."""
    last_extra: int = 0
    """Groups of the last batch taken that were not read from the stream for it: replays
    and the ``mix`` strategy's expert groups (the last ones of the batch)."""
    _seq: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.seen = SeenIds(self.dedup_window)

    def skip(self, partition: PartitionKey, offset: int) -> None:
        """A record consumed but not offered (dead-lettered): a restart resumes after it."""
        self.next_offsets[partition] = max(self.next_offsets.get(partition, 0), offset + 1)

    def offer(self, group: ExperienceGroup, partition: PartitionKey, offset: int) -> bool:
        """Take a consumed group; False when it was a duplicate (already seen). A group
        dropped for zero reward variance (``dynamic_sampling``) is taken and done at once."""
        self.skip(partition, offset)
        digests = _digests(group)
        if self.seen.any_of(digests):
            self.duplicates_dropped += 1
            return False
        self.seen.add(digests)
        if group.batch >= 0:
            self.arrived[group.batch] = self.arrived.get(group.batch, 0) + 1
            if len(self.arrived) > ARRIVALS_KEPT:
                del self.arrived[min(self.arrived)]
        if self.dynamic_sampling and group.workflow != EXPERT_WORKFLOW and not has_signal(group):
            self.zero_variance_dropped += 1
            return True
        self._seq += 1
        self.queue.append(Buffered(group, partition, offset, self._seq))
        return True

    def drop_stale(self, version: int) -> list[ExperienceGroup]:
        """Remove and return buffered groups older than ``version - max_staleness``."""
        keep: deque[Buffered] = deque()
        dropped: list[ExperienceGroup] = []
        for item in self.queue:
            if version - item.group.model_version > self.max_staleness:
                dropped.append(item.group)
            else:
                keep.append(item)
        self.queue = keep
        self.stale_dropped += len(dropped)
        self.strategy.drop_stale(version, self.max_staleness)
        return dropped

    def take(self, n: int, force: bool = False) -> list[ExperienceGroup] | None:
        """``n`` groups as the strategy chooses them; None when it waits for more. With the
        ``default`` strategy: the first ``n`` buffered groups in batch order; None when
        fewer are buffered, or when the oldest batch among them has had fewer than ``n``
        groups arrive (the rest are still being explored) and ``force`` is not set."""
        choice = self.strategy.choose(self.queue, n, force, lambda b: self.complete(b, n))
        if choice is None:
            return None
        taken = {id(item) for item in choice.fresh}
        self.queue = deque(item for item in self.queue if id(item) not in taken)
        self.trained_through = max([self.trained_through] + [i.group.batch for i in choice.fresh])
        self.last_positions = [(item.partition, item.offset) for item in choice.fresh]
        # extra groups are replays, or the mix strategy's expert groups (counted by the step)
        self.last_replayed = sum(g.workflow != EXPERT_WORKFLOW for g in choice.extra)
        self.last_extra = len(choice.extra)
        self.strategy.taken(choice)
        return [item.group for item in choice.fresh] + choice.extra

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
            zero_variance_dropped=self.zero_variance_dropped,
            arrived_done=self.arrived_done(),
        )

    def arrived_done(self) -> dict[int, int]:
        """Arrivals of each batch from ``trained_through`` on that a restart does not read
        again (all but the buffered ones): trained, or dropped."""
        done = {b: n for b, n in self.arrived.items() if b >= self.trained_through}
        for item in self.queue:
            if item.group.batch in done:
                done[item.group.batch] -= 1
        return {b: n for b, n in done.items() if n > 0}

    def restore(self, state: TrainerState) -> None:
        """Go on from ``state`` (in place: other components hold this buffer), emptied: the
        dedup window (cut to the newest ``dedup_window`` ids if it was larger), the drop
        counters, and the resume offsets as next offsets, so a partition nothing is read
        from keeps its offset in the next checkpoint. What the strategy kept (a replay
        pool) is not in checkpoints: it starts empty."""
        self.queue.clear()
        self.arrived = dict(state.arrived_done)  # the groups read again arrive again
        self.strategy.clear(state.step)
        self.seen = SeenIds(self.dedup_window, state.seen)
        self.next_offsets = state.resume_offsets()
        self.duplicates_dropped = state.duplicates_dropped
        self.stale_dropped = state.stale_dropped
        self.zero_variance_dropped = state.zero_variance_dropped
        self.trained_through = state.trained_through
