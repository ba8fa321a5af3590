"""Groups the trainer cannot train are set aside with a reason, never retried for ever.

Three guards, from the cheapest:

1. :class:`GroupLimits` (pure): at intake, a group past what this trainer can hold is
   dead-lettered before it is buffered: more rows than ``trainer.max_group_rows``, or an
   experience longer than the model's context (``max_position_embeddings``) or than the
   token budget of one micro-batch (``trainer.max_tokens_per_micro_batch``).
2. :func:`step_failure` (pure): a step that raised an error a batch can cause (out of
   memory, an index past the model's positions) is retried once a row at a time, then
   its groups are dead-lettered (the trainer's loop does it).
3. :class:`InFlight`: what cannot be caught in the process (the kernel's OOM kill, a
   CUDA device assert) is caught across restarts: the group ids of the batch in flight
   are written before each step and removed after it. A trainer that starts and finds
   the same batch there ``trainer.max_step_crashes`` times dead-letters those groups as
   they are read again, instead of dying on them once more.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from streamrft.infra.durable import replace_durably
from streamrft.schemas.errors import SchemaError
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


class InFlight:
    """The batch a trainer is training, on disk while it trains (``<run dir>/trainer/
    inflight.json``: the group ids and how many trainers started it)."""

    def __init__(self, path: Path, max_crashes: int) -> None:
        self.path = path
        self.max_crashes = max_crashes
        self.poisoned: set[str] = set()
        """Group ids to dead-letter as they are read again: the batch trainers died on."""
        self.crashes = 0
        """Trainers that died on the batch found at start (0: none was in flight)."""
        self._suspect: tuple[set[str], int] | None = None
        """The batch found in flight at start, and how many trainers died on it."""
        self._current: set[str] = set()

    def recover(self) -> set[str]:
        """At start: the ids of the batch the last trainers died on ``max_crashes`` times
        (empty when none, or fewer times: that batch is tried again, and counted if it
        kills this trainer too, even after other batches were trained before it)."""
        found = self._read()
        self.done()
        if found is None:
            return set()
        ids, self.crashes = found
        if self.max_crashes and self.crashes >= self.max_crashes:
            log.error(
                "trainer: %d trainer(s) died training the same batch of %d groups; they "
                "are set aside (dead-lettered) as they are read again",
                self.crashes,
                len(ids),
            )
            self.poisoned = set(ids)
        else:
            log.warning(
                "trainer: the last trainer died training a batch (%d time(s)); trying it again",
                self.crashes,
            )
            self._suspect = (set(ids), self.crashes)
        return self.poisoned

    def begin(self, ids: list[str]) -> None:
        """Before a step: its groups, and how many trainers have now started them."""
        attempts = 1
        if self._suspect is not None and self._suspect[0] == set(ids):
            attempts = self._suspect[1] + 1
        replace_durably(self.path, json.dumps({"groups": ids, "attempts": attempts}).encode())
        self._current = set(ids)

    def done(self) -> None:
        """After a step (trained, or its groups set aside)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._suspect is not None and self._current == self._suspect[0]:
            self._suspect = None  # it trained this time

    def _read(self) -> tuple[list[str], int] | None:
        try:
            data = json.loads(self.path.read_text())
            return [str(i) for i in data["groups"]], int(data["attempts"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("trainer: unreadable %s (%s): ignored", self.path, exc)
            return None
