"""The explorer's side of the sync protocol: which version to sample with, and getting it.

At every sync point (the explorer has taken tasks of one batch and is about to sample
them) :meth:`WeightFollower.sync_point` does, in order:

1. **plan** — the sync style says what this batch needs (:func:`~.styles.explorer_sync`,
   a pure function of the style, the batch, the explorer's step and the version held): ask
   the trainer for a version (``dynamic_by_explorer``, or an explorer too far ahead), wait
   for one, apply one, or nothing;
2. **wait** — until a usable version the plan needs is announced (WAITING_SYNC: the
   explorer is ahead of the trainer; this is the backpressure). Two things end a wait
   early: the explorer's tasks partitions moved (:attr:`Synced.RETAKE`: it may now hold
   tasks of an earlier batch, which the version waited for needs), and a trainer that
   says it starves for experiences while no other explorer is exploring (the version
   cannot come until someone explores on: the explorer samples with the newest version
   it has, counter ``sync_waits_cut``);
3. **choose** — the version to apply (:func:`~.styles.choose_version`; a newer broadcast
   this explorer is a member of always wins: its group waits for every member);
4. **apply** — copy it in (:mod:`.payload` knows adapters and bases) from its staging
   copy: the :class:`~.stager.Stager` receives the version the explorer will need, through
   the transport its event names and verified, in the background as soon as it is
   announced (``synchronizer.staging``; with ``none``, it is received here, at the sync
   point); the sync point waits only for what is left of that receive, or receives the
   version it chose when it is not the one staged;
5. **on failure** — one policy (:func:`on_failure`), at the sync point and for a receive in
   the background alike: keep the current weights and try at the next sync point (the store
   is down), retry soon (down, and no weights yet), wait for the store fallback (a broadcast
   failed), choose again (the version was retired while it loaded), or reject the version
   for good (it failed verification) and wait for the next one.

Times (:meth:`WeightFollower.take_times`, and counters of the same names in seconds): the
wait for a version to be announced (``version_wait``: backpressure), the sampling held from
the choice of a version until it is applied (``sync_wait``), the copy into the model
(``apply``) and the receives, in the background or not (``receive``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from streamrft.infra.bus import HEARTBEAT_S, ControlView, Counters, EventSender
from streamrft.infra.config import Config
from streamrft.infra.modeling import model_device
from streamrft.schemas.errors import (
    IntegrityError,
    OutOfMemory,
    ServiceError,
    StreamRFTError,
    SyncError,
    VersionGone,
)
from streamrft.schemas.events import ModelVersionReady, Rejection, RunState, SyncRequest
from streamrft.sync.delta import verify_state
from streamrft.sync.payload import ModelWeights
from streamrft.sync.stager import Staged, Stager, StagerHooks, to_its_end
from streamrft.sync.staging import Stage, StagingArea, from_device_kind, staging_memory
from streamrft.sync.styles import ExplorerSync, Schedule, choose_version, explorer_sync
from streamrft.sync.transport import ACCEPTED, COST, Receivers
from streamrft.sync.weights import largest_version, live_tensors, nbytes

log = logging.getLogger(__name__)

REMEMBER_WAIT_S = 10.0
"""How long a starting follower waits to have read its component's last status (the
versions rejected before a restart) before it loads a version anyway."""
REJECTION_TEXT_CHARS = 500
"""A rejection's reason (and method) is cut to this many characters."""
RETRY_SOON_S = 1.0
"""Pause before loading again when the store is down and there are no weights to go on with."""
UNEXPECTED = (StreamRFTError, ValueError, RuntimeError, OSError, MemoryError)
"""What a version can make a decoder or an allocation raise (a manifest of another schema, a
header that lies, a size past memory): that version is refused, the process lives on (the
model is touched only after every check). A staging copy or receive buffer of the size this
model's versions have that memory cannot hold is no refusal: :class:`OutOfMemory`
(retriable, :func:`.staging.allocated`)."""


