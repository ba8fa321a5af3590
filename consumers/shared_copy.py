"""A small record's copy in the store, written off its writer's path.

The trainer's poison record (``consumers/poison.py``) is written before and after every
step: this host's copy at once and durably, by the caller; the copy in the store, which a
trainer on another host reads, here: on a daemon thread (``infra/daemon_call.py``), one
write at a time, the newest record waiting replacing an older one (each holds all there
is to know), through a store client with short timeouts
(:data:`~streamrft.sync.object_store.QUICK_TIMEOUT`). A store that does not answer never
holds the training loop: a write under way is left to finish or fail on its thread, a
failed one is tried again (unless a newer one is waiting), and a stopping trainer leaves
the thread to end with the process.

A caller that needs a record in the store before it goes on (a step's batch in flight,
which a trainer restarted on another host must count) waits for it with
:meth:`SharedCopy.stored`: at most :data:`WAIT_S`, and not at all while the store is slow
(its last write failed, took longer than that, or was waited for in vain) until a write
goes through within it again: a store that does not answer costs one wait, not one a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from streamrft.consumers.poison import RecordPlace, Written
from streamrft.infra.bus import Counters
from streamrft.infra.daemon_call import on_daemon_thread
from streamrft.schemas.errors import StreamRFTError

log = logging.getLogger(__name__)

WAIT_S = 5.0
"""How long :meth:`SharedCopy.stored` waits for a record to reach the store (a trainer
about to start a step whose batch is in flight), while the store keeps up."""
RETRY_S = 5.0
"""Seconds between tries of a write that failed (a newer record goes at once instead)."""
THREAD = "record-copy"
"""The name of the daemon threads the writes run on."""


class SharedCopy:
    """The store copy of the record ``name`` (for log lines and counters: ``<name>_store_failures``
    counts failed writes, ``<name>_late`` the waits in vain), kept in ``place``. Records are
    numbered by their writer, newer ones higher. ``before`` (on the daemon thread, before
    the first write, until it returns without raising): what must be read of the store's
    copy before it is written over (:meth:`~.poison.InFlight.catch_up`); a record it
    returns is written instead of the one waiting."""

    def __init__(
        self,
        place: RecordPlace,
        name: str,
        counters: Counters | None = None,
        before: Callable[[], Written | None] | None = None,
    ) -> None:
        self.place = place
        self._before = before
        self.name = name
        self.counters = counters if counters is not None else Counters()
        self.stored_seq = -1
        """The newest record the store holds (-1: none written here)."""
        self.failed_seq = -1
        """The newest record whose write failed."""
        self.slow = False
        """The store did not keep up: the last write failed or took longer than
        :data:`WAIT_S`, or a wait for one ran out; :meth:`stored` does not wait."""
        self._submitted = -1
        self._waiting: tuple[int, bytes] | None = None
        self._settled = asyncio.Event()
        self._submitted_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def submit(self, seq: int, data: bytes) -> None:
        """Write record ``seq`` (``data``) to the store, after the write under way; it
        replaces a record still waiting. Returns at once."""
        self._waiting, self._submitted = (seq, data), seq
        self._submitted_event.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._work(), name=THREAD)

    async def stored(self, seq: int) -> bool:
        """Whether the store holds record ``seq`` (or a newer one): waited for up to
        :data:`WAIT_S` while the store keeps up, else only looked at."""
        if self.stored_seq >= seq:
            return True
        if not self.slow:
            try:
                await asyncio.wait_for(self._settle(seq), WAIT_S)
            except TimeoutError:
                self._said_slow(f"no answer within {WAIT_S:.0f}s")
        if self.stored_seq >= seq:
            return True
        self.counters.add(f"{self.name}_late")
        return False

    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the newest record submitted to be written (or its
        write to fail), then stop writing: a write under way is left to its daemon thread,
        which ends with the process. Whether the store holds the newest record."""
        try:
            await asyncio.wait_for(self._settle(self._submitted), timeout)
        except TimeoutError:
            pass
        finally:
            self.close()
        if self.stored_seq < self._submitted:
            log.warning(
                "trainer: stopping with the last %s not in %s (written on this host only)",
                self._what,
                self.place.where,
            )
            return False
        return True

    def close(self) -> None:
        """Stop writing (a write under way ends alone)."""
        if self._task is not None:
            self._task.cancel()

    async def _settle(self, seq: int) -> None:
        """Until the write of ``seq`` (or of a newer record) went through or failed."""
        while self.stored_seq < seq and self.failed_seq < seq:
            self._settled.clear()
            await self._settled.wait()

    async def _work(self) -> None:
        while self._waiting is not None:
            seq, data = self._waiting
            self._waiting = None
            started = time.monotonic()
            try:
                if self._before is not None:
                    first = await on_daemon_thread(self._before, name=THREAD)
                    self._before = None
                    if first is not None and first.seq > seq:
                        seq, data = first
                        self._submitted = max(self._submitted, seq)
                await on_daemon_thread(self.place.write, data, name=THREAD)
            except (StreamRFTError, OSError) as exc:
                self.counters.add(f"{self.name}_store_failures")
                self.failed_seq = max(self.failed_seq, seq)
                self._said_slow(str(exc))
                self._settled.set()
                if self._waiting is None:  # tried again, or a newer one as it comes
                    self._waiting = (seq, data)
                    self._submitted_event.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._submitted_event.wait(), RETRY_S)
                continue
            self.stored_seq = max(self.stored_seq, seq)
            took = time.monotonic() - started
            if self.slow and took <= WAIT_S:
                self.slow = False
                log.info("trainer: the %s is written to %s again", self._what, self.place.where)
            self._settled.set()

    @property
    def _what(self) -> str:
        return self.name.replace("_", " ")

    def _said_slow(self, why: str) -> None:
        if self.slow:
            return
        self.slow = True
        log.warning(
            "trainer: the %s is not written to %s (%s); training goes on, this host's copy "
            "holds it: a trainer restarted on another host misses what is counted until "
            "a write goes through",
            self._what,
            self.place.where,
            why,
        )
