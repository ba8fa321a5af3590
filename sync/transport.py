"""Weight transports behind one interface, chosen by ``synchronizer.method``.

A transport has two sides:

- a :class:`WeightSender` (trainer side) makes one version reach the explorers and
  announces it (``ModelVersionReady`` on the control topic) through the ``announce``
  callback it is given;
- a :class:`WeightReceiver` (explorer side) turns an announced version into verified
  tensors; the explorer picks the receiver by the method the event names (an ``nccl`` run
  also announces versions through the object store, its fallback).

Neither side knows about LoRA: what a version carries (the full weights, or an adapter on
a base) is decided and applied in one place, :mod:`streamrft.sync.payload`. Neither loop
names a method: they call :func:`make_sender` / :class:`Receivers`.

Adding a transport: a file with a sender and a receiver, and a line in :data:`SENDERS` and
:data:`RECEIVERS`.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from streamrft.infra.bus import Counters
from streamrft.infra.config import Config
from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.staging import Stage

Announce = Callable[[ModelVersionReady], Awaitable[None]]
"""Sends a ``ModelVersionReady`` on the control topic (the trainer's ``EventSender.control``)."""
MakePayload = Callable[[bool], "Payload"]
"""``make(must_be_full) -> Payload``: the version to send. ``must_be_full`` is the
transport's say (a new broadcast group: a member that joined late has no base for a LoRA
adapter); whether it is full in the end is the payload's decision (``sync/payload.py``)."""


@dataclass(frozen=True)
class Payload:
    """One version as the trainer hands it to a transport."""

    version: int
    step: int
    tensors: Mapping[str, torch.Tensor]
    lora: bool = False
    """True: ``tensors`` are a LoRA adapter for full version ``base_version``."""
    base_version: int = -1
    """The full version these weights are (a full version) or apply on (an adapter)."""
    extra_files: Mapping[str, bytes] = field(default_factory=dict)
    """Files beside the tensors (a LoRA adapter's ``adapter_config.json``)."""


@dataclass(frozen=True)
class SenderContext:
    """What a sender may need from the trainer, given at construction."""

    counters: Counters
    """The trainer's counters (``publish_retries``, ``broadcast_failures``, ...)."""
    members: Callable[[], list[str]]
    """The explorers alive now (from their status heartbeats): who a broadcast goes to."""


class WeightSender(abc.ABC):
    """Trainer side of one method."""

    method: str

    @abc.abstractmethod
    async def send(self, make: MakePayload, announce: Announce) -> ModelVersionReady:
        """Make the payload (see :data:`MakePayload`), get it to the explorers and announce
        it; returns the event that announced it last (the one explorers load from). Raises
        :class:`ServiceError` once an outage outlasts ``run.outage_timeout_s``."""

    def reaches(self, explorer: str) -> bool:
        """Whether ``explorer`` can load the version sent last (a broadcast: only the
        members of its group can)."""
        return True

    async def resend(self, make: MakePayload, announce: Announce) -> ModelVersionReady | None:
        """Send the version sent last again, where every explorer can load it; None when
        every explorer can already."""
        return None

    def retire(self, versions: Sequence[int]) -> None:  # noqa: B027 - nothing kept by default
        """Delete what the transport keeps of ``versions`` (no explorer loads them any more:
        ``synchronizer.keep_versions``). Blocking: run it off the event loop. A broadcast
        and shared memory keep nothing of an old version."""

    def pinned(self) -> set[int]:
        """Versions retention must keep whatever their age: what the sender is writing in
        the background, or wrote there last (``auto``'s store lane: the copy explorers on
        other hosts load). Read on the event loop."""
        return set()

    async def drain(self) -> None:  # noqa: B027 - optional hook, nothing queued by default
        """Wait until what the sender does in the background after :meth:`send` (``auto``:
        the store copy) is done; raise what it failed with."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the sender holds (a rendezvous store); safe to call twice."""


class WeightReceiver(abc.ABC):
    """Explorer side of one method."""

    refetchable = True
    """Whether an announced version can be fetched at any later time (a store), or only
    while it is being sent (a broadcast)."""
    needs_template = False
    """Whether :meth:`receive` needs ``like`` (the tensors it replaces) to receive into."""

    def can_load(self, event: ModelVersionReady) -> bool:
        """Whether this explorer can load ``event`` at all (a broadcast: is it a member)."""
        return True

    def refusal(self, event: ModelVersionReady) -> str | None:
        """Why the run refuses ``event`` whoever reads it (it points where the run does not
        allow: a rendezvous host it does not use); None when it does not."""
        return None

    @abc.abstractmethod
    def receive(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The version's tensors, every byte verified, before any of them is used. ``like``:
        the tensors the version replaces (names, shapes, dtypes) when :attr:`needs_template`,
        else empty. Blocking: run it off the event loop. Raises :class:`SyncError`
        (``retriable`` when the transport may work again soon)."""

    reuses_buffers = False
    """Whether the tensors :meth:`receive` returns are views of buffers it writes again
    for a later version (then :meth:`receive_into`'s default copies them into the stage)."""

    def receive_into(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor], stage: Stage
    ) -> dict[str, torch.Tensor]:
        """:meth:`receive`, into ``stage`` (:mod:`.staging`): every tensor returned lives in
        memory the stage owns until it is released (its :meth:`~.staging.Stage.host_bytes`,
        :meth:`~.staging.Stage.like`, or tensors it adopted), never in a buffer this receiver
        writes again. A receiver that can receive straight into the stage's memory (a file
        read into its bytes, a broadcast or a device copy into its tensors) overrides this;
        the default receives, then has the stage adopt the result (a copy only where the
        tensors are not in its memory, or are this receiver's reused buffers)."""
        return stage.adopt(self.receive(event, like), copy=self.reuses_buffers)

    def release_unused(self) -> None:  # noqa: B027 - optional hook, nothing kept by default
        """Free what the receiver keeps of versions no longer there (shared memory: its
        mappings of files the trainer removed). Called on the event loop after an apply."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Leave what the receiver joined; safe to call twice."""


def _object_store_sender(cfg: Config, ctx: SenderContext) -> WeightSender:
    from streamrft.sync.object_store import ObjectStorePublisher
    from streamrft.sync.versions import StoreSender

    publisher = ObjectStorePublisher(cfg.object_store, cfg.topics().run)
    return StoreSender(publisher, cfg.run.outage_timeout_s, ctx.counters)


def _filesystem_sender(cfg: Config, ctx: SenderContext) -> WeightSender:
    from streamrft.sync.filesystem import FilesystemPublisher, fs_root
    from streamrft.sync.versions import StoreSender

    publisher = FilesystemPublisher(
        fs_root(cfg), cfg.topics().run, cfg.object_store.shard_size_mb << 20
    )
    return StoreSender(publisher, cfg.run.outage_timeout_s, ctx.counters)


def _nccl_sender(cfg: Config, ctx: SenderContext) -> WeightSender:
    from streamrft.sync.broadcast import BroadcastSender

    return BroadcastSender(cfg, ctx, fallback=_object_store_sender(cfg, ctx))


def _shared_sender(cfg: Config, ctx: SenderContext) -> WeightSender:
    from streamrft.sync.shared import SharedSender

    return SharedSender(cfg)


def _cuda_ipc_sender(cfg: Config, ctx: SenderContext) -> WeightSender:
    from streamrft.sync.cuda_ipc import CudaIpcSender

    return CudaIpcSender(cfg, cfg.synchronizer.sync_timeout)


def _auto_sender(cfg: Config, ctx: SenderContext) -> WeightSender:
    from streamrft.sync.auto import AutoSender
    from streamrft.sync.cuda_ipc import device_sender
    from streamrft.sync.shared import SharedReceiver, SharedSender
    from streamrft.sync.versions import StoreSender

    store = _object_store_sender(cfg, ctx)
    assert isinstance(store, StoreSender)  # its lane writes, then announces, by itself
    return AutoSender(
        SharedSender(cfg), SharedReceiver(cfg), store, ctx.counters, device=device_sender(cfg)
    )


def _object_store_receiver(cfg: Config, member: str) -> WeightReceiver:
    from streamrft.sync.object_store import ObjectStoreLoader
    from streamrft.sync.versions import StoreReceiver

    return StoreReceiver(ObjectStoreLoader(cfg.object_store, cfg.topics().run))


def _filesystem_receiver(cfg: Config, member: str) -> WeightReceiver:
    from streamrft.sync.filesystem import FilesystemLoader, fs_root
    from streamrft.sync.versions import StoreReceiver

    return StoreReceiver(FilesystemLoader(fs_root(cfg), cfg.topics().run))


def _nccl_receiver(cfg: Config, member: str) -> WeightReceiver:
    from streamrft.sync.broadcast import BroadcastReceiver

    sync = cfg.synchronizer
    return BroadcastReceiver(member, sync.sync_timeout, sync.nccl_host, sync.nccl_hosts)


def _shared_receiver(cfg: Config, member: str) -> WeightReceiver:
    from streamrft.sync.shared import SharedReceiver

    return SharedReceiver(cfg)


def _cuda_ipc_receiver(cfg: Config, member: str) -> WeightReceiver:
    from streamrft.sync.cuda_ipc import CudaIpcReceiver

    return CudaIpcReceiver(cfg)


SENDERS: dict[str, Callable[[Config, SenderContext], WeightSender]] = {
    "object_store": _object_store_sender,
    "filesystem": _filesystem_sender,
    "nccl": _nccl_sender,
    "shared": _shared_sender,
    "cuda_ipc": _cuda_ipc_sender,
    "auto": _auto_sender,
}
"""``synchronizer.method`` -> the trainer's sender."""

RECEIVERS: dict[str, Callable[[Config, str], WeightReceiver]] = {
    "object_store": _object_store_receiver,
    "filesystem": _filesystem_receiver,
    "nccl": _nccl_receiver,
    "shared": _shared_receiver,
    "cuda_ipc": _cuda_ipc_receiver,
}
"""``ModelVersionReady.method`` -> an explorer's receiver for it (``auto`` announces its
versions as ``shared`` and ``object_store``, and as ``cuda_ipc`` from a trainer on a GPU)."""

ACCEPTED = {
    "object_store": ("object_store",),
    "filesystem": ("filesystem",),
    "nccl": ("nccl", "object_store"),
    "shared": ("shared",),
    "cuda_ipc": ("cuda_ipc",),
    "auto": ("cuda_ipc", "shared", "object_store"),
}
"""``synchronizer.method`` -> the methods of the announcements an explorer of that run
loads (a broadcast's fallback and ``auto``'s store lane are the object store). Any other
is refused: an event cannot move an explorer to a method its run does not use (connect to
a rendezvous it names, read a folder)."""

COST = {"cuda_ipc": 0, "shared": 1, "nccl": 2, "filesystem": 3, "object_store": 4}
"""Which announcement of a version an explorer loads when it can load several: the
cheapest (an unknown method last)."""


def make_sender(cfg: Config, ctx: SenderContext) -> WeightSender:
    """The sender of ``synchronizer.method``."""
    method = cfg.synchronizer.method
    if method not in SENDERS:
        raise SyncError(f"synchronizer.method: unknown method {method!r}; known: {list(SENDERS)}")
    return SENDERS[method](cfg, ctx)


class Receivers:
    """An explorer's receivers, one per method an event names, each made on first use."""

    def __init__(self, cfg: Config, member: str) -> None:
        self.cfg = cfg
        self.member = member
        self._made: dict[str, WeightReceiver] = {}

    def for_event(self, event: ModelVersionReady) -> WeightReceiver:
        receiver = self._made.get(event.method)
        if receiver is None:
            method = self.cfg.synchronizer.method
            if event.method not in ACCEPTED.get(method, ()):
                raise IntegrityError(
                    f"version {event.version} comes by {event.method!r}, which this run does "
                    f"not use (synchronizer.method: {method}): refused"
                )
            if event.method not in RECEIVERS:
                raise SyncError(
                    f"version {event.version}: no receiver for method {event.method!r} "
                    f"(known: {list(RECEIVERS)})"
                )
            receiver = self._made[event.method] = RECEIVERS[event.method](self.cfg, self.member)
        return receiver

    def refusal(self, event: ModelVersionReady) -> str | None:
        """Why this run refuses ``event`` (see :meth:`WeightReceiver.refusal`): a method it
        does not use, or a location its receiver does not allow; None: it may be loaded."""
        method = self.cfg.synchronizer.method
        if event.method not in ACCEPTED.get(method, ()):
            return (
                f"method {event.method!r} is not one this run uses (synchronizer.method: {method})"
            )
        if event.method not in RECEIVERS:
            return f"no receiver for method {event.method!r} (known: {list(RECEIVERS)})"
        return self.for_event(event).refusal(event)

    def can_load(self, event: ModelVersionReady) -> bool:
        """Whether this explorer can load ``event``: not refused, and its receiver can (a
        broadcast of a group it is not in, shared memory of another host: it cannot)."""
        return self.refusal(event) is None and self.for_event(event).can_load(event)

    def release_unused(self) -> None:
        """:meth:`WeightReceiver.release_unused` of each receiver made."""
        for receiver in self._made.values():
            receiver.release_unused()

    def close(self) -> None:
        for receiver in self._made.values():
            receiver.close()
