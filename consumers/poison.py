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
import threading
import time
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
    """Writes so far, over every trainer of the run (each goes on from the copy it read)."""
    step: int
    """The writing trainer's steps trained (counting the batch of a ``done``)."""
    checkpoint: int
    """The step of the checkpoint the writing trainer resumed from (0: none)."""
    batch: list[str]
    """The batch in flight (empty between steps)."""
    crashes: dict[str, int]
    """Group id -> crashed batches it was in, not trained since."""

    @property
    def order(self) -> tuple[int, int]:
        """Newer copies sort higher: a trainer that resumed from a newer checkpoint wrote
        later (whatever its count of writes), then the count of writes."""
        return self.checkpoint, self.seq

    @classmethod
    def decode(cls, data: bytes) -> _Record:
        """Raises ValueError (also KeyError, TypeError, AttributeError) on a bad record."""
        raw = json.loads(data)
        return cls(
            int(raw["seq"]),
            int(raw.get("step", 0)),
            int(raw.get("checkpoint", 0)),
            [str(i) for i in raw["batch"]],
            {str(k): int(v) for k, v in raw["crashes"].items()},
        )


BAD_RECORD = (ValueError, KeyError, TypeError, AttributeError)
"""What decoding a damaged record raises."""
READ_TRIES = 3
"""Tries of reading the store's copy at start before the trainer goes on without it."""
READ_RETRY_S = 2.0


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
    on another host then misses what was counted meanwhile).

    Which copy a starting trainer goes on from: each record carries its count of writes
    over the run, the trainer's step and the checkpoint that trainer resumed from. A copy
    written before the checkpoint this trainer resumes from (its step lower: the run went
    further since, elsewhere) is ignored, however many writes it counts; of the others
    the newest wins (:attr:`_Record.order`). A store copy that cannot be read at start
    (after :data:`READ_TRIES`) is said, and never written over until it is read
    (:meth:`catch_up`, before the first write of the store's copy): then, if it is the
    newer, its counts are merged in (per group the larger, but for groups trained here
    since) and its batch in flight counted."""

    def __init__(self, local: Path, max_crashes: int, shared: RecordPlace | None = None) -> None:
        self.local = LocalRecord(local)
        self.shared = shared
        self.max_crashes = max_crashes
        self.poisoned: set[str] = set()
        """Group ids to dead-letter as they are read again: in ``max_crashes`` crashed
        batches (grows in place when a late read of the store's copy adds some)."""
        self.crashes: dict[str, int] = {}
        """Group id -> crashed batches it was in (not trained since)."""
        self.last: Written | None = None
        """The newest record written (to this host's copy)."""
        self.shared_unread = False
        """The store's copy could not be read at start: it is not to be written over
        before :meth:`catch_up` has read it."""
        self._seq = 0
        self._step = 0
        self._batch: list[str] = []
        """The step and batch of the last write."""
        self._checkpoint = 0
        self._from: tuple[int, int] = (-1, -1)
        """The order of the copy this trainer went on from (none: below any)."""
        self._trained: set[str] = set()
        """Groups trained here since start, while the store's copy is unread."""
        self._lock = threading.Lock()

    def recover(self, checkpoint: int = 0) -> set[str]:
        """At start, resuming from the checkpoint of step ``checkpoint`` (0: none): a batch
        found in flight counts a crash for each of its groups; the ids counted
        ``max_crashes`` times (0: never) are returned (and kept in :attr:`poisoned`)."""
        with self._lock:
            self._checkpoint = checkpoint
            copies = [(self.local.where, self._read(self.local))]
            if self.shared is not None:
                copies.append((self.shared.where, self._read_shared()))
            self._seq = max((r.seq for _, r in copies if r is not None), default=0)
            found = self._newest(copies)
            if found is None:
                return self.poisoned
            self._from = found.order
            self.crashes = found.crashes
            self._count(found.batch, "the last trainer died training")
            self._write([], checkpoint)  # the batch found is counted once, whatever follows
            return self.poisoned

    def begin(self, ids: list[str], step: int = 0) -> Written:
        """Before a step (``step`` steps trained): its groups are in flight."""
        with self._lock:
            return self._write(list(ids), step)

    def done(self, ids: list[str], step: int = 0) -> Written:
        """After a step (trained, or its groups set aside; ``step`` steps trained now):
        nothing in flight, and those groups' counts cleared."""
        with self._lock:
            for gid in ids:
                self.crashes.pop(gid, None)
            if self.shared_unread:
                self._trained.update(ids)
            return self._write([], step)

    def catch_up(self) -> Written | None:
        """Read the store's copy that could not be read at start (raises while it still
        cannot be: StreamRFTError, OSError); if it is newer than the copy this trainer went
        on from, merge it in and return the record written then. None: nothing to do."""
        if not self.shared_unread or self.shared is None:
            return None
        data = self.shared.read()
        with self._lock:
            self.shared_unread = False
            trained, self._trained = self._trained, set()
            try:
                found = _Record.decode(data) if data is not None else None
            except BAD_RECORD as exc:
                log.warning("trainer: bad poison record %s (%s): ignored", self.shared.where, exc)
                found = None
            if (
                found is not None
                and self._fresh(self.shared.where, found)
                and found.order > self._from
            ):
                return self._merge(found, trained)
            log.info(
                "trainer: the poison record in %s is read now; this trainer's is the newer",
                self.shared.where,
            )
            return None

    def _merge(self, found: _Record, trained: set[str]) -> Written:
        counted = dict(found.crashes)
        for gid in found.batch:
            counted[gid] = counted.get(gid, 0) + 1
        for gid, n in counted.items():
            if gid not in trained:  # a group trained here since is cleared
                self.crashes[gid] = max(self.crashes.get(gid, 0), n)
        self._seq = max(self._seq, found.seq)
        self._from = found.order
        assert self.shared is not None
        log.warning(
            "trainer: the poison record in %s, read now, is newer than the one this trainer "
            "started from: its counts are taken (%d group(s)%s)",
            self.shared.where,
            len(counted),
            f", a crash for each of the {len(found.batch)} of its batch in flight"
            if found.batch
            else "",
        )
        self._note_poisoned()
        return self._write(self._batch, self._step)

    def _count(self, batch: list[str], who: str) -> None:
        for gid in batch:
            self.crashes[gid] = self.crashes.get(gid, 0) + 1
        if batch:
            worst = max(self.crashes[g] for g in batch)
            log.warning(
                "trainer: %s a batch of %d groups; a crash counted for each (the most for "
                "one group: %d of trainer.max_step_crashes %d)",
                who,
                len(batch),
                worst,
                self.max_crashes,
            )
        self._note_poisoned()

    def _note_poisoned(self) -> None:
        if not self.max_crashes:
            return
        new = {g for g, n in self.crashes.items() if n >= self.max_crashes} - self.poisoned
        if not new:
            return
        self.poisoned |= new  # in place: the intake holds this set
        log.error(
            "trainer: %d group(s) were in %d or more batches trainers died training; "
            "they are set aside (dead-lettered) as they are read again: %s",
            len(new),
            self.max_crashes,
            ", ".join(sorted(new)[:10]),
        )

    def _write(self, batch: list[str], step: int) -> Written:
        while len(self.crashes) > MAX_RECORDED:
            del self.crashes[next(iter(self.crashes))]
        self._seq, self._step, self._batch = self._seq + 1, step, batch
        record = {
            "seq": self._seq,
            "step": step,
            "checkpoint": self._checkpoint,
            "batch": batch,
            "crashes": self.crashes,
        }
        data = json.dumps(record).encode()
        self.local.write(data)
        self.last = Written(self._seq, data)
        return self.last

    def _read(self, place: RecordPlace) -> _Record | None:
        """``place``'s copy; None when there is none or it is damaged (said)."""
        try:
            data = place.read()
            return _Record.decode(data) if data is not None else None
        except (StreamRFTError, OSError, *BAD_RECORD) as exc:
            log.warning("trainer: unreadable poison record %s (%s): ignored", place.where, exc)
            return None

    def _read_shared(self) -> _Record | None:
        """The store's copy, tried :data:`READ_TRIES` times; one that cannot be read is
        said and marked :attr:`shared_unread` (a damaged one is ignored: written over)."""
        assert self.shared is not None
        for attempt in range(1, READ_TRIES + 1):
            try:
                data = self.shared.read()
            except (StreamRFTError, OSError) as exc:
                if attempt < READ_TRIES:
                    time.sleep(READ_RETRY_S)
                    continue
                log.error(
                    "trainer: the poison record in %s cannot be read (%s, %d tries): the "
                    "crashes counted there are unknown to this trainer until it can read it, "
                    "and it is not written over before",
                    self.shared.where,
                    exc,
                    READ_TRIES,
                )
                self.shared_unread = True
                return None
            try:
                return _Record.decode(data) if data is not None else None
            except BAD_RECORD as exc:
                log.warning("trainer: bad poison record %s (%s): ignored", self.shared.where, exc)
                return None
        return None

    def _fresh(self, where: str, record: _Record) -> bool:
        """Whether ``record`` is not older than the checkpoint resumed from (said if not)."""
        if record.step >= self._checkpoint:
            return True
        log.warning(
            "trainer: the poison record in %s was written at step %d, before the checkpoint "
            "of step %d this trainer resumes from: ignored (the run went on since)",
            where,
            record.step,
            self._checkpoint,
        )
        return False

    def _newest(self, copies: list[tuple[str, _Record | None]]) -> _Record | None:
        """Of the copies read, the newest not older than the checkpoint resumed from;
        ties go to the first (this host's)."""
        fresh = [r for where, r in copies if r is not None and self._fresh(where, r)]
        return max(fresh, key=lambda r: r.order, default=None)
