"""The staging copy: where an explorer keeps a version it has received and verified and not
yet applied (``synchronizer.staging``).

:func:`staging_memory` chooses the memory once, when the follower starts:

- ``host``: host memory, pinned (page-locked) when the model is on a CUDA device, so that
  the apply at the sync point is one asynchronous host-to-device copy per tensor;
- ``device``: the model's device when a version (and a LoRA adapter's base) fits in its
  free memory, else pinned host memory, with a warning; on a CPU the device is host memory;
- ``none``: no staging copy: a version is received at the sync point, into the receiver's
  own buffers, and applied from there.

A version read from a device (``cuda_ipc``: a slot on the trainer's GPU) is staged on the
model's device whenever it fits there, whatever ``host`` or ``device`` says (:func:`choose_memory`
of ``device``, :attr:`StagingArea.from_device`): through host memory it would cross the bus
twice, and the apply at the sync point would be a host-to-device copy instead of a copy
within the GPU; when it does not fit, pinned host memory, as ``device`` staging falls back.

**Ownership.** A :class:`Stage` is the memory of one version from its receive to its apply.
What it hands out (:meth:`Stage.host_bytes`, :meth:`Stage.like`, :meth:`Stage.adopt`) is its
own and nobody else writes it until :meth:`Stage.release`; the :class:`StagingArea` then
reuses those buffers for a later version (sizes rarely change: nothing is allocated after
the first version), except when the release says the tensors are kept (an explorer that
rebuilds deltas keeps the state it holds): then they are forgotten, and a later version gets
new ones. The area lends one stage per slot at a time: ``version`` (the version itself) and
``base`` (the full version a LoRA adapter applies on, when the model lacks it), so a staged
version never takes more than one version's memory and its base.

A receiver fills a stage (:meth:`~.transport.WeightReceiver.receive_into`): into
:meth:`Stage.host_bytes` when it reads a file of bytes (shared memory), into
:meth:`Stage.like` when it receives tensors in place (a broadcast, a device copy), or it hands
its own new tensors to :meth:`Stage.adopt`, which keeps them when they already are in the
stage's memory and copies them in otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from streamrft.schemas.errors import OutOfMemory

log = logging.getLogger(__name__)

StagingKind = Literal["host", "device", "none"]
SLOTS = ("version", "base")
DEVICE_HEADROOM = 1 << 30
"""Free device memory ``device`` staging leaves for everything else (activations, the KV
cache growing, the allocator's slack) beyond the staging copy."""


@dataclass(frozen=True)
class StageMemory:
    """Where staged tensors live."""

    device: torch.device
    """``cpu`` (host memory) or the model's CUDA device."""
    pinned: bool = False
    """Host memory that is page-locked (the model is on a CUDA device)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` already is in this memory."""
        if self.device.type != "cpu":
            return tensor.device == self.device
        return tensor.device.type == "cpu" and (not self.pinned or tensor.is_pinned())

    def describe(self) -> str:
        if self.device.type != "cpu":
            return f"{self.device} memory"
        return "pinned host memory" if self.pinned else "host memory"


def choose_memory(
    kind: StagingKind, device: torch.device, version_bytes: int, free_bytes: int | None
) -> StageMemory | None:
    """The memory of ``synchronizer.staging: kind`` for a model on ``device`` whose staged
    versions take ``version_bytes``, its device having ``free_bytes`` free (None: no
    staging copy). Arithmetic only: :func:`staging_memory` asks the device."""
    if kind == "none":
        return None
    if device.type != "cuda":  # a CPU model: host memory, whatever was asked
        return StageMemory(torch.device("cpu"))
    if (
        kind == "device"
        and free_bytes is not None
        and version_bytes + DEVICE_HEADROOM <= free_bytes
    ):
        return StageMemory(device)
    return StageMemory(torch.device("cpu"), pinned=True)


def from_device_kind(kind: StagingKind) -> StagingKind:
    """The staging of a version read from a device (``cuda_ipc``): ``device`` (where it
    fits: :func:`choose_memory`) unless there is no staging copy at all."""
    return "none" if kind == "none" else "device"


def staging_memory(
    kind: StagingKind, device: torch.device, version_bytes: int, what: str = ""
) -> StageMemory | None:
    """:func:`choose_memory` with the device's free memory now; a warning when ``device``
    staging (or ``what`` asked it) falls back to pinned host memory."""
    free = None
    if kind == "device" and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    memory = choose_memory(kind, device, version_bytes, free)
    if kind == "device" and device.type == "cuda" and memory is not None and memory.pinned:
        log.warning(
            "synchronizer.staging: %s: a staged version takes %.2f GiB and %s has %.2f "
            "GiB free (keeping %.1f GiB for the rest); staging in pinned host memory instead",
            what or "device",
            version_bytes / 2**30,
            device,
            (free or 0) / 2**30,
            DEVICE_HEADROOM / 2**30,
        )
    return memory


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed for want of memory (torch's allocators
    raise RuntimeErrors: ``torch.OutOfMemoryError`` on a GPU, "can't allocate memory" from
    the host's, "out of memory" from CUDA's pinned memory)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text
    )


def allocated(make: Callable[[], torch.Tensor], nbytes: int, what: str) -> torch.Tensor:
    """``make()``: an allocation of ``nbytes`` for a version of a size this model's versions
    have (checked before), whose failure for want of memory is :class:`OutOfMemory`
    (retriable: the explorer keeps its weights and tries again), never the version's
    rejection."""
    try:
        return make()
    except (MemoryError, RuntimeError) as exc:
        if not out_of_memory(exc):
            raise
        raise OutOfMemory(
            f"no memory for {what} ({nbytes / 2**20:.1f} MiB): {exc}; keeping the weights "
            "held and trying again later"
        ) from exc