@dataclass
class SyncTimes:
    """Seconds of one stretch of an explorer's work (see the module: times)."""

    version_wait_s: float = 0.0
    sync_wait_s: float = 0.0
    apply_s: float = 0.0
    receive_s: float = 0.0


class Synced(enum.Enum):
    """How a sync point ended."""

    READY = "sample the batch"
    STOP = "a stop signal or a Shutdown came"
    RETAKE = "the tasks partitions moved while waiting: take tasks again"


class OnFailure(enum.Enum):
    CHOOSE_AGAIN = "the version was retired meanwhile: choose a version again"
    STAY = "keep the current weights; try again at the next sync point"
    RETRY_SOON = "no weights to go on with: try again in a second"
    WAIT_FALLBACK = "wait for the version through the store (or a newer one)"
    REJECT = "never try this version again"


def on_failure(exc: SyncError, refetchable: bool, have_weights: bool) -> OnFailure:
    """What to do after loading a version failed with ``exc``."""
    if isinstance(exc, VersionGone):  # nothing wrong with it: it is no longer there
        return OnFailure.CHOOSE_AGAIN
    if not refetchable:  # a broadcast happens once; the trainer re-announces it by the store
        return OnFailure.WAIT_FALLBACK
    if exc.retriable:  # the store did not answer
        return OnFailure.STAY if have_weights else OnFailure.RETRY_SOON
    return OnFailure.REJECT  # it failed verification: it never will pass


def delta_chain(
    versions: Mapping[int, ModelVersionReady], target: int, held: int
) -> list[ModelVersionReady]:
    """The versions to load, in order, to make version ``target``: when ``target`` is a
    delta, back through the deltas it builds on to ``held`` (the version the explorer holds:
    the first is then a delta on it) or else to a full version (the first is that one).
    :class:`VersionGone` when ``target`` is no longer announced (retired meanwhile: a
    background rebuild outlived it)."""
    if target not in versions:
        raise VersionGone(f"version {target} was retired while it was being loaded")
    chain = [versions[target]]
    while chain[-1].delta_base >= 0 and chain[-1].delta_base != held:
        base = versions.get(chain[-1].delta_base)
        if base is None:
            raise SyncError(
                f"version {chain[-1].version} is a delta on version "
                f"{chain[-1].delta_base}, which was never announced"
            )
        chain.append(base)
    return chain[::-1]


def _rejection(event: ModelVersionReady, reason: str, kind: str) -> Rejection:
    """A :class:`Rejection` of ``event``, its text cut to what a status carries (a reason may
    quote a uri of thousands of characters; a status repeats 64 of them)."""
    cut = REJECTION_TEXT_CHARS
    return Rejection(
        version=event.version,
        method=event.method[:cut],
        manifest_sha256=event.manifest_sha256[:128],
        reason=reason if len(reason) <= cut else f"{reason[:cut]}...",
        kind=kind,
        created_at=time.time(),
    )


