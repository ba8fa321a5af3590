"""Delta versions through the real broker and a real store: the trainer's publisher and live
explorers, bf16 weights; an explorer that missed versions, one that joined late, a base that
is not what the trainer had, and a delta corrupted in the store."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch

from streamrft.infra.bus import Counters, EventSender
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.sync import delta
from streamrft.sync.follower import Synced
from streamrft.sync.payload import DeltaPolicy, ModelWeights
from streamrft.sync.publisher import VersionPublisher
from streamrft.sync.transport import SenderContext, make_sender
from tests.integration.test_weight_sync import _tamper

pytestmark = pytest.mark.integration

FULL_EVERY = 3


@contextlib.asynccontextmanager
async def _trainer(cfg):
    """The trainer's event sender and a publisher of bf16 versions (``delta: always``)."""
    from streamrft.infra import admin

    await admin.ensure_topics(cfg.kafka, cfg.topics())
    tok = build_char_tokenizer(cfg.model.charset)
    model = build_tiny_model(cfg.model, tok).float()  # float32 master weights
    events = EventSender(cfg, "trainer", "trainer")
    await events.start()
    policy = DeltaPolicy.from_config(cfg.synchronizer, lora=False)
    assert policy is not None and policy.always
    weights = ModelWeights(model, False, torch.bfloat16, delta=policy)
    sender = make_sender(cfg, SenderContext(Counters(), lambda: []))
    publisher = VersionPublisher(weights, sender, events.control, Counters())
    try:
        yield model, tok, publisher
    finally:
        publisher.close()
        await events.stop()


@contextlib.asynccontextmanager
async def _explorer(cfg, index: int):
    from streamrft.producers.explorer import Explorer

    explorer = Explorer(cfg, index)
    await explorer.events.start()
    await explorer.view.start()
    try:
        yield explorer
    finally:
        await explorer.view.stop()
        await explorer.events.stop()


def _train(model: torch.nn.Module, tok) -> None:
    """A real optimizer step with a small learning rate: some bf16 elements change."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.tensor([tok.encode("3+4=7 2+2=4 9+0=9")])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _assert_holds(explorer, model: torch.nn.Module) -> None:
    """The explorer's weights are the trainer's, cast to bf16, bit for bit."""
    own = explorer.engine.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert own[name].dtype == torch.bfloat16
        assert torch.equal(own[name], tensor.detach().to(torch.bfloat16)), name


async def _sync(explorer, version: int) -> None:
    view = explorer.view
    await view.wait_until(lambda: version in view.versions, 30, asyncio.Event(), f"v{version}")
    assert await explorer.follower.sync_point(version, version) is Synced.READY


def _tamper_any(cfg, event) -> None:
    if event.method == "object_store":
        _tamper(cfg, event)
        return
    folder = Path(event.uri.removeprefix("file://")).parent
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("method", ["object_store", "filesystem"])
def test_explorers_rebuild_deltas_exactly_and_recover_from_bad_ones(make_config, method, tmp_path):
    cfg = make_config(
        model={"dtype": "bfloat16"},
        synchronizer={
            "method": method,
            "fs_dir": str(tmp_path / "versions"),
            "style": "dynamic_by_trainer",
            "delta": "always",
            "full_every": FULL_EVERY,
        },
        trainer={"max_staleness": 100},
    )

    async def scenario():
        async with _trainer(cfg) as (model, tok, publisher), _explorer(cfg, 0) as first:
            events = [await publisher.publish(0)]
            await _sync(first, 0)
            _assert_holds(first, model)
            for v in (1, 2, 3):  # three deltas, each on the version before
                _train(model, tok)
                events.append(await publisher.publish(v))
                if v != 2:  # the first explorer misses version 2
                    await _sync(first, v)
                    _assert_holds(first, model)
            assert [e.delta_base for e in events] == [-1, 0, 1, 2]
            full_bytes = events[0].bytes
            assert all(0 < e.bytes < full_bytes / 2 for e in events[1:]), [e.bytes for e in events]
            assert first.counters.get("delta_refetches") == 0

            async with _explorer(cfg, 1) as late:  # joins at version 3: 0 then 1, 2, 3
                await _sync(late, 3)
                _assert_holds(late, model)
                assert late.counters["versions_applied"] == 1

            _train(model, tok)
            events.append(await publisher.publish(4))
            assert events[4].delta_base == -1  # after FULL_EVERY deltas, a full version
            await _sync(first, 4)

            # a base that is not what the trainer had: the check fails, a full fetch heals
            _train(model, tok)
            events.append(await publisher.publish(5))
            held = first.follower.weights.held
            norm = next(k for k in held if "norm" in k)  # at 1.0: lr 1e-5 moves no bf16 bit
            with torch.no_grad():
                held[norm].view(-1)[0] += 1
            await _sync(first, 5)
            _assert_holds(first, model)
            assert first.counters["delta_refetches"] == 1
            assert first.counters.get("versions_rejected") == 0

            # a delta corrupted in the store: rejected (and the next delta, built on it),
            # the explorer stays on version 5 until the next full version
            held = {k: v.clone() for k, v in first.engine.model.state_dict().items()}
            bytes_before_6 = first.counters["delta_bytes"]
            for v in (6, 7, 8):
                _train(model, tok)
                events.append(await publisher.publish(v))
                if v == 6:
                    _tamper_any(cfg, events[6])
                if v < 8:
                    await _sync(first, v)
                    assert first.follower.version == 5
            assert first.counters["versions_rejected"] == 2
            # ...each at once: a delta that fails its own check is in every chain from a
            # full version too, so nothing more is fetched for it (no refetch from the full
            # version; version 7, built on rejected 6, fetches nothing)
            assert first.counters["delta_refetches"] == 1
            assert first.counters["delta_bytes"] == bytes_before_6
            for name, tensor in first.engine.model.state_dict().items():
                assert torch.equal(tensor, held[name]), name
            assert events[8].delta_base == -1
            await _sync(first, 8)
            assert first.follower.version == 8
            _assert_holds(first, model)
            # every version carried its state's digest: the trainer's bf16 weights
            truth = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
            truth = {k: truth[k] for k in first.follower.weights.held}
            assert events[8].state_sha256 == delta.state_sha256(truth)

    asyncio.run(scenario())
