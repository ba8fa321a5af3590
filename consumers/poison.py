"""Groups the trainer cannot train are set aside with a reason, never retried for ever.

Three guards, from the cheapest:

1. :class:`GroupLimits` (pure): at intake, a group past what this trainer can hold is
   dead-lettered before it is buffered: more rows than ``trainer.max_group_rows``, or an
   experience longer than the model's context (``max_position_embeddings``) or than the
   token budget of one micro-batch (``trainer.max_tokens_per_micro_batch``).
2. :func:`step_failure` (pure): a step that raised an error a batch can cause (out of
   memory, an index past the model's positions) is retried once a row at a time, then
   its groups are dead-lettered (the trainer's loop does it). The train engine leaves
   the model and optimizer as they were before a failed step (``step_undo.py``), so the
   retry trains the batch once and a batch set aside was never learned from.
3. :class:`InFlight`: what cannot be caught in the process (the kernel's OOM kill, a
   CUDA device assert) is caught across restarts, per group: the ids of the batch in
   flight are written before each step, with how many crashed batches each group was
   in; a trainer that starts and finds a batch in flight counts a crash for each of its
   groups, and dead-letters every group counted ``trainer.max_step_crashes`` times as it
   is read again, whatever groups it came with (the ``available`` strategy, replays and
   serve traffic make other batches of it after a restart). A group trained since is
   cleared. The record lives with the checkpoints: ``<run dir>/checkpoints/poison.json``,
   and beside the checkpoints in the store when they go there (a trainer restarted on
   another host reads it), that copy written off the training loop
   (:mod:`.shared_copy`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from streamrft.infra.durable import replace_durably
from streamrft.schemas.errors import SchemaError, StreamRFTError
from streamrft.schemas.experience import ExperienceGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupLimits:
    """The largest group this trainer takes (0: no bound of that kind)."""

    max_rows: int
    """Experiences per group (``trainer.max_group_rows``)."""
    max_tokens: int = 0
    """Tokens (prompt + response) of one experience: the model's context length."""
    micro_budget: int = 0
    """Tokens one micro-batch holds (``trainer.max_tokens_per_micro_batch``): one
    experience longer than it cannot be trained within it."""

    def check(self, group: ExperienceGroup) -> None:
        """Raise :class:`SchemaError` (the dead letter's reason) if ``group`` is past a limit."""
        rows = len(group.experiences)
        if self.max_rows and rows > self.max_rows:
            raise SchemaError(
                f"group {group.id}: {rows} experiences, more than trainer.max_group_rows "
                f"({self.max_rows})"
            )
        longest = max((e.num_tokens for e in group.experiences), default=0)
        if self.max_tokens and longest > self.max_tokens:
            raise SchemaError(
                f"group {group.id}: an experience of {longest} tokens, longer than the "
                f"model's context ({self.max_tokens} positions)"
            )
        if self.micro_budget and longest > self.micro_budget:
            raise SchemaError(
                f"group {group.id}: an experience of {longest} tokens, more than one "
                f"micro-batch holds (trainer.max_tokens_per_micro_batch: {self.micro_budget})"
            )


STEP_ERRORS = (MemoryError, RuntimeError, IndexError, ValueError)
"""What a batch can make a step raise (torch's out-of-memory errors are RuntimeErrors)."""


def step_failure(exc: BaseException) -> bool:
    """Whether ``exc`` from a training step may be the batch's doing (then the batch is
    retried smaller, or set aside), rather than the process's."""
    return isinstance(exc, STEP_ERRORS)


RECORD = "poison.json"
"""The poison record's name, in the checkpoints folder and beside the checkpoints in the store."""
MAX_RECORDED = 10_000
"""Groups the record counts at most (the oldest go first): crashed batches' groups that
were never trained again (read past, or dropped as stale) would otherwise pile up."""


class RecordPlace(Protocol):
    """Where a copy of the record is kept (this host's disk, the store)."""

    where: str
    """For log lines."""

    def read(self) -> bytes | None:
        """The record, or None when there is none; raises when it cannot be read."""
        ...

    def write(self, data: bytes) -> None:
        """Replace the record, atomically."""
        ...


