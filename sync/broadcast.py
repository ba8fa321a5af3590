"""The ``nccl`` transport: a torch.distributed broadcast (NCCL on GPUs, gloo on CPU) from the
trainer to the explorers alive now, with the object store as its fallback.

The collective itself (group epochs, rendezvous, buckets) is :mod:`.collective`. Here:
who is in the group (the explorers heard from lately, given by the trainer), when a new
group epoch opens (membership changed, or the last one failed), and the fallback: a version
whose broadcast fails, or that has no member to go to (version 0, before any explorer has
announced itself), is published and announced again through the object store, where every
explorer, member or not, can load it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

import torch

from streamrft.infra.config import Config
from streamrft.infra.net import canonical_host
from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.collective import (
    CollectiveReceiver,
    CollectiveSender,
    SameDeviceError,
    parse_rendezvous,
    spec_digest,
    tensor_specs,
)
from streamrft.sync.delta import state_sha256, verify_state
from streamrft.sync.staging import Stage
from streamrft.sync.transport import (
    Announce,
    MakePayload,
    Payload,
    SenderContext,
    WeightReceiver,
    WeightSender,
)
from streamrft.sync.weights import nbytes

log = logging.getLogger(__name__)


def same_host(a: str, b: str) -> bool:
    """Whether two rendezvous hosts name the same address (``::1`` and ``[::1]``, case)."""
    return canonical_host(a) == canonical_host(b)


class BroadcastSender(WeightSender):
    """Trainer side: announce, broadcast to the group; on failure, the store."""

    method = "nccl"

    def __init__(self, cfg: Config, ctx: SenderContext, fallback: WeightSender) -> None:
        sync = cfg.synchronizer
        self.collective = CollectiveSender(
            sync.nccl_host, sync.nccl_port, sync.sync_timeout, sync.nccl_bucket_mb
        )
        self.ctx = ctx
        self.fallback = fallback
        self._members: list[str] = []
        """Members of the current group epoch (empty: the next broadcast forms a new one)."""
        self.apart: set[str] = set()
        """Explorers on the trainer's GPU, or sharing one (found when a group formed):
        never in a group again, served through the fallback."""

    def _group(self) -> tuple[list[str], bool]:
        """Who the next version goes to, and whether that needs a new group epoch."""
        members = [m for m in self.ctx.members() if m not in self.apart]
        new = bool(members) and (members != self._members or not self.collective.usable)
        return members, new

    async def send(self, make: MakePayload, announce: Announce) -> ModelVersionReady:
        members, new = self._group()
        payload = make(new)  # a new group starts with the full weights
        event = await self._broadcast(payload, members, new, announce) if members else None
        if event is None:  # nobody to broadcast to yet, or the broadcast failed
            return await self.fallback.send(lambda _full: payload, announce)
        if self.apart & set(self.ctx.members()):  # and the ones a broadcast cannot reach
            await self.fallback.send(lambda _full: payload, announce)
        return event

    async def _broadcast(
        self, payload: Payload, members: list[str], new: bool, announce: Announce
    ) -> ModelVersionReady | None:
        """Announce and broadcast ``payload`` to ``members``; None when the group failed."""
        tensors = payload.tensors
        uri = self.collective.open_epoch(members) if new else self.collective.uri
        self._members = members
        event = ModelVersionReady(
            version=payload.version,
            method=self.method,
            uri=uri or "",
            manifest_sha256=spec_digest(tensor_specs(tensors)).hex(),
            # the bytes' digest, which every member checks before it applies them
            state_sha256=await asyncio.to_thread(state_sha256, tensors),
            bytes=nbytes(tensors),
            step=payload.step,
            lora=payload.lora,
            created_at=time.time(),
            base_version=payload.base_version,
        )
        await announce(event)
        try:
            await asyncio.to_thread(self.collective.broadcast, tensors, payload.version)
        except SameDeviceError as exc:
            self.apart.update(exc.members)
            log.warning("%s; they get every version through the object store from now on", exc)
            self._members = []
            return None
        except SyncError as exc:
            self.ctx.counters.add("broadcast_failures")
            log.warning(
                "broadcast of version %d failed (%s); object store fallback", payload.version, exc
            )
            self._members = []  # the next version forms a new group
            return None
        self.ctx.counters.add("versions_broadcast")
        return event

    def reaches(self, explorer: str) -> bool:
        return not self._members or explorer in self._members or explorer in self.apart

    def retire(self, versions: Sequence[int]) -> None:
        self.fallback.retire(versions)  # a broadcast keeps nothing; its fallback does

    async def resend(self, make: MakePayload, announce: Announce) -> ModelVersionReady | None:
        """The last version through the object store (an explorer that joined after its
        broadcast waits for it)."""
        return await self.fallback.send(lambda _full: make(True), announce)

    def close(self) -> None:
        self.collective.close()


class BroadcastReceiver(WeightReceiver):
    """Explorer side: take part in a broadcast this explorer is a member of, receiving into
    tensors of its own (new ones for every version, or the staging copy's) that the caller
    applies only when complete and checked."""

    refetchable = False
    needs_template = True

    def __init__(
        self, member: str, timeout_s: float, host: str, others: Sequence[str] = ()
    ) -> None:
        self.member = member
        self.timeout_s = timeout_s
        self.hosts = (host, *others)
        """The rendezvous hosts this explorer connects to: ``synchronizer.nccl_host`` and
        ``synchronizer.nccl_hosts`` (where a trainer of the run may be restarted)."""
        self._receiver: CollectiveReceiver | None = None

    def can_load(self, event: ModelVersionReady) -> bool:
        return self.member in parse_rendezvous(event.uri).members

    def refusal(self, event: ModelVersionReady) -> str | None:
        try:
            host = parse_rendezvous(event.uri).host
        except SyncError as exc:
            return str(exc)
        if not any(same_host(host, allowed) for allowed in self.hosts):
            return (
                f"rendezvous at {host!r}, not synchronizer.nccl_host or nccl_hosts "
                f"({', '.join(self.hosts)})"
            )
        return None

    def receive(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return self._receive(event, {k: torch.empty_like(v) for k, v in like.items()})

    def receive_into(
        self, event: ModelVersionReady, like: Mapping[str, torch.Tensor], stage: Stage
    ) -> dict[str, torch.Tensor]:
        """Into the stage's tensors, in place (no copy after the broadcast)."""
        return self._receive(event, stage.like(like))

    def _receive(
        self, event: ModelVersionReady, into: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        what = f"broadcast version {event.version}"
        why = self.refusal(event)
        if why is not None:
            raise IntegrityError(f"{what}: {why}: refused")
        if not event.state_sha256:
            raise IntegrityError(f"{what}: no digest of its bytes (state_sha256): refused")
        if self._receiver is None:
            self._receiver = CollectiveReceiver(self.member, self.timeout_s)
        self._receiver.receive(event.uri, into, event.version)
        verify_state(into, event.state_sha256, what)  # before anything is applied
        return into

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
