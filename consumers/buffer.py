"""What the trainer holds between consuming and training. Pure logic, no I/O.

- Deduplicates by experience id (at-least-once delivery upstream).
- Drops groups more than ``max_staleness`` versions behind, counted.
- Tracks, per partition, the offset from which a restart must read again: the lowest
  offset still buffered (not trained), or the next offset when nothing is buffered.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from streamrft.schemas.experience import ExperienceGroup

PartitionKey = tuple[str, int]


@dataclass
class Buffered:
    group: ExperienceGroup
    partition: PartitionKey
    offset: int


@dataclass
class ExperienceBuffer:
    max_staleness: int
    seen: set[str] = field(default_factory=set)
    queue: deque[Buffered] = field(default_factory=deque)
    next_offsets: dict[PartitionKey, int] = field(default_factory=dict)
    duplicates_dropped: int = 0
    stale_dropped: int = 0

    def offer(self, group: ExperienceGroup, partition: PartitionKey, offset: int) -> bool:
        """Take a consumed group; False when it was a duplicate (already seen)."""
        self.next_offsets[partition] = max(self.next_offsets.get(partition, 0), offset + 1)
        ids = [e.id for e in group.experiences]
        if any(i in self.seen for i in ids):
            self.duplicates_dropped += 1
            return False
        self.seen.update(ids)
        self.queue.append(Buffered(group, partition, offset))
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

    def take(self, n: int) -> list[ExperienceGroup] | None:
        """The oldest ``n`` buffered groups, or None when fewer are buffered."""
        if len(self.queue) < n:
            return None
        return [self.queue.popleft().group for _ in range(n)]

    def __len__(self) -> int:
        return len(self.queue)

    def resume_offsets(self) -> dict[PartitionKey, int]:
        """Per partition, where a restarted trainer must resume reading."""
        offsets = dict(self.next_offsets)
        for item in self.queue:
            offsets[item.partition] = min(offsets[item.partition], item.offset)
        return offsets