class WeightFollower:
    """Keeps one explorer's model on the versions its sync style asks for.

    Gets what it needs at construction: the view of the control topic (versions, the
    trainer's status), the sender (sync requests, WAITING_SYNC), the process's counters and
    its stop event. Reports the version it holds as :attr:`version`.
    """

    def __init__(
        self,
        cfg: Config,
        name: str,
        weights: ModelWeights,
        view: ControlView,
        events: EventSender,
        counters: Counters,
        stop: asyncio.Event,
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.weights = weights
        self.view = view
        self.events = events
        self.counters = counters
        self.stop = stop
        self.receivers = Receivers(cfg, name)
        self.version = -1
        """The version the model holds (-1: none yet)."""
        self._applying = asyncio.Lock()
        self.schedule = Schedule(
            cfg.synchronizer.style,
            cfg.synchronizer.sync_interval,
            cfg.synchronizer.sync_offset,
            cfg.trainer.max_staleness,
        )
        self.rejected: set[tuple[int, str]] = set()
        """(version, manifest sha256) of versions that failed verification here (or in an
        earlier process of this component)."""
        self._remembered = False
        self._refused: set[tuple[int, str, str]] = set()
        """(version, method, manifest sha256) of announcements refused (reported once)."""
        self._unreported = False
        """A refusal is in the status only from the next one sent: by the end of a sync
        point at the latest."""
        self.failed_broadcasts: set[tuple[int, str]] = set()
        """(version, rendezvous) of broadcasts this explorer failed to receive: a broadcast
        happens once, so it is never tried again (its trainer may be gone for good: the
        version then comes by the store, or a newer one does)."""
        self._state = threading.Lock()
        """Held while a version is copied in, and while a delta receive reads the state held."""
        self._times = SyncTimes()
        self.stager = self._make_stager()
        """Receives versions in the background (None: ``synchronizer.staging: none``)."""

    def _make_stager(self) -> Stager | None:
        if not self.cfg.synchronizer.load_versions:  # a benchmark's ideal: nothing moves
            log.warning("%s: synchronizer.load_versions is false: no version is loaded", self.name)
            return None
        device = model_device(self.weights.model)
        size = nbytes(live_tensors(self.weights.model))  # a version, and an adapter's base
        kind = self.cfg.synchronizer.staging
        memory = staging_memory(kind, device, size)
        if memory is None:
            return None
        from_device = memory  # versions read from a device (cuda_ipc): on it where they fit
        if kind != "device" and "cuda_ipc" in ACCEPTED.get(self.cfg.synchronizer.method, ()):
            what = f"{kind}, for a version read from a device"
            from_device = staging_memory(from_device_kind(kind), device, size, what) or memory
        log.info("%s: versions are staged in %s", self.name, memory.describe())
        if from_device != memory:
            log.info("%s: versions read from a device in %s", self.name, from_device.describe())
        hooks = StagerHooks(
            wanted=self._to_stage,
            receive=self._received,
            serves=self._serves,
            failed=self._staging_failed,
            held=lambda: self.version,
        )
        area = StagingArea(memory, from_device)
        return Stager(area, hooks, self.view, self.stop, self.counters, self.name)

    def start_staging(self) -> None:
        """Receive versions in the background from now on (on the event loop; once)."""
        if self.stager is not None:
            self.stager.start()

    def receiving(self) -> int | None:
        """The version being received in the background now (None: none; serve mode waits
        for that receive to end before it holds requests for the swap, which then is only
        the apply)."""
        if self.stager is None or not self.stager.running or self.stager.receiving is None:
            return None
        return self.stager.receiving[0]

    def take_times(self) -> SyncTimes:
        """The times since the last call (an explorer's step reports them)."""
        times, self._times = self._times, SyncTimes()
        if self.stager is not None:
            times.receive_s += self.stager.take_receive_s()
        return times

    # -- what can be loaded ------------------------------------------------------------------
    def usable(self, report: bool = True) -> dict[int, ModelVersionReady]:
        """Announced versions this explorer can load and has not rejected, each by its
        cheapest announcement (:data:`~.transport.COST`: shared memory before a broadcast
        before a store). A broadcast happens once: announced again since (its store
        fallback), it is over. ``report``: a refusal goes into the status (on the event
        loop only: off it, a receive thread asks)."""
        out = {}
        # a copy (made holding the GIL): a receive thread asks while the loop adds versions
        for v, latest in list(self.view.versions.items()):
            options = [
                ev
                for ev in self.view.announcements(v) or [latest]
                if (v, ev.manifest_sha256) not in self.rejected
                and (v, ev.uri) not in self.failed_broadcasts
                and self._allowed(ev, report)
                and self.receivers.can_load(ev)
                and (ev is latest or self.receivers.for_event(ev).refetchable)
            ]
            if options:
                out[v] = min(options, key=lambda ev: COST.get(ev.method, len(COST)))
        return out

    def newest(self) -> int:
        return max(self.usable(), default=-1)

    def _allowed(self, event: ModelVersionReady, report: bool = True) -> bool:
        """False when the run refuses ``event`` (:meth:`~.transport.Receivers.refusal`): the
        first time (``report``), the refusal goes into this component's status with its
        reason."""
        why = self.receivers.refusal(event)
        seen = (event.version, event.method, event.manifest_sha256)
        if why is not None and report and seen not in self._refused:
            self._refused.add(seen)
            self._unreported |= self.events.reject(_rejection(event, why, "refused"))
            self.counters.add("versions_refused")
            log.warning("%s: version %d refused: %s", self.name, event.version, why)
        return why is None

    def _refetchable(self, event: ModelVersionReady) -> bool:
        return self._allowed(event) and self.receivers.for_event(event).refetchable

    def _waiting_broadcast(self, usable: dict[int, ModelVersionReady]) -> int | None:
        """The newest usable version if it is newer than the model's and a broadcast (its
        group waits for every member), else None."""
        newest = max(usable, default=-1)
        if newest > self.version and not self.receivers.for_event(usable[newest]).refetchable:
            return newest
        return None

    def broadcast_pending(self) -> bool:
        """A newer broadcast this explorer is a member of is waiting for it to join (the
        stager, when it runs, joins it in the background: nothing waits)."""
        if self.stager is not None and self.stager.running:
            return False
        return self._waiting_broadcast(self.usable()) is not None

    # -- the sync point ----------------------------------------------------------------------
    async def sync_point(
        self, batch: int | None, step: int, moved: Callable[[], bool] = lambda: False
    ) -> Synced:
        """Ask, wait and apply as the sync style says before explorer step ``step`` samples
        tasks of ``batch`` (None: no tasks; only join a broadcast that waits for this
        explorer). ``moved()``: the tasks partitions moved since the tasks were taken."""
        await self.remember_rejections()
        self.start_staging()
        if batch is None:
            plan = ExplorerSync(apply=False)
        else:
            plan = explorer_sync(self.schedule, batch, step, self.version)
        if plan.request is not None and self.newest() < plan.request:
            await self._request(plan.request)
        need = plan.wait_for
        if need is not None and self.newest() < need:
            await self.events.status(
                RunState.WAITING_SYNC, f"batch {batch} needs version >= {need}"
            )
            log.info("%s: batch %s waits for version >= %d", self.name, batch, need)
            waited = await self._wait(need, f"no usable model version >= {need}", moved)
            if waited is not Synced.READY:
                return waited
        if not await self._apply_chosen(plan, moved):
            return Synced.STOP
        if self.events.state != RunState.RUNNING or self._unreported:
            self._unreported = False  # refusals noted since (a rejection is sent at once)
            await self.events.status(RunState.RUNNING)
        return Synced.READY

    async def apply_newest(self) -> bool:
        """Apply the newest usable version if it is newer than the model's, waiting for
        nothing (serve mode, between two engine calls). False: stop."""
        return await self._apply_chosen(ExplorerSync(), lambda: False)

    async def apply_version(self, version: int) -> bool:
        """Apply ``version`` itself (an evaluator's choice among the usable ones), waiting
        for nothing. False: stop. :attr:`version` says whether it was applied."""
        return await self._apply_chosen(ExplorerSync(target=version, exact=True), lambda: False)

    async def _request(self, min_version: int) -> None:
        await self.events.control(
            SyncRequest(explorer=self.name, min_version=min_version, created_at=time.time())
        )

    async def _wait(self, floor: int, what: str, moved: Callable[[], bool]) -> Synced:
        """Wait for a usable version >= ``floor``, for the partitions to move, or for the
        starvation cut (see module)."""
        since = time.time()
        t0 = time.perf_counter()
        try:
            ready = await self.view.wait_until(
                lambda: self.newest() >= floor or moved() or self._deadlocked(since),
                self.cfg.synchronizer.sync_timeout,
                self.stop,
                what,
            )
        finally:
            waited = time.perf_counter() - t0
            self._times.version_wait_s += waited
            self.counters.add("version_wait_seconds", waited)
        if not ready:
            return Synced.STOP
        if self.newest() >= floor:
            return Synced.READY
        if moved():
            self.counters.add("sync_waits_retaken")
            log.info("%s: tasks partitions moved while waiting; taking tasks again", self.name)
            return Synced.RETAKE
        self.counters.add("sync_waits_cut")  # the cut: sample with the newest version
        log.warning(
            "%s: the trainer starves for experiences and this explorer waits for version "
            "%d; going on with version %d",
            self.name,
            floor,
            max(self.newest(), self.version),
        )
        return Synced.READY

    def _deadlocked(self, waiting_since: float) -> bool:
        """With weights: the trainer has said, since this explorer began waiting, that it
        starves for experiences, and no other explorer is exploring (all wait, or none is
        left), so the version waited for cannot come until this explorer explores on."""
        return (
            self.version >= 0
            and self.view.peer_starved("trainer", waiting_since)
            and not [p for p in self.view.exploring_peers(3 * HEARTBEAT_S) if p != self.name]
        )

    def _choose(self, plan: ExplorerSync) -> ModelVersionReady | None:
        usable = self.usable()
        chosen = self._waiting_broadcast(usable)
        if chosen is None:
            max_staleness = self.cfg.trainer.max_staleness
            chosen = choose_version(list(usable), plan, self.version, max_staleness)
        return None if chosen is None else usable[chosen]

    async def _apply_chosen(self, plan: ExplorerSync, moved: Callable[[], bool]) -> bool:
        """Load the chosen version, handling failures by :func:`on_failure`, one load at a
        time (a sync point, and a partial rollout's refresh between two turns, may ask at
        once: the second chooses again once the first is done). False: stop."""
        async with self._applying:
            return await self._apply_chosen_alone(plan, moved)

    async def _apply_chosen_alone(self, plan: ExplorerSync, moved: Callable[[], bool]) -> bool:
        """:meth:`_choose_and_load`, timed: sampling waits from here until a version is
        applied (or none is), but for the waits for an announcement inside (backpressure,
        counted apart)."""
        t0, announced_wait = time.perf_counter(), self._times.version_wait_s
        try:
            return await self._choose_and_load(plan, moved)
        finally:
            spent = time.perf_counter() - t0 - (self._times.version_wait_s - announced_wait)
            self._times.sync_wait_s += spent
            self.counters.add("sync_wait_seconds", spent)

    async def _choose_and_load(self, plan: ExplorerSync, moved: Callable[[], bool]) -> bool:
        await self.remember_rejections()
        started = time.monotonic()
        while (event := self._choose(plan)) is not None:
            exc = await self._load(event)
            if exc is None:
                return True
            refetchable = self.receivers.for_event(event).refetchable
            action = on_failure(exc, refetchable, self.version >= 0)
            if action is OnFailure.CHOOSE_AGAIN:
                log.info("%s: %s; choosing again", self.name, exc)
                continue
            if action is OnFailure.STAY:
                self._unavailable(exc)
                log.warning(
                    "%s: version %d unavailable (%s); staying on version %d for now",
                    self.name,
                    event.version,
                    exc,
                    self.version,
                )
                return True
            if action is OnFailure.RETRY_SOON:
                self._unavailable(exc)
                if not await self._retry_soon(started, exc):
                    return False
            elif action is OnFailure.WAIT_FALLBACK:
                if not await self._wait_fallback(event, exc):
                    return False
            else:
                await self._reject(event, exc)
                need = plan.wait_for
                after = self._choose(plan)  # another announcement of it (the store), or an
                if after is not None and (need is None or after.version >= need):
                    continue  # older version still newer than the model's, if enough
                if self.version >= 0 and (need is None or self.version >= need):
                    return True  # the weights held serve this step
                if await self._wait_after_reject(event, plan, moved) is Synced.STOP:
                    return False
        return True

    async def _load(self, event: ModelVersionReady) -> SyncError | None:
        """Apply ``event``: from its staging copy (the stager hands it over once received:
        see :class:`~.stager.Stager`), or received here (``staging: none``), off the event
        loop; the error, if it failed."""
        try:
            if not self.cfg.synchronizer.load_versions:  # the weights held count as it
                applied = 0.0
            elif self.stager is None:
                received_s, applied = await to_its_end(self._receive_and_apply, event)
                self._times.receive_s += received_s
                self.counters.add("receive_seconds", received_s)
                self.counters.add("sync_seconds", received_s)
            else:
                async with self.stager.taken(event) as staged:
                    applied = await to_its_end(self._apply, staged)
                event = staged.event  # the announcement its bytes came through
        except SyncError as exc:
            return exc
        except ServiceError:
            raise
        except UNEXPECTED as exc:
            return self._unexpected(event, exc)
        self._times.apply_s += applied
        self.counters.add("apply_seconds", applied)
        self.counters.add("sync_seconds", applied)
        self.version = event.version
        self.receivers.release_unused()  # e.g. the mappings of a stopped trainer's files
        self.counters.add("versions_applied")
        self.counters.add(f"versions_applied_{event.method}")
        log.info("%s: applied version %d (%s)", self.name, event.version, event.method)
        return None

    def _unexpected(self, event: ModelVersionReady, exc: Exception) -> IntegrityError:
        """An error of :data:`UNEXPECTED` while ``event`` loaded, as its refusal."""
        log.warning("%s: version %d failed unexpectedly: %r", self.name, event.version, exc)
        return IntegrityError(f"version {event.version} ({event.method}): {exc!r}")

    def _receive_and_apply(self, event: ModelVersionReady) -> tuple[float, float]:
        """``staging: none``: receive, then apply; (receive, apply) seconds."""
        t0 = time.perf_counter()
        staged = self._receive(event, None)
        return time.perf_counter() - t0, self._apply(staged)

    def _apply(self, staged: Staged) -> float:
        """Copy a received version in (an adapter's base first, when the model still lacks
        it); its memory is released, or kept when the state held refers to it. Seconds."""
        t0 = time.perf_counter()
        try:
            with self._state:
                if staged.base_event is not None and self.weights.needs_base(staged.event):
                    assert staged.base is not None
                    self.weights.apply(staged.base_event, staged.base)
                self.weights.apply(staged.event, staged.tensors)
                self.version = staged.event.version  # held now, even if the caller was cancelled
                keep = self.weights.held is not None
        except BaseException:
            staged.release()
            raise
        staged.release(keep)
        return time.perf_counter() - t0

    def _received(self, event: ModelVersionReady, stage: Stage) -> Staged:
        """The stager's receive: :meth:`_receive` into ``stage``, an unexpected error as the
        version's refusal (:data:`UNEXPECTED`)."""
        try:
            return self._receive(event, stage)
        except (SyncError, ServiceError):
            raise
        except UNEXPECTED as exc:
            raise self._unexpected(event, exc) from exc

    def _receive(self, event: ModelVersionReady, stage: Stage | None) -> Staged:
        """Everything received and verified before the model is touched, into ``stage``
        (None: the receiver's own memory): an adapter whose base the model lacks brings the
        base, a delta is rebuilt (its fetches are transient; the state is staged)."""
        if event.delta_base >= 0:
            state = self._rebuilt(event)
            return Staged(event, stage.adopt(state) if stage is not None else state)
        base_event, base = None, None
        if self.weights.needs_base(event):
            base_event = self.usable(report=False).get(event.base_version)
            if base_event is None:
                raise SyncError(
                    f"adapter version {event.version} needs full version "
                    f"{event.base_version}, which was never announced"
                )
            if not self.receivers.for_event(base_event).refetchable:
                raise SyncError(
                    f"adapter version {event.version} is on base {event.base_version}, sent "
                    f"by broadcast only; this explorer holds base {self.weights.base_version}"
                )
            base = self._fetch(base_event, stage.base() if stage is not None else None)
        return Staged(event, self._fetch(event, stage), base_event, base)

    def _rebuilt(self, event: ModelVersionReady) -> dict:
        """Delta version ``event`` as whole tensors, checked against its ``state_sha256``:
        rebuilt on the state held when its deltas lead back to it, else from the newest full
        version they lead back to; that too when the check fails on the state held (it is
        not what the trainer had: counter ``delta_refetches``). A version of the chain that
        fails its own verification (or was rejected here before) fails ``event`` at once:
        a chain from the full version would hold it too."""
        with self._state:  # the state held now: a sync point may apply another meanwhile
            base, held = self.weights.held, self.weights.held_version
        if base is None:
            held = -1
        chain = delta_chain(self.view.versions, event.version, held)
        bad = [e.version for e in chain if (e.version, e.manifest_sha256) in self.rejected]
        if bad:
            raise IntegrityError(f"delta version {event.version} builds on rejected {bad}")
        what = f"version {event.version}"
        state = self._walk(chain, base)
        if chain[0].delta_base >= 0:  # rebuilt on the state held: is that the trainer's?
            try:
                verify_state(state, event.state_sha256, what)
                return state
            except IntegrityError as exc:
                self.counters.add("delta_refetches")
                log.warning(
                    "%s: delta version %d does not rebuild on version %d (%s); from a full "
                    "version instead",
                    self.name,
                    event.version,
                    held,
                    exc,
                )
            state = self._walk(delta_chain(self.view.versions, event.version, -1), None)
        verify_state(state, event.state_sha256, what)
        return state

    def _walk(
        self, chain: list[ModelVersionReady], held: Mapping[str, torch.Tensor] | None
    ) -> dict:
        """The state at the end of ``chain`` (see :func:`delta_chain`; ``held``: the state
        it starts on when its first version is a delta), not yet checked."""
        state = held
        deltas = chain
        if chain[0].delta_base < 0:
            state = self._fetch(chain[0], None)
            deltas = chain[1:]
        for event in deltas:
            changes = self._fetch(event, None)
            state = self.weights.rebuild(event, changes, state)
            self.counters.add("delta_bytes", event.bytes)
        assert state is not None
        return dict(state)

    def _fetch(self, event: ModelVersionReady, stage: Stage | None) -> dict[str, torch.Tensor]:
        """The tensors of ``event`` from its receiver, into ``stage`` (None: the receiver's
        own memory), once its size is one this model's versions can have (nothing allocated
        for a larger claim)."""
        receiver = self.receivers.for_event(event)
        own = self.weights.template(event) if stage is None else self.weights.layout(event)
        limit = largest_version(own)
        if not 0 <= event.bytes <= limit:
            raise IntegrityError(
                f"version {event.version} announces {event.bytes} bytes; this model's "
                f"versions hold {limit} at most: refused"
            )
        like = own if receiver.needs_template and event.delta_base < 0 else {}
        if stage is None:
            return receiver.receive(event, like)
        return receiver.receive_into(event, like, stage)

    def _unavailable(self, exc: SyncError) -> None:
        """Count a version that could not be loaded now and may be later: the store did not
        answer, or there was no memory for it (``versions_out_of_memory``)."""
        oom = isinstance(exc, OutOfMemory)
        self.counters.add("versions_out_of_memory" if oom else "store_unavailable")

    async def _retry_soon(self, started: float, exc: SyncError) -> bool:
        """The store is down (or memory short) and there are no weights yet: wait, within
        the outage budget."""
        log.warning("%s: no weights yet, version unavailable: %s", self.name, exc)
        if self.stop.is_set() or self.view.shutdown.is_set():
            return False
        outage = self.cfg.run.outage_timeout_s
        if time.monotonic() - started > outage:
            raise ServiceError(
                f"{self.name}: no version could be loaded for {outage:.0f}s: {exc}"
            ) from exc
        await asyncio.sleep(RETRY_SOON_S)
        return True

    def _broadcast_failed(self, event: ModelVersionReady, exc: SyncError) -> None:
        self.counters.add("broadcast_failures")
        self.failed_broadcasts.add((event.version, event.uri))
        log.warning("%s: broadcast of version %d failed (%s)", self.name, event.version, exc)

    async def _wait_fallback(self, event: ModelVersionReady, exc: SyncError) -> bool:
        """A broadcast failed: the trainer announces the same version again by the store."""
        self._broadcast_failed(event, exc)
        v = event.version
        return await self.view.wait_until(
            lambda: (
                v not in self.view.versions  # retired meanwhile
                or self._refetchable(self.view.versions[v])
                or self.newest() > v
            ),
            self.cfg.synchronizer.sync_timeout,
            self.stop,
            f"no fallback for version {v}",
        )

    async def _reject(self, event: ModelVersionReady, exc: SyncError) -> None:
        """Never try ``event`` again, nor this component restarted: the rejection goes into
        its status at once (and into every heartbeat after)."""
        self.rejected.add((event.version, event.manifest_sha256))
        self.counters.add("versions_rejected")
        log.error(
            "%s: version %d rejected, staying on %d: %s",
            self.name,
            event.version,
            self.version,
            exc,
        )
        if self.events.reject(_rejection(event, str(exc), "integrity")):
            with contextlib.suppress(ServiceError):  # the broker is out: the heartbeat tells
                await self.events.status()

    async def remember_rejections(self) -> None:
        """Once, before the first version is loaded: take back the versions an earlier
        process of this component rejected (its last status, read from the status topic
        within :data:`REMEMBER_WAIT_S`), so a restart does not load them again."""
        if self._remembered:
            return
        self._remembered = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.view.caught_up.wait(), REMEMBER_WAIT_S)
        for r in self.view.own_rejections:
            self.events.reject(r)
            if r.kind == "integrity":
                self.rejected.add((r.version, r.manifest_sha256))
        if self.rejected:
            log.info(
                "%s: versions rejected before this start, not loaded again: %s",
                self.name,
                sorted(v for v, _ in self.rejected),
            )

    async def _wait_after_reject(
        self, event: ModelVersionReady, plan: ExplorerSync, moved: Callable[[], bool]
    ) -> Synced:
        """No weights, or short of the version this batch needs: ask again (when this
        style asks at all: the answer was bad) and wait for a newer one."""
        if plan.request is not None:
            await self._request(event.version + 1)
        floor = max(plan.wait_for or 0, 0)
        what = f"no usable model version >= {floor} (version {event.version} was rejected)"
        return await self._wait(floor, what, moved)

    # -- what the stager asks ----------------------------------------------------------------
    def _to_stage(self) -> ModelVersionReady | None:
        """The version to receive in the background: the newest usable one, when it is
        newer than the one held."""
        usable = self.usable()
        newest = max(usable, default=-1)
        return usable[newest] if newest > self.version else None

    def _serves(self, staged: Staged, event: ModelVersionReady | None) -> bool:
        """Whether ``staged`` may be applied as ``event``'s version now: the same version,
        received through one of its announcements that still stands (not retired, not
        rejected), with the base it needs when the model lacks it."""
        if event is None or staged.event.version != event.version:
            return False
        v = event.version
        if staged.event not in self.view.announcements(v):
            return False
        if (v, staged.event.manifest_sha256) in self.rejected:
            return False
        return staged.base_event is not None or not self.weights.needs_base(staged.event)

    async def _staging_failed(self, event: ModelVersionReady, exc: SyncError) -> None:
        """A receive in the background failed: the sync point's policy (:func:`on_failure`),
        with nothing to wait for (the stager tries a version that may load later again)."""
        action = on_failure(exc, self.receivers.for_event(event).refetchable, self.version >= 0)
        if action is OnFailure.CHOOSE_AGAIN:  # the stager wants the newest one still there
            log.info("%s: %s (in the background)", self.name, exc)
        elif action is OnFailure.REJECT:
            await self._reject(event, exc)
        elif action is OnFailure.WAIT_FALLBACK:
            self._broadcast_failed(event, exc)
        else:
            self._unavailable(exc)
            log.warning(
                "%s: version %d unavailable in the background (%s); trying again later",
                self.name,
                event.version,
                exc,
            )

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        self.receivers.close()