@dataclass
class _Buffers:
    """One slot's reusable memory: a flat byte buffer and tensors by name."""

    raw: torch.Tensor | None = None
    named: dict[str, torch.Tensor] = field(default_factory=dict)


class StagingArea:
    """The staging memory of one explorer: a slot for a version and one for its base, each
    lent to one :class:`Stage` at a time, their buffers reused from version to version."""

    def __init__(self, memory: StageMemory, from_device: StageMemory | None = None) -> None:
        self.memory = memory
        self.from_device = from_device or memory
        """Where a version read from a device (``cuda_ipc``) is staged (see the module)."""
        self._free = {slot: _Buffers() for slot in SLOTS}
        self._lent: set[str] = set()

    def stage(self, slot: str = "version") -> Stage:
        """The memory of slot ``slot`` until the stage is released. A slot is lent once at a
        time: asking again before the release is a bug of the caller."""
        if slot in self._lent:
            raise RuntimeError(f"staging slot {slot!r} is lent already (not released)")
        self._lent.add(slot)
        return Stage(self, slot, self._free.pop(slot, _Buffers()))

    def lent(self) -> frozenset[str]:
        """The slots lent now (a test's look at the memory bound)."""
        return frozenset(self._lent)

    def _give_back(self, slot: str, buffers: _Buffers) -> None:
        self._lent.discard(slot)
        self._free[slot] = buffers


class Stage:
    """The memory one version is received into (see the module: ownership)."""

    def __init__(self, area: StagingArea, slot: str, buffers: _Buffers) -> None:
        self.area = area
        self.slot = slot
        self.memory = area.memory
        self.from_device = area.from_device
        """The memory a receiver reading a version from a device asks :meth:`like` for."""
        self._buffers = buffers
        self._base: Stage | None = None
        self._released = False
        self._used: set[str] = set()
        self._raw_used = False
        """Names :meth:`like` handed out: the tensors the slot keeps for the next version."""

    def host_bytes(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer of ``nbytes`` (pinned when the staging memory is pinned
        or a device: a host-to-device copy from it is then asynchronous)."""
        self._raw_used = True
        raw = self._buffers.raw
        if raw is None or raw.numel() != nbytes:
            pin = self.memory.pinned or self.memory.device.type == "cuda"
            self._buffers.raw = None  # the old one is freed before the new one is made
            raw = self._buffers.raw = allocated(
                lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin),
                nbytes,
                "a staging buffer",
            )
        return raw

    def like(
        self, like: Mapping[str, torch.Tensor], memory: StageMemory | None = None
    ) -> dict[str, torch.Tensor]:
        """Tensors of ``like``'s names, shapes and dtypes in the staging memory (``memory``:
        that one, e.g. :attr:`from_device`; contents undefined), reusing this slot's tensors
        that match."""
        memory = memory or self.memory
        named = self._buffers.named
        out = {}
        for name, ref in like.items():
            buf = named.get(name)
            if (
                buf is None
                or buf.shape != ref.shape
                or buf.dtype != ref.dtype
                or not memory.holds(buf)
            ):
                named.pop(name, None)
                buf = None  # the old one is freed before the new one is made
                buf = named[name] = self._empty(ref, memory)
            out[name] = buf
            self._used.add(name)
        return out

    def adopt(
        self, tensors: Mapping[str, torch.Tensor], copy: bool = False
    ) -> dict[str, torch.Tensor]:
        """``tensors`` in the staging memory: kept as they are when they already are there
        and ``copy`` is False (a receiver's new tensors, or this stage's own buffers),
        else copied into this slot's tensors. ``copy``: the tensors are in memory their
        receiver writes again later (its reused buffers)."""
        move = {n: t for n, t in tensors.items() if copy or not self.memory.holds(t)}
        if not move:
            return dict(tensors)
        into = self.like(move)
        for name, tensor in move.items():
            into[name].copy_(tensor, non_blocking=self.memory.device.type == "cuda")
        if self.memory.device.type == "cuda":
            torch.cuda.synchronize(self.memory.device)
        return {n: into.get(n, t) for n, t in tensors.items()}

    def base(self) -> Stage:
        """The stage of this version's base (a LoRA adapter's full version), released with
        this one."""
        if self._base is None:
            self._base = self.area.stage("base")
        return self._base

    def release(self, keep: bool = False) -> None:
        """The version is applied or dropped: its memory goes back to the area for a later
        version, or, with ``keep`` (its tensors are still referenced: the state an explorer
        holds), is forgotten by it. Safe to call twice."""
        if self._released:
            return
        self._released = True
        if self._base is not None:
            self._base.release(keep)
        kept = _Buffers()
        if not keep:  # what this version used (a version of other tensors leaves nothing)
            named = {n: t for n, t in self._buffers.named.items() if n in self._used}
            kept = _Buffers(self._buffers.raw if self._raw_used else None, named)
        self.area._give_back(self.slot, kept)
        self._buffers = _Buffers()

    def _empty(self, ref: torch.Tensor, memory: StageMemory) -> torch.Tensor:
        if memory.device.type == "cpu":
            place: dict = {"pin_memory": memory.pinned}
        else:
            place = {"device": memory.device}
        return allocated(
            lambda: torch.empty(ref.shape, dtype=ref.dtype, **place),
            ref.numel() * ref.element_size(),
            "a staging tensor",
        )
