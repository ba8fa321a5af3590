"""The ``auto`` method: the same-host transports for the explorers on the trainer's host, the
object store for every other one, each version announced once per place it can be read.

A trainer on a GPU first writes every full version into a slot on its GPU and announces it
as a ``cuda_ipc`` version (:mod:`.cuda_ipc`: explorers whose GPU sees the trainer's copy it
device to device; never run on a GPU yet). Every version goes to shared memory next
(:mod:`.shared`: a copy, milliseconds) and is announced at once as a ``shared`` version
(explorers on the host's CPU, or shown only their own GPU). Then, in the background, the
store lane writes the newest version there is to the object store and announces it again,
as an ``object_store`` version of the same number: the copy that explorers on other hosts,
late joiners, restarted explorers and a reader that fell behind the two shared files load.
The store lane is slower than the steps on a large model, so it skips versions: it always
takes the newest (read back from its shared file, whose digest it checks), and an explorer
that needs a version at least some number takes a newer one. An explorer picks, for each
version, the cheapest announcement it can load (``sync/follower.py``).

Retention (``synchronizer.keep_versions``) counts the store copies apart from the shared
ones (``sync/retention.py``), and the version the lane is writing, and the newest it wrote,
are :meth:`AutoSender.pinned`: a lane slower than ``keep_versions`` steps still leaves its
copies to explorers elsewhere. A version retired all the same while the lane wrote it (a
retirement by an earlier trainer, a LoRA run's queue) is dropped: what the lane wrote is
deleted, it is not announced, and the lane goes on with the newest (``store_copies_dropped``).

A LoRA run's store lane sends every version in order (adapters are small, and a remote
explorer needs the base each adapter names). When shared memory cannot be written (a
``/dev/shm`` too small for the model), the store carries every version from then on, with
one warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

from streamrft.infra.bus import Counters
from streamrft.schemas.errors import SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.cuda_ipc import CudaIpcSender, SlotBusy
from streamrft.sync.shared import SharedReceiver, SharedSender
from streamrft.sync.transport import Announce, MakePayload, Payload, WeightSender
from streamrft.sync.versions import StoreSender

log = logging.getLogger(__name__)


class AutoSender(WeightSender):
    """Shared memory now, the object store in the background."""

    method = "auto"

    def __init__(
        self,
        shared: SharedSender,
        reader: SharedReceiver,
        store: StoreSender,
        counters: Counters,
        device: CudaIpcSender | None = None,
    ) -> None:
        self.device = device
        """The device-to-device path (a trainer on a GPU; None: none)."""
        self.shared: SharedSender | None = shared
        self.reader = reader
        self.store = store
        self.counters = counters
        self._newest: tuple[ModelVersionReady, Payload] | None = None
        """The newest version in shared memory the store lane has not written."""
        self._in_order: deque[Payload] = deque()
        """A LoRA run's versions for the store lane, every one, in order."""
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lane: asyncio.Task[None] | None = None
        self._announce: Announce | None = None
        self._writing = False
        self._error: BaseException | None = None
        self._shared_version = -1
        """The newest version written (or being written) to shared memory."""
        self._lane_version = -1
        """The version the store lane is reading back or writing (-1: none)."""
        self._stored = -1
        """The newest version the store lane announced."""
        self._retired: set[int] = set()
        """Versions retired (:meth:`retire`, from the trainer's thread): never announced."""

    def pinned(self) -> set[int]:
        """The version the store lane is writing or will write next, and the newest it
        wrote: retention keeps them (see the module's docstring)."""
        waiting = [self._newest[1].version] if self._newest is not None else []
        waiting += [p.version for p in self._in_order]
        return {v for v in (self._lane_version, self._stored, *waiting) if v >= 0}

    def retire(self, versions: Sequence[int]) -> None:
        self._retired.update(versions)  # a copy on its way is dropped (_store_lane)
        self.store.retire(versions)  # shared memory holds only its two newest slots

    async def send(self, make: MakePayload, announce: Announce) -> ModelVersionReady:
        if self._error is not None:  # the store lane gave up (an outage past its timeout)
            raise self._error
        payload = make(False)
        self._announce = announce
        if not payload.lora:
            await self._to_device(payload, announce)
        event = await self._to_shared(payload, announce)
        if event is None:  # no shared memory: the store carries this version now
            return await self.store.send(lambda _full: payload, announce)
        if payload.lora:
            self._in_order.append(payload)
        else:
            self._newest = (event, payload)
        self._start_lane()
        self._wake.set()
        return event

    async def _to_device(self, payload: Payload, announce: Announce) -> None:
        """The version into a slot on the trainer's GPU, announced (``cuda_ipc``); skipped
        while readers hold both slots, given up for the run when the GPU cannot hold them."""
        if self.device is None:
            return
        try:
            await self.device.send(lambda _full: payload, announce)
        except SlotBusy as exc:
            self.counters.add("cuda_ipc_skipped")
            log.info("version %d skips the device path: %s", payload.version, exc)
        except SyncError as exc:
            log.warning("device slots unusable (%s): shared memory and the store from now", exc)
            self.device.close()
            self.device = None

    async def _to_shared(self, payload: Payload, announce: Announce) -> ModelVersionReady | None:
        if self.shared is None:
            return None
        self._shared_version = payload.version  # from now on its slot's older one may go
        try:
            return await self.shared.send(lambda _full: payload, announce)
        except SyncError as exc:
            log.warning("shared memory unusable (%s): every version goes through the store", exc)
            self.shared.close()
            self.shared = None
            return None

    def _start_lane(self) -> None:
        """The lane on the running loop (again on a new loop, or after it ended)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._lane is None or self._lane.done():
            self._loop, self._wake = loop, asyncio.Event()
            self._lane = loop.create_task(self._store_lane(), name="store-lane")

    async def _store_lane(self) -> None:
        """Write the newest shared version (or, in a LoRA run, every one) to the store."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._writing = True
                while (payload := await self._next_for_store()) is not None:
                    await self._copy(payload)
                self._writing = False
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # raised by the next send, in the publisher's worker
            log.error("store lane failed: %r", exc)
            self._error = exc
            self._writing = False
        finally:
            self._lane_version = -1

    async def _copy(self, payload: Payload) -> None:
        """Write one version to the store and announce it, unless it was retired before
        or while it was written: then what was written is deleted and it is dropped."""
        assert self._announce is not None
        v = payload.version
        try:
            if v not in self._retired:
                event = await self.store.publish(payload)
                if v not in self._retired:
                    await self._announce(event)
                    self._stored = v
                    self.counters.add("store_copies")
                    return
                await asyncio.to_thread(self.store.retire, [v])
            log.info("store lane: version %d was retired while on its way: dropped", v)
            self.counters.add("store_copies_dropped")
        finally:
            self._lane_version = -1

    async def _next_for_store(self) -> Payload | None:
        """The next version the store lane writes: a LoRA run's next in order, else the
        newest in shared memory, read back (digest checked) so that the trainer's snapshot
        buffers are free again; a read the trainer overwrote is retried on the newer one."""
        if self._in_order:
            payload = self._in_order.popleft()
            self._lane_version = payload.version
            return payload
        while self._newest is not None:
            event, payload = self._newest
            self._newest = None
            self._lane_version = event.version
            try:
                tensors = await asyncio.to_thread(self.reader.receive, event, payload.tensors)
            except SyncError:
                if self._shared_version <= event.version:  # no newer one took its file
                    raise
                log.info("store lane: version %d was rewritten by a newer one", event.version)
                await self._newer()
                continue
            return Payload(
                payload.version,
                payload.step,
                tensors,
                base_version=payload.base_version,
                extra_files=payload.extra_files,
            )
        return None

    async def _newer(self) -> None:
        """Wait until the newer version that rewrote a file is in shared memory."""
        while self._newest is None and self._error is None and self.shared is not None:
            await asyncio.sleep(0.01)

    async def resend(self, make: MakePayload, announce: Announce) -> ModelVersionReady | None:
        """The store lane serves whoever cannot read shared memory: nothing to send again."""
        return None

    async def drain(self) -> None:
        """Wait until the store lane has written the newest version (or failed)."""
        while self._error is None and (self._newest or self._in_order or self._writing):
            await asyncio.sleep(0.05)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self._lane is not None:
            self._lane.cancel()
            self._lane = None
        if self.device is not None:
            self.device.close()
        if self.shared is not None:
            self.shared.close()
        self.store.close()
