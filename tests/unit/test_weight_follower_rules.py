"""The sync protocol's pure parts: the explorer's failure policy, what a version carries
(full weights or a LoRA adapter, decided in one place), and how the trainer numbers them."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from streamrft.infra.bus import Counters
from streamrft.infra.config import LoraConfig, ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas.errors import (
    IntegrityError,
    StoreUnavailable,
    SyncError,
    SyncTimeout,
    VersionGone,
)
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.follower import OnFailure, WeightFollower, on_failure
from streamrft.sync.payload import ModelWeights
from streamrft.sync.publisher import VersionPublisher
from streamrft.sync.transport import Payload, WeightSender

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("exc", "refetchable", "have_weights", "action"),
    [
        (StoreUnavailable("down"), True, True, OnFailure.STAY),
        (StoreUnavailable("down"), True, False, OnFailure.RETRY_SOON),
        (IntegrityError("sha256"), True, True, OnFailure.REJECT),
        (IntegrityError("sha256"), True, False, OnFailure.REJECT),
        (SyncError("shapes differ"), True, True, OnFailure.REJECT),
        (SyncTimeout("late member"), False, True, OnFailure.WAIT_FALLBACK),
        (SyncError("mismatch"), False, False, OnFailure.WAIT_FALLBACK),
        (VersionGone("retired meanwhile"), True, True, OnFailure.CHOOSE_AGAIN),
        (VersionGone("retired meanwhile"), True, False, OnFailure.CHOOSE_AGAIN),
    ],
)
def test_failure_policy(exc, refetchable, have_weights, action):
    assert on_failure(exc, refetchable, have_weights) is action


def _model(lora: bool):
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4)
    model = build_tiny_model(cfg, build_char_tokenizer(cfg.charset))
    if lora:
        from streamrft.sync.lora import attach_lora

        model = attach_lora(model, LoraConfig(enabled=True, rank=2))
    return model


def _event(p: Payload) -> ModelVersionReady:
    return ModelVersionReady(
        version=p.version,
        method="test",
        uri="test://",
        manifest_sha256="",
        bytes=0,
        step=p.step,
        lora=p.lora,
        created_at=time.time(),
        base_version=p.base_version,
    )


class RecordingSender(WeightSender):
    """A transport that keeps what it is given (in-process; no store, no broker)."""

    method = "test"

    def __init__(self, full_next: bool = False) -> None:
        self.sent: list[Payload] = []
        self.full_next = full_next

    async def send(self, make, announce):
        payload = make(self.full_next)
        self.sent.append(payload)
        event = _event(payload)
        await announce(event)
        return event


def _publish(publisher: VersionPublisher, steps: list[int]) -> list[int]:
    async def go():
        return [(await publisher.publish(s)).version for s in steps]

    return asyncio.run(go())


async def _announce(event) -> None:
    pass


def test_versions_only_grow_from_the_step_the_floor_and_the_last():
    sender = RecordingSender()
    publisher = VersionPublisher(ModelWeights(_model(False), False), sender, _announce, Counters())
    assert _publish(publisher, [0, 1, 1, 5]) == [0, 1, 2, 5]
    # a trainer resumed from step 3 of a run that already announced version 7
    publisher.resume(version=3, floor=7)
    assert _publish(publisher, [3, 4, 9]) == [8, 9, 10]
    assert all(not p.lora and p.base_version == p.version for p in sender.sent)


def test_a_lora_run_sends_the_base_once_then_adapters_unless_the_transport_asks():
    model = _model(True)
    sender = RecordingSender()
    weights = ModelWeights(model, True)
    publisher = VersionPublisher(weights, sender, _announce, Counters())
    _publish(publisher, [0, 1])
    sender.full_next = True  # e.g. a new broadcast group
    _publish(publisher, [2])
    sender.full_next = False
    _publish(publisher, [3])
    kinds = [(p.version, p.lora, p.base_version) for p in sender.sent]
    assert kinds == [(0, False, 0), (1, True, 0), (2, False, 2), (3, True, 2)]
    adapter, full = sender.sent[1], sender.sent[0]
    assert all(".lora_" in k for k in adapter.tensors)
    assert "adapter_config.json" in adapter.extra_files
    assert sum(t.numel() for t in adapter.tensors.values()) < sum(
        t.numel() for t in full.tensors.values()
    )


def test_an_explorer_applies_the_base_then_the_adapter():
    trainer_model, explorer_model = _model(True), _model(True)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(0.5)
    sent = ModelWeights(trainer_model, True)
    full = sent.payload(0, 0)  # the first of a process is full
    adapter = sent.payload(1, 1)
    got = ModelWeights(explorer_model, True)
    assert got.needs_base(_event(adapter)) and not got.needs_base(_event(full))
    like = got.template(_event(adapter))
    assert {k: v.shape for k, v in like.items()} == {k: v.shape for k, v in adapter.tensors.items()}
    got.apply(_event(full), full.tensors)
    assert got.base_version == 0 and not got.needs_base(_event(adapter))
    got.apply(_event(adapter), adapter.tensors)
    assert got.base_version == 0  # an adapter does not change the base
    for (name, a), b in zip(
        trainer_model.state_dict().items(), explorer_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_versions_are_applied_one_at_a_time():
    """A partial rollout's refresh between two turns and the next step's sync point may
    ask at once: the second waits for the first, then chooses again (here: nothing left,
    the version is held)."""
    follower = WeightFollower.__new__(WeightFollower)
    follower._applying = asyncio.Lock()
    follower.version = 3
    loads, inside = [], []

    async def alone(plan, moved) -> bool:
        inside.append(1)
        assert len(inside) == 1  # never two at once
        if follower.version < 4:  # chooses against the version held now
            await asyncio.sleep(0.05)
            follower.version = 4
            loads.append(4)
        inside.pop()
        return True

    follower._apply_chosen_alone = alone

    async def both() -> list[bool]:
        return list(await asyncio.gather(follower.apply_newest(), follower.apply_newest()))

    assert asyncio.run(both()) == [True, True]
    assert loads == [4]
