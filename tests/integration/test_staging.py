"""In-flight receive (``synchronizer.staging``) with the real broker and store: a version is
received and verified in the background while the explorer holds the weights it has, and
the sync point only applies it; through every transport (shared memory, object store,
folder, delta versions, LoRA adapters with their base, the gloo broadcast); a batch that
needs the version being received waits for what is left and gets exactly it; a newer
announcement supersedes a staged version; an older version chosen replaces it; a staged
version that fails verification is rejected as at a sync point; ``staging: none`` receives
at the sync point."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from streamrft.infra.bus import Counters
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import METRICS
from streamrft.schemas.events import VersionsRetired
from streamrft.sync.follower import Synced
from streamrft.sync.lora import attach_lora
from streamrft.sync.payload import ModelWeights
from streamrft.sync.publisher import VersionPublisher
from streamrft.sync.staging import Stage
from streamrft.sync.transport import SenderContext, make_sender
from tests.integration.test_delta_sync import _assert_holds, _train
from tests.integration.test_delta_sync import _trainer as _delta_trainer
from tests.integration.test_shared_sync import _holds, _step, _trainer
from tests.integration.test_weight_sync import _tamper

pytestmark = pytest.mark.integration

WAIT_S = 60.0


@contextlib.asynccontextmanager
async def _explorer(cfg, index: int = 0):
    """A live explorer (events, control view) whose follower stages from the start, as
    ``Explorer._start`` has it."""
    from streamrft.producers.explorer import Explorer

    explorer = Explorer(cfg, index)
    await explorer.events.start()
    await explorer.view.start()
    explorer.follower.start_staging()
    try:
        yield explorer
    finally:
        explorer.follower.close()
        await explorer.view.stop()
        await explorer.events.stop()


async def _until(explorer, ready, what: str) -> None:
    """Wait for a state of the explorer (re-checked on every control event, at least every
    half second)."""
    assert await explorer.view.wait_until(ready, WAIT_S, asyncio.Event(), what)


async def _staged(explorer, version: int) -> None:
    stager = explorer.follower.stager
    await _until(explorer, lambda: stager.staged_version == version, f"v{version} staged")


async def _on_version_0(explorer, publisher) -> float:
    """Publish version 0 and sync to it; the receives at sync points so far (version 0 may
    be received at its sync point, when that asks before the background does)."""
    await publisher.publish(0)
    assert await explorer.follower.sync_point(0, 0) is Synced.READY
    return explorer.counters.get("sync_point_receives")


def _weights(explorer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in explorer.engine.model.state_dict().items()}


def _same(explorer, weights: dict[str, torch.Tensor]) -> bool:
    own = explorer.engine.model.state_dict()
    return all(torch.equal(own[k], v) for k, v in weights.items())


def _config(make_config, tmp_path, method: str, **sync):
    return make_config(
        synchronizer={
            "method": method,
            "fs_dir": str(tmp_path / "versions"),
            "style": "dynamic_by_trainer",
            **sync,
        },
        trainer={"max_staleness": 100},
    )


@pytest.mark.parametrize("method", ["shared", "object_store", "filesystem", "auto"])
def test_a_version_announced_while_sampling_is_staged_and_only_applied_at_the_sync_point(
    make_config, tmp_path, method
):
    cfg = _config(make_config, tmp_path, method)

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            at_sync = await _on_version_0(explorer, publisher)
            follower.take_times()
            for v in (1, 2):
                held = _weights(explorer)
                _step(model, 0.01)
                await publisher.publish(v)
                await _staged(explorer, v)  # received and verified in the background...
                assert follower.version == v - 1 and _same(explorer, held)  # ...not applied
                assert await follower.sync_point(v, v) is Synced.READY
                assert follower.version == v and _holds(explorer, model)
            assert explorer.counters.get("sync_point_receives") == at_sync  # none received there
            assert explorer.counters["versions_staged"] >= 2
            times = follower.take_times()
            assert times.receive_s > 0 and times.apply_s > 0
            assert times.sync_wait_s >= times.apply_s and times.version_wait_s == 0
            assert explorer.counters["receive_seconds"] >= times.receive_s
            assert explorer.counters["sync_seconds"] >= times.receive_s + times.apply_s
            assert follower.stager.area.lent() == frozenset()  # nothing staged now
            # the step's report carries the times, by the names readers use
            follower.take_times()
            _step(model, 0.01)
            await publisher.publish(3)
            await _staged(explorer, 3)
            assert await follower.sync_point(3, 3) is Synced.READY
            await explorer.report([], 1.0)
        return explorer

    explorer = asyncio.run(scenario())
    metrics = asyncio.run(read_history(cfg.kafka, cfg.topics().metrics, METRICS, "staging-m"))
    values = [m.values for m in metrics if m.component == explorer.name][-1]
    assert values["explorer/receive_s"] > 0 and values["explorer/apply_s"] > 0
    assert values["explorer/sync_wait_s"] >= values["explorer/apply_s"]
    assert values["explorer/version_wait_s"] == 0


@pytest.mark.parametrize("method", ["object_store", "filesystem"])
def test_a_delta_is_rebuilt_in_staging_and_checked_before_the_sync_point(
    make_config, tmp_path, method
):
    cfg = make_config(
        model={"dtype": "bfloat16"},
        synchronizer={
            "method": method,
            "fs_dir": str(tmp_path / "versions"),
            "style": "dynamic_by_trainer",
            "delta": "always",
            "full_every": 3,
        },
        trainer={"max_staleness": 100},
    )

    async def scenario():
        async with _delta_trainer(cfg) as (model, tok, publisher), _explorer(cfg) as explorer:
            follower = explorer.follower
            at_sync = await _on_version_0(explorer, publisher)
            for v in (1, 2):
                _train(model, tok)
                event = await publisher.publish(v)
                assert event.delta_base == v - 1
                await _staged(explorer, v)
                assert follower.version == v - 1
                assert await follower.sync_point(v, v) is Synced.READY
                _assert_holds(explorer, model)
            assert explorer.counters.get("sync_point_receives") == at_sync
            assert explorer.counters["delta_bytes"] > 0
            assert explorer.counters.get("delta_refetches") == 0
            # the state kept to rebuild the next delta on is the one applied, bit for bit
            own = explorer.engine.model.state_dict()
            assert all(torch.equal(own[k], t) for k, t in follower.weights.held.items())

    asyncio.run(scenario())


def test_a_delta_retired_while_it_is_rebuilt_in_the_background_is_no_failure(make_config, tmp_path):
    """A delta version retired (``VersionsRetired``) while the stager's thread is about to
    rebuild it: the version is gone, nothing is wrong with it; neither a rejection nor an
    error of the explorer (its receive raised KeyError, which the next sync point raised),
    and the sync point takes the version after it."""
    cfg = make_config(
        model={"dtype": "bfloat16"},
        synchronizer={
            "method": "object_store",
            "style": "dynamic_by_trainer",
            "delta": "always",
            "full_every": 1,  # version 1 a delta, version 2 full: it needs nothing retired
        },
        trainer={"max_staleness": 100},
    )

    async def scenario():
        async with _delta_trainer(cfg) as (model, tok, publisher), _explorer(cfg) as explorer:
            follower = explorer.follower
            await _on_version_0(explorer, publisher)
            rebuilt, entered, open_ = follower._rebuilt, threading.Event(), threading.Event()

            def gated(event):  # the stager's rebuild of version 1, held at its start
                if event.version == 1:
                    entered.set()
                    assert open_.wait(WAIT_S), "the gate was never opened"
                return rebuilt(event)

            follower._rebuilt = gated
            try:
                _train(model, tok)
                assert (await publisher.publish(1)).delta_base == 0
                assert await asyncio.to_thread(entered.wait, WAIT_S)
                _train(model, tok)
                assert (await publisher.publish(2)).delta_base < 0
                await explorer.events.control(VersionsRetired(versions=[1]))
                await _until(explorer, lambda: 1 not in explorer.view.versions, "v1 retired")
            finally:
                open_.set()
            assert await follower.sync_point(2, 2) is Synced.READY
            assert follower.version == 2
            _assert_holds(explorer, model)
            assert follower.rejected == set() and not explorer.events.rejections
            assert explorer.counters.get("versions_rejected") == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("method", ["shared", "object_store"])
def test_an_adapter_is_staged_with_the_base_the_model_lacks(make_config, tmp_path, method):
    cfg = make_config(
        synchronizer={"method": method, "style": "dynamic_by_trainer"},
        model={"lora": {"enabled": True, "rank": 2}},
        trainer={"max_staleness": 100},
    )

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _):
            model = attach_lora(model, cfg.model.lora)
            publisher.weights = ModelWeights(model, True)
            await publisher.publish(0)  # the base
            for v in (1, 2, 3):
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if ".lora_" in name:
                            p.add_(0.1)
                event = await publisher.publish(v)
                assert event.lora and event.base_version == 0
            async with _explorer(cfg) as late:  # joins at version 3: the base comes with it
                await _staged(late, 3)
                assert late.follower.stager.area.lent() == {"version", "base"}
                assert late.follower.version == -1
                assert await late.follower.sync_point(3, 3) is Synced.READY
                assert late.counters.get("sync_point_receives") == 0
                assert late.follower.weights.base_version == 0
                own = late.engine.model.state_dict()
                for name, tensor in model.state_dict().items():
                    assert torch.equal(own[name], tensor), name
                assert late.follower.stager.area.lent() == frozenset()

    asyncio.run(scenario())


def test_a_broadcast_is_received_into_staging_when_its_group_runs(make_config):
    """The gloo broadcast waits for every member: the stager joins it in the background, and
    the sync point applies what it received."""
    cfg = make_config(
        synchronizer={"method": "nccl", "style": "dynamic_by_trainer", "sync_timeout": 60},
        trainer={"max_staleness": 100},
    )

    async def scenario():
        from streamrft.infra import admin
        from streamrft.infra.bus import EventSender
        from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model

        await admin.ensure_topics(cfg.kafka, cfg.topics())
        model = build_tiny_model(cfg.model, build_char_tokenizer(cfg.model.charset))
        events = EventSender(cfg, "trainer", "trainer")
        await events.start()
        counters = Counters()
        async with _explorer(cfg) as explorer:
            sender = make_sender(cfg, SenderContext(counters, lambda: [explorer.name]))
            publisher = VersionPublisher(
                ModelWeights(model, False), sender, events.control, counters
            )
            try:
                follower = explorer.follower
                for v in (0, 1):
                    if v:
                        _step(model, 0.01)
                    event = await publisher.publish(v)  # returns once every member received
                    assert event.method == "nccl"
                    await _staged(explorer, v)
                    assert follower.version == v - 1  # received, not applied
                    assert await follower.sync_point(v, v) is Synced.READY
                    assert follower.version == v and _holds(explorer, model)
                assert counters["versions_broadcast"] == 2
                assert explorer.counters["versions_applied_nccl"] == 2
                assert explorer.counters.get("sync_point_receives") == 0
            finally:
                await publisher.aclose()
                await events.stop()

    asyncio.run(scenario())


class _Gate:
    """Holds a real receiver's receives (in the stager's thread) until opened."""

    def __init__(self, receiver) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        inner = receiver.receive_into

        def gated(event, like, stage):
            self.entered.set()
            assert self.open.wait(WAIT_S), "the gate was never opened"
            return inner(event, like, stage)

        receiver.receive_into = gated


def test_a_batch_that_needs_the_version_being_staged_waits_for_it_and_gets_exactly_it(
    make_config, tmp_path
):
    cfg = _config(make_config, tmp_path, "object_store", style="fixed", sync_offset=1)

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            first = await publisher.publish(0)
            assert await follower.sync_point(1, 0) is Synced.READY  # batch 1 needs version 0
            at_sync = explorer.counters.get("sync_point_receives")
            gate = _Gate(follower.receivers.for_event(first))
            follower.take_times()
            _step(model, 0.01)
            trained = {k: v.clone() for k, v in model.state_dict().items()}
            await publisher.publish(1)
            await _until(explorer, lambda: follower.stager.receiving == (1, False), "v1 in flight")
            sync = asyncio.create_task(follower.sync_point(2, 1))  # batch 2 needs version 1
            await _until(explorer, lambda: follower.stager.receiving == (1, True), "v1 waited")
            assert not sync.done() and follower.version == 0
            _step(model, 0.5)  # the trainer goes on: version 1 is what was trained by then
            await publisher.publish(2)
            gate.open.set()
            assert await sync is Synced.READY
            assert follower.version == 1  # exactly the version the batch needs, not 2
            own = explorer.engine.model.state_dict()
            assert all(torch.equal(own[k], v) for k, v in trained.items())
            assert explorer.counters.get("sync_point_receives") == at_sync  # only waited for it
            times = follower.take_times()
            assert times.sync_wait_s > times.apply_s > 0

    asyncio.run(scenario())


def test_a_newer_announcement_supersedes_a_staged_version(make_config, tmp_path):
    cfg = _config(make_config, tmp_path, "shared")

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            at_sync = await _on_version_0(explorer, publisher)
            _step(model, 0.01)
            await publisher.publish(1)
            await _staged(explorer, 1)
            _step(model, 0.01)
            await publisher.publish(2)
            await _staged(explorer, 2)
            assert explorer.counters["versions_superseded"] == 1
            assert follower.stager.area.lent() == {"version"}  # one staged version at a time
            assert follower.version == 0
            assert await follower.sync_point(2, 2) is Synced.READY
            assert follower.version == 2 and _holds(explorer, model)
            assert explorer.counters.get("versions_applied_shared") == 2  # 0, then 2: never 1
            assert explorer.counters.get("sync_point_receives") == at_sync

    asyncio.run(scenario())


def test_an_older_version_chosen_replaces_the_staged_one_which_is_staged_again(
    make_config, tmp_path
):
    """An evaluator's choice (or a batch that needs an older version) of a version other
    than the one staged: that one is received and applied, the newer one staged again."""
    cfg = _config(make_config, tmp_path, "object_store")

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            at_sync = await _on_version_0(explorer, publisher)
            _step(model, 0.01)
            one = {k: v.clone() for k, v in model.state_dict().items()}
            await publisher.publish(1)
            _step(model, 0.01)
            await publisher.publish(2)
            await _staged(explorer, 2)
            assert await follower.apply_version(1)
            assert follower.version == 1
            own = explorer.engine.model.state_dict()
            assert all(torch.equal(own[k], v) for k, v in one.items())
            assert explorer.counters["sync_point_receives"] == at_sync + 1
            await _staged(explorer, 2)  # the newest usable one, wanted again
            assert await follower.sync_point(2, 2) is Synced.READY
            assert follower.version == 2 and _holds(explorer, model)
            assert explorer.counters["sync_point_receives"] == at_sync + 1

    asyncio.run(scenario())


def test_a_staged_version_that_fails_verification_is_rejected_as_at_a_sync_point(
    make_config, tmp_path
):
    cfg = _config(make_config, tmp_path, "object_store")

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            at_sync = await _on_version_0(explorer, publisher)
            held = _weights(explorer)
            gate = _Gate(follower.receivers.for_event(publisher.last_event))
            _step(model, 0.01)
            bad = await publisher.publish(1)
            _tamper(cfg, bad)
            gate.open.set()
            await _until(
                explorer, lambda: explorer.counters.get("versions_rejected") == 1, "rejected"
            )
            (rejection,) = explorer.events.rejections
            assert rejection.version == 1 and rejection.kind == "integrity"
            assert "sha256" in rejection.reason
            assert await follower.sync_point(1, 1) is Synced.READY
            assert follower.version == 0 and _same(explorer, held)  # never tried again
            assert explorer.counters["versions_rejected"] == 1
            assert explorer.counters.get("sync_point_receives") == at_sync
            _step(model, 0.01)
            await publisher.publish(2)
            await _staged(explorer, 2)
            assert await follower.sync_point(2, 2) is Synced.READY
            assert follower.version == 2 and _holds(explorer, model)

    asyncio.run(scenario())


def test_a_version_memory_cannot_hold_now_is_tried_again_never_rejected(
    make_config, tmp_path, monkeypatch
):
    """No memory for a version's staging copy (of the size this model's versions have: the
    allocator fails): not the version's fault. The explorer keeps its weights (counter
    ``versions_out_of_memory``), in the background and at a sync point, and loads the version
    once memory is there; never a rejection (one is remembered across restarts)."""
    cfg = _config(make_config, tmp_path, "shared")
    host_bytes, short = Stage.host_bytes, [1, 1]  # memory is short for two allocations

    def scarce(stage, nbytes):
        if short:  # more than any machine has: the allocator's own failure
            short.pop()
            nbytes = 1 << 55
        return host_bytes(stage, nbytes)

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower, counters = explorer.follower, explorer.counters
            await _on_version_0(explorer, publisher)
            held = _weights(explorer)
            monkeypatch.setattr(Stage, "host_bytes", scarce)
            _step(model, 0.01)
            await publisher.publish(1)
            failures = ("versions_out_of_memory", "versions_rejected")
            await _until(
                explorer,
                lambda: sum(map(counters.get, failures)) >= 1,
                "v1 failed in the background",
            )
            assert counters.get("versions_rejected") == 0
            assert await follower.sync_point(1, 1) is Synced.READY  # received there: short
            assert follower.version == 0 and _same(explorer, held)
            assert counters.get("versions_out_of_memory") == 2 and not short
            assert await follower.sync_point(1, 1) is Synced.READY
            assert follower.version == 1 and _holds(explorer, model)
            assert follower.rejected == set() and not explorer.events.rejections
            assert counters.get("versions_rejected") == 0

    asyncio.run(scenario())


def test_staging_none_receives_at_the_sync_point(make_config, tmp_path):
    cfg = _config(make_config, tmp_path, "shared", staging="none")

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            assert follower.stager is None
            await publisher.publish(0)
            assert await follower.sync_point(0, 0) is Synced.READY
            received = explorer.counters["receive_seconds"]
            _step(model, 0.01)
            await publisher.publish(1)
            await _until(explorer, lambda: 1 in explorer.view.versions, "v1 announced")
            assert explorer.counters["receive_seconds"] == received  # nothing in the background
            follower.take_times()
            assert await follower.sync_point(1, 1) is Synced.READY
            assert follower.version == 1 and _holds(explorer, model)
            assert explorer.counters["receive_seconds"] > received
            times = follower.take_times()
            assert times.sync_wait_s >= times.receive_s + times.apply_s
            assert times.receive_s > 0
            assert explorer.counters.get("versions_staged") == 0

    asyncio.run(scenario())


def test_a_sync_point_stopped_while_it_waits_leaves_the_version_staged(make_config, tmp_path):
    """A sync point cancelled (a stop) while it waits for the receive under way: the receive
    goes on, its version is staged, and the next sync point applies it without a receive."""
    cfg = _config(make_config, tmp_path, "object_store")

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            at_sync = await _on_version_0(explorer, publisher)
            gate = _Gate(follower.receivers.for_event(publisher.last_event))
            _step(model, 0.01)
            await publisher.publish(1)
            await _until(explorer, lambda: follower.stager.receiving == (1, False), "v1 in flight")
            sync = asyncio.create_task(follower.sync_point(1, 1))
            await _until(explorer, lambda: follower.stager.receiving == (1, True), "v1 waited")
            sync.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sync
            assert follower.version == 0
            gate.open.set()
            await _staged(explorer, 1)
            assert await follower.sync_point(1, 1) is Synced.READY
            assert follower.version == 1 and _holds(explorer, model)
            assert explorer.counters.get("sync_point_receives") == at_sync
            assert follower.stager.area.lent() == frozenset()

    asyncio.run(scenario())


def test_a_sync_point_cancelled_while_the_version_is_copied_in_keeps_its_stage_until_done(
    make_config, tmp_path
):
    """A sync point cancelled (a partial rollout's refresh that timed out, a stop) while the
    staged version is copied into the model: the copy cannot be stopped, so its staging
    memory stays lent (no receive reuses it) until the copy ends, and the version it applied
    is the one the follower says it holds."""
    cfg = _config(make_config, tmp_path, "shared")

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg) as explorer:
            follower = explorer.follower
            await _on_version_0(explorer, publisher)
            _step(model, 0.01)
            await publisher.publish(1)
            await _staged(explorer, 1)
            engine = explorer.engine.engine
            copy_in, entered, open_ = engine.load_weights, threading.Event(), threading.Event()

            def gated(version, tensors):
                entered.set()
                assert open_.wait(WAIT_S), "the gate was never opened"
                copy_in(version, tensors)

            engine.load_weights = gated
            apply = asyncio.create_task(follower.apply_newest())
            assert await asyncio.to_thread(entered.wait, WAIT_S)
            apply.cancel()
            try:
                for _ in range(10):  # the cancellation reaches the sync point (loop turns)
                    await asyncio.sleep(0)
                assert follower.stager.area.lent() == {"version"}  # still read by the copy
                assert follower.stager.receiving is None  # and nothing is received into it
            finally:
                open_.set()
            with pytest.raises(asyncio.CancelledError):
                await apply
            assert follower.version == 1 and _holds(explorer, model)
            assert follower.stager.area.lent() == frozenset()

    asyncio.run(scenario())


def test_a_version_announced_while_a_receive_looks_up_an_adapters_base_is_no_rejection(
    make_config,
):
    """The background receive of an adapter looks up its base among the versions announced,
    in the stager's thread, while the event loop goes on reading the control topic: a
    version announced in the middle of that look-up leaves the adapter loadable (it was
    rejected for good, as if it had failed verification)."""
    cfg = make_config(
        synchronizer={"method": "object_store", "style": "dynamic_by_trainer"},
        model={"lora": {"enabled": True, "rank": 2}},
        trainer={"max_staleness": 100},
    )

    def adapter_step(model) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.add_(0.1)

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _):
            model = attach_lora(model, cfg.model.lora)
            publisher.weights = ModelWeights(model, True)
            await publisher.publish(0)  # the base
            adapter_step(model)
            await publisher.publish(1)
            async with _explorer(cfg) as late:  # its stager wants 1, which needs base 0
                receivers = late.follower.receivers
                can_load, entered, open_ = receivers.can_load, threading.Event(), threading.Event()

                def gated(event):  # the stager thread's look-up, held once in its middle
                    thread = threading.current_thread() is not threading.main_thread()
                    if thread and not entered.is_set():
                        entered.set()
                        assert open_.wait(WAIT_S), "the gate was never opened"
                    return can_load(event)

                receivers.can_load = gated
                try:
                    assert await asyncio.to_thread(entered.wait, WAIT_S)
                    adapter_step(model)
                    await publisher.publish(2)
                    await _until(late, lambda: 2 in late.view.versions, "v2 seen")
                finally:
                    open_.set()
                await _staged(late, 2)
                assert late.follower.rejected == set()
                assert late.counters.get("versions_rejected") == 0
                assert await late.follower.sync_point(2, 2) is Synced.READY
                assert late.follower.version == 2

    asyncio.run(scenario())


VERSIONS_COMING = 20
"""Versions published at most while serve is to move on (it does within a few)."""


def test_serve_applies_a_newer_version_while_newer_ones_keep_coming(make_config, tmp_path):
    """Serve mode receives versions in the background; when each receive takes longer than
    the trainer's step (it ends only once the next version is out), the stager is always
    receiving: serve still moves on to a newer version (it waited for a background receive
    to be over, which then never was)."""
    import time as clock

    from streamrft.producers.serving.server import Server
    from streamrft.schemas.events import ModelVersionReady

    cfg = _config(make_config, tmp_path, "object_store")

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _):
            server = Server(cfg)
            free = threading.Event()
            async with contextlib.AsyncExitStack() as stack:
                await server._start(stack)
                follow = None
                try:
                    any_version = ModelVersionReady(
                        version=0, method="object_store", uri="s3://b/k", manifest_sha256="0",
                        bytes=0, step=0, created_at=clock.time(),
                    )  # fmt: skip
                    receiver = server.follower.receivers.for_event(any_version)
                    inner = receiver.receive_into

                    def slow(event, like, stage):  # done once the next version is out
                        while event.version + 1 not in server.view.versions:
                            if free.wait(0.01):
                                break
                        return inner(event, like, stage)

                    receiver.receive_into = slow
                    stager = server.follower.stager
                    follow = asyncio.create_task(server._follow())
                    for v in range(VERSIONS_COMING):  # until serve holds one past the first
                        _step(model, 0.01)
                        await publisher.publish(v)
                        await _until(
                            server,
                            lambda v=v: stager.receiving is not None and stager.receiving[0] == v,
                            f"v{v} received",
                        )
                        if server.follower.version >= 1:
                            break
                    assert server.follower.version >= 1, "serve never moved past its first"
                finally:
                    free.set()
                    server.stop.set()
                    if follow is not None:
                        await follow

    asyncio.run(scenario())
