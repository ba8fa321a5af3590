"""The trainer's version publisher sends in the background: ``submit`` returns once the
weights are copied out of the model, a slower transport never holds the trainer, a version
waiting behind another is replaced by a newer one (never announced), a failed send reaches
the trainer's loop, and the snapshot buffers are reused."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from streamrft.infra.bus import Counters
from streamrft.schemas.errors import ServiceError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.lora import adapter_state_dict
from streamrft.sync.payload import ModelWeights
from streamrft.sync.publisher import VersionPublisher
from streamrft.sync.transport import Payload, WeightSender
from streamrft.sync.weights import unique_state_dict
from tests.unit.test_weight_follower_rules import _event, _model

pytestmark = pytest.mark.unit


class SlowSender(WeightSender):
    """A transport that takes ``seconds`` per version (its bytes are "durable" when the
    wait ends, then it announces), keeping a copy of every payload it was given."""

    method = "test"

    def __init__(self, seconds: float, fail_at: int = -1) -> None:
        self.seconds = seconds
        self.fail_at = fail_at
        self.sent: list[Payload] = []
        self.copies: list[dict[str, torch.Tensor]] = []
        self.durable: dict[int, float] = {}
        self.buffers: set[int] = set()

    async def send(self, make, announce):
        payload = await asyncio.to_thread(make, False)
        if payload.version == self.fail_at:
            raise ServiceError(f"store down past the outage timeout (version {payload.version})")
        await asyncio.sleep(self.seconds)
        self.copies.append({k: v.clone() for k, v in payload.tensors.items()})
        self.buffers.update(t.untyped_storage().data_ptr() for t in payload.tensors.values())
        self.sent.append(payload)
        self.durable[payload.version] = time.monotonic()
        event = _event(payload)
        await announce(event)
        return event


def _train(model: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_a_slow_transport_never_holds_the_trainer_and_sends_what_was_submitted():
    model = _model(False)
    sender = SlowSender(0.3)
    announced: list[tuple[ModelVersionReady, float]] = []

    async def announce(event):
        announced.append((event, time.monotonic()))

    counters = Counters()
    publisher = VersionPublisher(ModelWeights(model, False), sender, announce, counters)
    expected: dict[int, dict[str, torch.Tensor]] = {}

    async def trainer() -> tuple[list[float], list[int]]:
        blocked, behind = [], []
        for step in range(6):
            t0 = time.perf_counter()
            version = await publisher.submit(step)
            blocked.append(time.perf_counter() - t0)
            behind.append(version - publisher.announced)
            expected[version] = {k: v.clone() for k, v in unique_state_dict(model).items()}
            _train(model, 0.5)  # the next step changes the weights at once
            await asyncio.sleep(0.05)  # a step far shorter than a send
        await publisher.drain()
        await publisher.aclose()
        return blocked, behind

    blocked, behind = asyncio.run(trainer())
    # submit returned before its version was sent: the trainer waits for the copy only
    assert all(b > 0 for b in behind), behind
    assert 0 < counters["publish_blocked_seconds"] <= sum(blocked)
    versions = [e.version for e, _ in announced]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 5
    # versions that waited behind a send were replaced by newer ones, never announced
    assert len(versions) < 6
    assert counters["versions_replaced"] == 6 - len(versions)
    assert counters["versions_published"] == len(versions)
    for (event, at), payload, copy in zip(announced, sender.sent, sender.copies, strict=True):
        assert at >= sender.durable[event.version]  # announced only once its bytes are
        assert payload.version == event.version
        for name, tensor in copy.items():  # the weights as they were when submitted
            assert torch.equal(tensor, expected[event.version][name]), (event.version, name)
    # two sets of snapshot buffers in all, reused version after version
    tensors_per_version = len(sender.copies[0])
    assert len(sender.buffers) <= 2 * tensors_per_version


def test_a_failed_send_reaches_the_trainer_at_its_next_call():
    model = _model(False)
    publisher = VersionPublisher(
        ModelWeights(model, False), SlowSender(0.01, fail_at=1), _quiet, Counters()
    )

    async def trainer():
        assert (await publisher.publish(0)).version == 0
        await publisher.submit(1)  # accepted: the send fails in the background
        with pytest.raises(ServiceError, match="version 1"):
            await publisher.drain()
        with pytest.raises(ServiceError):
            await publisher.submit(2)
        with pytest.raises(ServiceError):
            publisher.check()
        await publisher.aclose()

    asyncio.run(trainer())
    assert publisher.announced == 0


def test_wait_returns_the_version_that_replaced_the_one_asked_for():
    model = _model(False)
    sender = SlowSender(0.2)
    publisher = VersionPublisher(ModelWeights(model, False), sender, _quiet, Counters())

    async def trainer():
        await publisher.submit(0)
        await publisher.submit(1)  # waits behind 0
        await publisher.submit(2)  # replaces 1
        event = await publisher.wait(1)
        await publisher.aclose()
        return event

    event = asyncio.run(trainer())
    assert event.version == 2
    assert [p.version for p in sender.sent] == [0, 2]


def test_a_lora_snapshot_holds_the_adapter_as_it_was():
    model = _model(True)
    sender = SlowSender(0.05)
    weights = ModelWeights(model, True)
    publisher = VersionPublisher(weights, sender, _quiet, Counters())

    async def trainer():
        await publisher.publish(0)  # the base, full
        await publisher.submit(1)
        adapter = {k: v.detach().clone() for k, v in adapter_state_dict(model).items()}
        _train(model, 1.0)
        await publisher.drain()
        await publisher.aclose()
        return adapter

    adapter = asyncio.run(trainer())
    sent = sender.sent[1]
    assert sent.lora and sent.base_version == 0
    assert "adapter_config.json" in sent.extra_files
    assert sent.tensors.keys() == adapter.keys()
    for name, tensor in sent.tensors.items():  # the adapter before the step after submit
        assert torch.equal(tensor, adapter[name]), name
    assert not torch.equal(adapter_state_dict(model)[name], adapter[name])


async def _quiet(event) -> None:
    pass


def test_a_version_waiting_behind_a_send_is_never_sent_while_a_newer_one_overwrites_it():
    """Version 1 waits behind version 0; version 2's snapshot (slow) reuses version 1's
    buffers, and version 0's send ends while it copies: the worker must not take version 1
    then (its buffers are being overwritten), and every version sent holds its own
    weights."""

    class SlowSnapshot(ModelWeights):
        def snapshot(self, into=None):
            frozen = super().snapshot(into)
            if into is not None:  # a copy into reused buffers that takes a while
                time.sleep(0.5)
            return frozen

    model = _model(False)
    sender = SlowSender(0.3)
    publisher = VersionPublisher(SlowSnapshot(model, False), sender, _quiet, Counters())

    def fill(value: float) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)

    async def trainer():
        for v in range(3):
            fill(float(v))
            await publisher.submit(v)
        await publisher.drain()
        await publisher.aclose()

    asyncio.run(trainer())
    sent = [p.version for p in sender.sent]
    assert sent[0] == 0 and sent[-1] == 2
    for version, copy in zip(sent, sender.copies, strict=True):
        floats = [t for t in copy.values() if t.is_floating_point()]
        assert all(torch.all(t == float(version)) for t in floats), version


def test_a_lora_runs_full_version_holds_the_adapter_as_it_was_at_the_snapshot():
    """A LoRA run's full version (its base, with the adapter in it) is made in the
    background; the adapter part comes from the snapshot, not from the live model the next
    step is already training."""

    class LateMaker(SlowSender):
        async def send(self, make, announce):
            await asyncio.sleep(0.2)  # the trainer trains meanwhile
            return await super().send(make, announce)

    model = _model(True)
    sender = LateMaker(0.0)
    publisher = VersionPublisher(ModelWeights(model, True), sender, _quiet, Counters())

    async def trainer():
        await publisher.submit(0)
        before = {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}
        _train(model, 1.0)
        await publisher.drain()
        await publisher.aclose()
        return before

    before = asyncio.run(trainer())
    full = sender.copies[0]
    assert not sender.sent[0].lora and before
    for name, tensor in before.items():
        assert torch.equal(full[name], tensor), name
