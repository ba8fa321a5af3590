"""What a version carries of a model, and how it goes back in: the one place that knows LoRA.

Every transport moves plain named tensors. Whether those are the full weights or a LoRA
adapter on top of a full version (``ModelVersionReady.lora`` / ``base_version``) is decided
here for the trainer (:meth:`ModelWeights.outgoing`) and undone here for an explorer
(:meth:`ModelWeights.template`, :meth:`ModelWeights.apply`), for every method alike.

A LoRA run publishes the full model once per trainer process (the warmed-up base, so that
explorers that join later can build it), and after that only the adapter; a transport may
ask for a full version again (``MakePayload``'s argument: a new broadcast group).

Delta versions (``synchronizer.delta``, :class:`DeltaPolicy`): a full run may send a version
as its changes against the version before it (:mod:`.delta`). The trainer keeps the state
it sent last as the base of the next delta; an explorer keeps the state it holds
(:attr:`ModelWeights.held`) to rebuild the next one on (:meth:`ModelWeights.rebuild`).
Every version then carries the sha256 of its whole state (``state_sha256``), which the
explorer checks after rebuilding. The event of a delta names its base (``delta_base``);
the transports know nothing of it: a delta is just other tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch

from streamrft.infra.config import SynchronizerConfig
from streamrft.schemas.errors import SyncError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync import delta
from streamrft.sync.transport import Payload
from streamrft.sync.weights import (
    apply_state_dict,
    live_tensors,
    nbytes,
    snapshot_tensors,
    unique_state_dict,
)

log = logging.getLogger(__name__)


class WeightTarget(Protocol):
    """Where an explorer's received versions go: a rollout engine (its weights may live
    outside the torch model, as vLLM's do) or :class:`ModuleTarget`. Both calls copy in
    place and check names and shapes before the first copy."""

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Full weights (``unique_state_dict`` names of the explorer's model)."""
        ...

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """A LoRA adapter (``adapter_state_dict`` names)."""
        ...