class LocalRecord:
    """The record in a file of this host, replaced durably."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    def read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def write(self, data: bytes) -> None:
        replace_durably(self.path, data)


@dataclass
class _Record:
    seq: int
    """Writes so far, over every trainer of the run: the newest copy has the most."""
    batch: list[str]
    """The batch in flight (empty between steps)."""
    crashes: dict[str, int]
    """Group id -> crashed batches it was in, not trained since."""


class Written(NamedTuple):
    """A record as written to this host's copy, for the store's (:mod:`.shared_copy`)."""

    seq: int
    data: bytes


class InFlight:
    """The poison record: the batch a trainer is training, and per group id the crashed
    batches it was in (module docstring, guard 3). ``local``: this host's copy, written
    (durably) by every call; ``shared``: the copy other hosts read (the store), read at
    start: the caller writes it, each record :attr:`last` written, off the training loop
    (:class:`~.shared_copy.SharedCopy`: a store outage does not stop training; a trainer
    on another host then misses what was counted meanwhile)."""

    def __init__(self, local: Path, max_crashes: int, shared: RecordPlace | None = None) -> None:
        self.places: list[RecordPlace] = [LocalRecord(local), *([shared] if shared else [])]
        self.max_crashes = max_crashes
        self.poisoned: set[str] = set()
        """Group ids to dead-letter as they are read again: in ``max_crashes`` crashed
        batches."""
        self.crashes: dict[str, int] = {}
        """Group id -> crashed batches it was in (not trained since)."""
        self.last: Written | None = None
        """The newest record written (to this host's copy)."""
        self._seq = 0

    def recover(self) -> set[str]:
        """At start: a batch found in flight counts a crash for each of its groups; the
        ids counted ``max_crashes`` times (0: never) are returned (and kept in
        :attr:`poisoned`)."""
        found = self._read()
        if found is None:
            return set()
        self._seq, self.crashes = found.seq, found.crashes
        for gid in found.batch:
            self.crashes[gid] = self.crashes.get(gid, 0) + 1
        if self.max_crashes:
            self.poisoned = {g for g, n in self.crashes.items() if n >= self.max_crashes}
        if found.batch:
            worst = max(self.crashes[g] for g in found.batch)
            log.warning(
                "trainer: the last trainer died training a batch of %d groups; a crash "
                "counted for each (the most for one group: %d of trainer.max_step_crashes %d)",
                len(found.batch),
                worst,
                self.max_crashes,
            )
        if self.poisoned:
            log.error(
                "trainer: %d group(s) were in %d or more batches trainers died training; "
                "they are set aside (dead-lettered) as they are read again: %s",
                len(self.poisoned),
                self.max_crashes,
                ", ".join(sorted(self.poisoned)[:10]),
            )
        self._write([])  # the batch found is counted once, whatever happens next
        return self.poisoned

    def begin(self, ids: list[str]) -> Written:
        """Before a step: its groups are in flight."""
        return self._write(list(ids))

    def done(self, ids: list[str]) -> Written:
        """After a step (trained, or its groups set aside): nothing in flight, and those
        groups' counts cleared."""
        for gid in ids:
            self.crashes.pop(gid, None)
        return self._write([])

    def _write(self, batch: list[str]) -> Written:
        while len(self.crashes) > MAX_RECORDED:
            del self.crashes[next(iter(self.crashes))]
        self._seq += 1
        data = json.dumps({"seq": self._seq, "batch": batch, "crashes": self.crashes}).encode()
        self.places[0].write(data)
        self.last = Written(self._seq, data)
        return self.last

    def _read(self) -> _Record | None:
        """The newest readable copy (the most writes), None when there is none."""
        found = []
        for place in self.places:
            try:
                data = place.read()
                if data is None:
                    continue
                raw = json.loads(data)
                found.append(
                    _Record(
                        int(raw["seq"]),
                        [str(i) for i in raw["batch"]],
                        {str(k): int(v) for k, v in raw["crashes"].items()},
                    )
                )
            except (
                StreamRFTError,
                OSError,
                ValueError,
                KeyError,
                TypeError,
                AttributeError,
            ) as exc:
                log.warning("trainer: unreadable poison record %s (%s): ignored", place.where, exc)
        return max(found, key=lambda r: r.seq, default=None)
