"""What a version carries of a model, and how it goes back in: the one place that knows LoRA.

Every transport moves plain named tensors. Whether those are the full weights or a LoRA
adapter on top of a full version (``ModelVersionReady.lora`` / ``base_version``) is decided
here for the trainer (:meth:`ModelWeights.outgoing`) and undone here for an explorer
(:meth:`ModelWeights.template`, :meth:`ModelWeights.apply`), for every method alike.

A LoRA run publishes the full model once per trainer process (the warmed-up base, so that
explorers that join later can build it), and after that only the adapter; a transport may
ask for a full version again (``MakePayload``'s argument: a new broadcast group).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.transport import Payload
from streamrft.sync.weights import apply_state_dict, unique_state_dict


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


class ModelWeights:
    """A live model seen as versions: full weights, or a LoRA adapter over a base version.

    ``base_version`` is the full version the model's base weights are (-1: none yet): the
    trainer sets it when it publishes a full version, an explorer when it applies one.
    ``dtype``: what the explorers hold (``model.dtype``); the trainer's float32 master
    weights are sent in it (a LoRA adapter keeps its own dtype: PEFT keeps adapters float32
    on both sides).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lora: bool,
        dtype: torch.dtype | None = None,
        target: WeightTarget | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.dtype = dtype
        self.target = target or ModuleTarget(model)
        """Where :meth:`apply` puts a version (an explorer: its engine)."""
        self.base_version = -1

    # -- trainer side ------------------------------------------------------------------------
    def payload(self, version: int, step: int, must_be_full: bool = False) -> Payload:
        """Version ``version`` of the model (detached CPU copies of its tensors): the full
        weights (floating tensors cast to ``dtype``), which become the base later adapters apply on (always without LoRA, once
        per process with it, and whenever ``must_be_full``), or the adapter alone."""
        if not self.lora or self.base_version < 0 or must_be_full:
            self.base_version = version
            # the base in the explorers' dtype; a LoRA adapter as PEFT keeps it (float32)
            tensors = unique_state_dict(self.model, self.dtype, lambda name: ".lora_" in name)
            return Payload(version, step, tensors, base_version=version)
        from streamrft.sync.lora import adapter_config_json, adapter_state_dict

        return Payload(
            version,
            step,
            adapter_state_dict(self.model),
            lora=True,
            base_version=self.base_version,
            extra_files={"adapter_config.json": adapter_config_json(self.model)},
        )

    # -- explorer side -----------------------------------------------------------------------
    def template(self, event: ModelVersionReady) -> dict[str, torch.Tensor]:
        """The model's tensors that ``event`` replaces: names, shapes and dtypes a transport
        may need to receive into."""
        if event.lora:
            from streamrft.sync.lora import adapter_state_dict

            return adapter_state_dict(self.model)
        return unique_state_dict(self.model)

    def needs_base(self, event: ModelVersionReady) -> bool:
        """Whether ``event`` (an adapter) needs a full version first that the model lacks."""
        return event.lora and event.base_version != self.base_version

    def apply(self, event: ModelVersionReady, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a received version into the target in place (names and shapes are checked
        before the first copy, so a mismatch leaves the model as it was)."""
        if event.lora:
            self.target.load_adapter(event.version, tensors)
            return
        self.target.load_weights(event.version, tensors)
        self.base_version = event.version
