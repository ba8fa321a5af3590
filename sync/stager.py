"""The explorer's in-flight receive: the version it will need next, received and verified
into its staging copy (:mod:`.staging`) in the background, while it samples with the
weights it holds.

The :class:`~.follower.WeightFollower` gives a :class:`Stager` what it needs to know of
versions (:class:`StagerHooks`): which version to stage now (the newest usable one newer
than the one held), how to receive one into a stage (everything fetched and verified
before it returns: a delta rebuilt and checked by its ``state_sha256``, an adapter's base
beside it, a broadcast received in place), whether a staged copy serves a version chosen
at a sync point, and what to do when a receive fails in the background (the follower's one
failure policy, ``on_failure``: a rejection is recorded as at a sync point).

One receive at a time, in a thread. At a sync point the follower takes the version it chose
(:meth:`Stager.taken`):

- staged already: it is handed over at once, and only the apply is left;
- being received: the sync point waits for what is left of it;
- another version in flight or staged (an older one the batch needs, a newer one than the
  one staged), or another announcement of it (a broadcast whose store copy was chosen):
  the receive under way ends first (a broadcast cannot stop halfway, and a thread cannot be
  interrupted), then the chosen version is received now, replacing it, unless what that
  receive staged serves it (its failure goes to the background policy).

The stager never applies anything: the follower applies what :meth:`Stager.taken` hands it
at the sync point, and nothing is staged meanwhile, so the memory holds one version at a
time (with its base, for an adapter that needs one). A newer version wanted in the
background supersedes a staged one not yet applied (counter ``versions_superseded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from streamrft.infra.bus import ControlView, Counters
from streamrft.schemas.errors import ServiceError, SyncError, SyncTimeout
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.staging import Stage, StagingArea

log = logging.getLogger(__name__)
_T = TypeVar("_T")

RETRY_AFTER_S = 5.0
"""After a background receive that failed and may work later (the store was down), the
stager leaves that version alone this long (a sync point that chooses it tries at once)."""
IDLE_CHECK_S = 60.0
"""Longest idle wait between two looks at the versions (every control event wakes it)."""


async def to_its_end(work: Callable[..., _T], *args: object) -> _T:
    """``work(*args)`` on a thread, awaited to its end even when the caller is cancelled
    meanwhile (a thread cannot be stopped: the staging copy it reads or writes is not
    released, and no other version is received or applied, until it returns); the
    cancellation is raised then."""
    future = asyncio.ensure_future(asyncio.to_thread(work, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({future})
        raise


@dataclass
class Staged:
    """A version received and verified, ready to be applied."""

    event: ModelVersionReady
    tensors: dict[str, torch.Tensor]
    base_event: ModelVersionReady | None = None
    """The full version an adapter applies on, received with it (None: not needed)."""
    base: dict[str, torch.Tensor] | None = None
    stage: Stage | None = None
    """The memory it is in (None: the receiver's own, ``staging: none``)."""

    def release(self, keep: bool = False) -> None:
        """Its memory is free for another version (see :meth:`.staging.Stage.release`)."""
        if self.stage is not None:
            self.stage.release(keep)


@dataclass(frozen=True)
class StagerHooks:
    """What the stager asks the follower."""

    wanted: Callable[[], ModelVersionReady | None]
    """The version to stage now (None: none newer than the one held)."""
    receive: Callable[[ModelVersionReady, Stage], Staged]
    """Receive and verify a version into a stage (blocking: run in a thread). Raises
    :class:`SyncError` (or :class:`ServiceError`: the process cannot go on)."""
    serves: Callable[[Staged, ModelVersionReady | None], bool]
    """Whether a staged copy may be applied as this version (its latest announcement;
    None: no longer announced) now."""
    failed: Callable[[ModelVersionReady, SyncError], Awaitable[None]]
    """A background receive failed: the follower's failure policy."""
    held: Callable[[], int]
    """The version the model holds."""


@dataclass
class _Job:
    """One receive in a thread."""

    event: ModelVersionReady
    task: asyncio.Task[None] | None = None
    claimed: bool = False
    """A sync point waits for it: its result (or error) is the sync point's."""
    closed: bool = False
    """:meth:`Stager.close` cut it off: its thread runs to its end, its result is dropped."""
    staged: Staged | None = None
    error: BaseException | None = None


class Stager:
    """Stages the version an explorer will need next (see the module)."""

    def __init__(
        self,
        area: StagingArea,
        hooks: StagerHooks,
        view: ControlView,
        stop: asyncio.Event,
        counters: Counters,
        name: str,
    ) -> None:
        self.area = area
        self.hooks = hooks
        self.view = view
        self.stop = stop
        self.counters = counters
        self.name = name
        self._staged: Staged | None = None
        self._job: _Job | None = None
        self._applying = False
        """A sync point takes a version: the background starts no receive."""
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._failures: list[tuple[ModelVersionReady, SyncError]] = []
        self._retry_at: dict[tuple[int, str], float] = {}
        self.receive_s = 0.0
        """Seconds spent receiving since :meth:`take_receive_s` last took them."""

    # -- the background loop -----------------------------------------------------------------
    def start(self) -> None:
        """Start staging in the background (on the running event loop); once."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"{self.name}-stager")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def receiving(self) -> tuple[int, bool] | None:
        """The version being received now and whether a sync point waits for it (None:
        no receive under way)."""
        job = self._current()
        return None if job is None else (job.event.version, job.claimed)

    def _current(self) -> _Job | None:
        """The receive under way (one :meth:`close` cancelled before it began is none)."""
        job = self._job
        if job is not None and job.task is not None and job.task.done():
            self._job = job = None
        return job

    @property
    def staged_version(self) -> int | None:
        """The version staged and not yet applied (None: none)."""
        return None if self._staged is None else self._staged.event.version

    async def _run(self) -> None:
        try:
            while self._error is None and (event := await self._next()) is not None:
                job = self._start(event)
                assert job.task is not None
                await asyncio.shield(job.task)
        except asyncio.CancelledError:
            raise
        except (ServiceError, SyncTimeout) as exc:  # the control reader is gone: the
            self._error = exc  # sync point meets it too; the stager stops
        except Exception as exc:  # a bug: the next sync point fails the process with it
            log.exception("%s: the stager failed", self.name)
            self._error = ServiceError(f"{self.name}: the background receive failed: {exc!r}")
            self._error.__cause__ = exc  # never taken for a bad version

    async def _next(self) -> ModelVersionReady | None:
        """The next version to stage, once there is one; None: stop."""
        while True:
            await self._handle_failures()
            self._drop_stale()
            event = self._due()
            if event is not None:
                return event
            try:
                ready = await self.view.wait_until(
                    lambda: bool(self._failures) or self._due() is not None,
                    IDLE_CHECK_S,
                    self.stop,
                    "nothing to stage",
                )
            except SyncTimeout:
                continue
            if not ready:
                return None

    def _due(self) -> ModelVersionReady | None:
        """The version to receive now: wanted, not staged, not in flight, not failed lately."""
        if self._current() is not None or self._applying:
            return None
        event = self.hooks.wanted()
        if event is None or (self._staged is not None and self._staged.event == event):
            return None
        if self._staged is not None and self.hooks.serves(self._staged, event):
            return None  # staged through another announcement of the same version
        if time.monotonic() < self._retry_at.get((event.version, event.uri), 0.0):
            return None
        return event

    def _drop_stale(self) -> None:
        """A staged version the model has passed, or that can no longer be applied (retired,
        rejected), gives its memory back."""
        staged = self._staged
        if staged is None:
            return
        v = staged.event.version
        if v <= self.hooks.held() or not self.hooks.serves(staged, self.view.versions.get(v)):
            self._staged = None
            staged.release()

    async def _handle_failures(self) -> None:
        """Background failures go through the follower's policy (in the order they came)."""
        while self._failures:
            event, exc = self._failures.pop(0)
            self._pause(event)
            await self.hooks.failed(event, exc)

    def _pause(self, event: ModelVersionReady) -> None:
        """Leave ``event`` alone in the background for :data:`RETRY_AFTER_S` (it failed and
        may load later); the pauses of versions never received again (retired, or no newer
        than the one held) and those over are forgotten, so they do not pile up (one per
        failed announcement) for the run's life."""
        now, held, versions = time.monotonic(), self.hooks.held(), self.view.versions
        self._retry_at = {
            key: at
            for key, at in self._retry_at.items()
            if at > now and key[0] > held and key[0] in versions
        }
        self._retry_at[(event.version, event.uri)] = now + RETRY_AFTER_S

    # -- one receive -------------------------------------------------------------------------
    def _start(self, event: ModelVersionReady) -> _Job:
        """Receive ``event`` in a thread, into the stage of the version slot (a staged
        version not yet applied gives it up: superseded)."""
        assert self._current() is None
        if self._staged is not None:
            dropped, self._staged = self._staged, None
            dropped.release()
            self.counters.add("versions_superseded")
            log.info(
                "%s: staged version %d superseded by version %d before it was applied",
                self.name,
                dropped.event.version,
                event.version,
            )
        job = self._job = _Job(event)
        job.task = asyncio.create_task(self._receive(job))
        return job

    async def _receive(self, job: _Job) -> None:
        t0 = time.perf_counter()
        stage = self.area.stage()  # lent once the receive begins (close() may come first)
        try:
            staged = await to_its_end(self.hooks.receive, job.event, stage)
        except asyncio.CancelledError:  # close(): the thread has ended (it wrote into the
            stage.release()  # stage until then): what it received is dropped
            raise
        except Exception as exc:  # kept for whoever waits, and raised there (see _settle)
            stage.release()
            job.error = exc
        else:
            staged.stage = stage
            job.staged = staged
        finally:
            if self._job is job:
                self._job = None
        seconds = time.perf_counter() - t0
        self.receive_s += seconds
        self.counters.add("receive_seconds", seconds)
        self.counters.add("sync_seconds", seconds)
        if job.staged is not None:
            self.counters.add("versions_staged")
        if not job.claimed:
            self._settle(job)

    def _settle(self, job: _Job) -> None:
        """A receive nobody waits for: its version is staged, or its failure goes to the
        background policy."""
        if job.staged is not None:
            self._staged = job.staged
        elif isinstance(job.error, SyncError):
            self._failures.append((job.event, job.error))
        elif job.error is not None:  # the process cannot go on: the next take raises it
            self._error = job.error

    # -- the sync point ----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def taken(self, event: ModelVersionReady) -> AsyncIterator[Staged]:
        """Version ``event`` (chosen at a sync point) received and verified, for the caller
        to apply inside the block; nothing else is received until the block ends, and the
        staged memory is released at its end unless the caller released it (with ``keep``).
        Raises the receive's error (the caller's failure policy handles it)."""
        self._applying = True  # from here on the background starts nothing
        try:
            staged = await self._take(event)
            try:
                yield staged
            finally:
                staged.release()
        finally:
            self._applying = False

    async def _take(self, event: ModelVersionReady) -> Staged:
        while True:
            if self._error is not None:
                raise self._error
            staged = self._staged
            if staged is not None and self.hooks.serves(staged, event):
                self._staged = None
                return staged
            job = self._current()
            if job is None:
                failed = next((f for f in self._failures if f[0] == event), None)
                if failed is not None:  # it failed in the background a moment ago: the
                    self._failures.remove(failed)  # sync point's policy handles it, once
                    self._pause(event)
                    raise failed[1]
                self.counters.add("sync_point_receives")  # staging did not have it ready
                job = self._start(event)
            assert job.task is not None
            # another version's receive, or another announcement's (its failure is not this
            # one's), or one close() cut off, ends first; what it staged may serve (above)
            if job.event != event or job.claimed or job.closed:
                await asyncio.wait({job.task})
                continue
            job.claimed = True
            try:
                await asyncio.wait({job.task})
            except asyncio.CancelledError:  # the sync point stops: the receive is staged
                job.claimed = False
                if job.task.done():
                    self._settle(job)
                raise
            if job.closed:  # close() cut it off meanwhile: received again (above)
                job.claimed = False
                continue
            if job.error is not None:
                if isinstance(job.error, SyncError):
                    self._pause(event)
                raise job.error
            assert job.staged is not None
            return job.staged

    def take_receive_s(self) -> float:
        """The seconds spent receiving since the last call."""
        seconds, self.receive_s = self.receive_s, 0.0
        return seconds

    def close(self) -> None:
        """Stop the background loop; twice is safe. A receive in its thread cannot be
        stopped: its stage stays lent until the thread ends (nothing else writes into it
        meanwhile), its result is dropped, and a take waits for it first."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        job = self._current()
        if job is not None and job.task is not None:
            job.closed = True
            job.task.cancel()