class ModuleTarget:
    """Versions applied to a torch model in place: what an engine sampling with that very
    model (transformers, simulated) does."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        apply_state_dict(self.model, tensors)

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        from streamrft.sync.lora import apply_adapter

        apply_adapter(self.model, tensors)


WHOLE_METHODS = ("nccl", "shared", "cuda_ipc", "auto")
"""Methods that send every version whole (a broadcast; a copy in shared or device memory,
faster than encoding a delta, and ``auto``'s store lane, which skips versions)."""


@dataclass(frozen=True)
class DeltaPolicy:
    """When the trainer sends a version as a delta (``synchronizer.delta``)."""

    always: bool = False
    """``always``: a delta whatever its size; ``auto``: only within ``max_ratio``."""
    full_every: int = 10
    """A full version after this many deltas in a row."""
    max_ratio: float = 0.5
    """``auto``: a delta's bytes at most this share of the full version's."""

    @classmethod
    def from_config(
        cls, sync: SynchronizerConfig, lora: bool, dtype: str = "float32"
    ) -> DeltaPolicy | None:
        """The policy of ``sync`` for weights of ``dtype`` (``model.dtype``). None: every
        version full: ``delta: never``, an unset ``delta`` with float32 weights (nearly
        every element changes each step), a LoRA run, or a method that sends whole tensors
        (``WHOLE_METHODS``)."""
        mode = sync.delta or ("never" if dtype == "float32" else "auto")
        if mode == "never":
            return None
        if lora or sync.method in WHOLE_METHODS:
            if sync.delta is not None:  # said on purpose: say why it does nothing
                log.warning(
                    "synchronizer.delta: %s is ignored: %s sends every version whole",
                    sync.delta,
                    "a LoRA run (adapters are small)" if lora else f"the {sync.method} method",
                )
            return None
        return cls(mode == "always", sync.full_every, sync.delta_max_ratio)

    def send_delta(self, delta_bytes: int, full_bytes: int, deltas_in_a_row: int) -> bool:
        """Whether a delta of ``delta_bytes`` goes out instead of the full version."""
        if deltas_in_a_row >= self.full_every:
            return False
        return self.always or delta_bytes <= self.max_ratio * full_bytes


@dataclass(frozen=True)
class Snapshot:
    """The model's weights as one version needs them, copied out of the model so that
    training may go on while the version is sent (:meth:`ModelWeights.snapshot`)."""

    full: dict[str, torch.Tensor] | None
    """The full weights in the explorers' dtype (None: a LoRA run, whose base is frozen)."""
    adapter: dict[str, torch.Tensor] | None = None
    """A LoRA run's adapter (PEFT's names and float32)."""
    adapter_config: bytes = b""
    lora_full: dict[str, torch.Tensor] = field(default_factory=dict)
    """A LoRA run's adapter under the model's own names: what a full version holds beside
    the frozen base."""


@dataclass(frozen=True)
class Sent:
    """What the trainer's last payload was, for its event (:meth:`ModelWeights.stamp`)."""

    version: int
    state_sha256: str
    delta_base: int = -1


class ModelWeights:
    """A live model seen as versions: full weights, or a LoRA adapter over a base version.

    ``base_version`` is the full version the model's base weights are (-1: none yet): the
    trainer sets it when it publishes a full version, an explorer when it applies one.
    ``dtype``: what the explorers hold (``model.dtype``); the trainer's float32 master
    weights are sent in it (a LoRA adapter keeps its own dtype: PEFT keeps adapters float32
    on both sides). ``delta``: the trainer's :class:`DeltaPolicy` (None: full versions).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lora: bool,
        dtype: torch.dtype | None = None,
        target: WeightTarget | None = None,
        delta: DeltaPolicy | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.dtype = dtype
        self.target = target or ModuleTarget(model)
        """Where :meth:`apply` puts a version (an explorer: its engine)."""
        self.base_version = -1
        self.delta = delta
        self._last: dict[str, torch.Tensor] | None = None
        """The trainer's last full state sent (the base of the next delta)."""
        self._deltas_in_a_row = 0
        self.sent: Sent | None = None
        """The trainer's last payload (what its event says beyond the transport's)."""
        self.held: dict[str, torch.Tensor] | None = None
        """An explorer's state as of version :attr:`held_version`, kept while the trainer
        sends deltas (its versions carry ``state_sha256``): the base to rebuild on."""
        self.held_version = -1

    # -- trainer side ------------------------------------------------------------------------
    def snapshot(self, into: Snapshot | None = None) -> Snapshot:
        """The weights a version of the model now needs, copied out of it: the full
        weights in ``dtype`` (into ``into``'s buffers when they fit: the copy and the cast
        are one pass, and nothing is allocated; on a GPU they are pinned host memory), or,
        in a LoRA run, the adapter (the base is frozen: a full version is read from the
        model when it is sent)."""
        if self.lora:
            from streamrft.sync.lora import adapter_config_json, adapter_state_dict

            adapter = {k: v.detach().clone() for k, v in adapter_state_dict(self.model).items()}
            # a full version of a LoRA run holds the adapter too, under the model's names
            in_full = {k: v for k, v in live_tensors(self.model).items() if _is_lora(k)}
            lora_full = snapshot_tensors(in_full)
            return Snapshot(None, adapter, adapter_config_json(self.model), lora_full)
        buffers = into.full if into is not None else None
        return Snapshot(snapshot_tensors(live_tensors(self.model), buffers, self.dtype))

    def payload(
        self, version: int, step: int, must_be_full: bool = False, frozen: Snapshot | None = None
    ) -> Payload:
        """Version ``version`` of the model: the full weights (CPU tensors, floating ones in
        ``dtype``), which become the base later adapters apply on (always without LoRA, once
        per process with it, and whenever ``must_be_full``), or the adapter alone. From
        ``frozen`` (a :meth:`snapshot`) when given, else from the model itself: then a tensor
        already on the CPU in that dtype is the model's own storage, and the model must not
        change until the version is sent."""
        if not self.lora or self.base_version < 0 or must_be_full:
            self.base_version = version
            if frozen is not None and frozen.full is not None:
                tensors = frozen.full
            else:  # the base in the explorers' dtype; a LoRA adapter as PEFT keeps it
                tensors = unique_state_dict(self.model, self.dtype, _is_lora)
                if frozen is not None:  # a LoRA run: the frozen base read now, the
                    tensors.update(frozen.lora_full)  # adapter as it was at the snapshot
            if self.delta is not None:
                return self._full_or_delta(version, step, tensors, must_be_full)
            return Payload(version, step, tensors, base_version=version)
        from streamrft.sync.lora import adapter_config_json, adapter_state_dict

        if frozen is not None and frozen.adapter is not None:
            adapter, config = frozen.adapter, frozen.adapter_config
        else:
            adapter, config = adapter_state_dict(self.model), adapter_config_json(self.model)
        return Payload(
            version,
            step,
            adapter,
            lora=True,
            base_version=self.base_version,
            extra_files={"adapter_config.json": config},
        )

    def _full_or_delta(
        self, version: int, step: int, tensors: dict[str, torch.Tensor], must_be_full: bool
    ) -> Payload:
        """The full ``tensors``, or their delta against the last version sent (see
        :class:`DeltaPolicy`); the state is kept as the next base either way."""
        assert self.delta is not None
        changes = None
        full_due = self._deltas_in_a_row >= self.delta.full_every
        if self._last is not None and not must_be_full and not full_due:
            try:
                changes = delta.encode(tensors, self._last)
            except SyncError:  # tensors gone since the base: say it whole
                changes = None
        base = self.sent.version if self.sent is not None else -1
        send = changes is not None and self.delta.send_delta(
            nbytes(changes), nbytes(tensors), self._deltas_in_a_row
        )
        self._last = _owned(tensors)
        digest = delta.state_sha256(tensors)
        if not send or changes is None:
            self._deltas_in_a_row = 0
            self.sent = Sent(version, digest)
            return Payload(version, step, tensors, base_version=version)
        self._deltas_in_a_row += 1
        self.sent = Sent(version, digest, delta_base=base)
        return Payload(version, step, changes, base_version=version)

    def stamp(self, event: ModelVersionReady) -> ModelVersionReady:
        """``event`` (the transport's) with what the last payload adds: a delta's base, and
        the state's sha256 (when the trainer sends deltas)."""
        sent = self.sent
        if sent is None or sent.version != event.version:
            return event
        return msgspec.structs.replace(
            event, delta_base=sent.delta_base, state_sha256=sent.state_sha256
        )

    # -- explorer side -----------------------------------------------------------------------
    def template(self, event: ModelVersionReady) -> dict[str, torch.Tensor]:
        """The model's tensors that ``event`` replaces: names, shapes and dtypes a transport
        may need to receive into."""
        if event.lora:
            from streamrft.sync.lora import adapter_state_dict

            return adapter_state_dict(self.model)
        return unique_state_dict(self.model)

    def layout(self, event: ModelVersionReady) -> dict[str, torch.Tensor]:
        """:meth:`template` without a copy: the model's tensors that ``event`` replaces,
        where they live (names, shapes and dtypes to stage a version by; never written)."""
        if event.lora:
            from streamrft.sync.lora import adapter_views

            return adapter_views(self.model)
        return live_tensors(self.model)

    def needs_base(self, event: ModelVersionReady) -> bool:
        """Whether ``event`` (an adapter) needs a full version first that the model lacks."""
        return event.lora and event.base_version != self.base_version

    def rebuild(
        self,
        event: ModelVersionReady,
        changes: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The whole state delta version ``event`` makes of ``base`` (default: the state
        held, which must be its base). Not checked: see :func:`.delta.verify_state`."""
        if base is None:
            if self.held is None or self.held_version != event.delta_base:
                raise SyncError(
                    f"delta version {event.version} applies on version {event.delta_base}; "
                    f"this explorer holds {self.held_version}"
                )
            base = self.held
        return delta.decode(changes, base, f"delta version {event.version}")

    def apply(self, event: ModelVersionReady, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a received version into the target in place (names and shapes are checked
        before the first copy, so a mismatch leaves the model as it was). A delta version
        comes here rebuilt (:meth:`rebuild`): whole tensors."""
        if event.lora:
            self.target.load_adapter(event.version, tensors)
            return
        self.target.load_weights(event.version, tensors)
        self.base_version = event.version
        keep = bool(event.state_sha256)  # the trainer sends deltas: the next needs this state
        if not keep:
            self.held = None
        elif event.delta_base >= 0:  # rebuilt: its unchanged tensors may pin fetched shards
            self.held = _compact(tensors)
        else:
            self.held = dict(tensors)
        self.held_version = event.version if keep else -1


def _is_lora(name: str) -> bool:
    """A LoRA adapter's tensor, under the model's names (PEFT keeps them float32)."""
    return ".lora_" in name


def _compact(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with those that are views of a larger buffer (a fetched shard, the rest
    of whose tensors a delta replaced) copied out, so that a kept state holds its own bytes
    only; a tensor copied once is not copied again."""
    return {
        k: v.clone() if v.untyped_storage().nbytes() > v.numel() * v.element_size() else v
        for k, v in tensors.items()
    }


def _owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` that nothing else writes: they may be the model's own storage
    (no cast was needed) or a snapshot's buffers (reused for a later version), and a kept
    base must not change."""
    return {k: v.clone() for k, v in tensors.items()}
