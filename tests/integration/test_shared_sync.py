"""Versions through shared memory (``synchronizer.method: shared`` and ``auto``) with the real
broker and store: live explorers on the trainer's host read ``/dev/shm``, one on another
host (another ``run.host_id``) reads the store copy; a corrupted or rewritten file is
rejected and the store copy taken; files a killed trainer left are removed at the next
start; sizes are checked before anything is allocated."""

from __future__ import annotations

import asyncio
import contextlib
import os

import msgspec
import pytest
import torch

from streamrft.infra.bus import Counters, EventSender
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas.errors import IntegrityError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.follower import Synced
from streamrft.sync.payload import ModelWeights
from streamrft.sync.publisher import VersionPublisher
from streamrft.sync.shared import SHM_DIR, SharedReceiver, SharedSender, file_prefix, parse_uri
from streamrft.sync.transport import Payload, SenderContext, make_sender
from streamrft.sync.weights import unique_state_dict
from tests.integration.test_delta_sync import _explorer

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def _trainer(cfg):
    """The trainer's event sender and publisher of ``synchronizer.method``."""
    from streamrft.infra import admin

    await admin.ensure_topics(cfg.kafka, cfg.topics())
    tok = build_char_tokenizer(cfg.model.charset)
    model = build_tiny_model(cfg.model, tok)
    events = EventSender(cfg, "trainer", "trainer")
    await events.start()
    counters = Counters()
    sender = make_sender(cfg, SenderContext(counters, lambda: []))
    publisher = VersionPublisher(ModelWeights(model, False), sender, events.control, counters)
    try:
        yield model, publisher, counters
    finally:
        await publisher.aclose()
        await events.stop()


def _step(model: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _holds(explorer, model: torch.nn.Module) -> bool:
    own = explorer.engine.model.state_dict()
    return all(torch.equal(own[n], t) for n, t in model.state_dict().items())


async def _sync(explorer, version: int, method: str | None = None) -> None:
    """Wait until ``version`` is announced (by ``method`` when given), then sync to it."""
    view = explorer.view

    def announced() -> bool:
        return any(method in (None, e.method) for e in view.announcements(version))

    await view.wait_until(announced, 30, asyncio.Event(), f"v{version} by {method}")
    assert await explorer.follower.sync_point(version, version) is Synced.READY
    assert explorer.follower.version == version


def _shm_files(cfg) -> list[str]:
    prefix = file_prefix(cfg.topics().run)
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))


def test_auto_serves_the_host_from_shared_memory_and_another_host_from_the_store(make_config):
    cfg = make_config(synchronizer={"method": "auto", "style": "dynamic_by_trainer"})
    remote_cfg = msgspec.structs.replace(
        cfg, run=msgspec.structs.replace(cfg.run, host_id="another-host")
    )

    async def scenario():
        async with (
            _trainer(cfg) as (model, publisher, counters),
            _explorer(cfg, 0) as local,
            _explorer(remote_cfg, 1) as remote,
        ):
            for v in range(4):
                if v:
                    _step(model, 0.01)
                event = await publisher.publish(v)
                assert event.method == "shared"  # announced as soon as it is in shared memory
                await _sync(local, v)
                assert _holds(local, model)
            await publisher.drain()  # the store lane has written the newest version
            last = publisher.announced
            await _sync(remote, last, "object_store")
            assert _holds(remote, model)
            methods = {e.method for e in local.view.announcements(last)}
            assert methods == {"shared", "object_store"}
            assert local.counters["versions_applied"] == 4
            assert local.counters["versions_applied_shared"] == 4  # never the store
            assert remote.counters["versions_applied"] == 1
            assert remote.counters["versions_applied_object_store"] == 1
            assert counters["store_copies"] >= 1
            assert len(_shm_files(cfg)) == 2  # two files, rewritten in turn
        assert _shm_files(cfg) == []  # removed when the trainer stops

    asyncio.run(scenario())


def test_an_explorer_unmaps_the_files_of_a_trainer_that_stopped_when_it_applies(make_config):
    """The trainer's files removed (it stopped): an explorer that goes on with store versions
    no longer keeps them mapped (their memory stayed allocated until its next shared-memory
    receive, which may never come) once it applies a version."""
    cfg = make_config(synchronizer={"method": "auto", "style": "dynamic_by_trainer"})

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg, 0) as explorer:
            first = await publisher.publish(0)
            await _sync(explorer, 0)
            receiver = explorer.follower.receivers.for_event(first)
            assert isinstance(receiver, SharedReceiver) and len(receiver._maps._maps) == 1
            _step(model, 0.01)
            await publisher.publish(1)
            await publisher.drain()  # and its store copy
            for name in _shm_files(cfg):
                os.unlink(os.path.join(SHM_DIR, name))  # as a stopping trainer does
            await _sync(explorer, 1)
            assert _holds(explorer, model)
            assert receiver._maps._maps == {}

    asyncio.run(scenario())


def test_a_corrupted_or_rewritten_file_is_rejected_and_the_store_copy_taken(make_config):
    cfg = make_config(synchronizer={"method": "auto", "style": "dynamic_by_trainer"})

    async def scenario():
        async with _trainer(cfg) as (model, publisher, _), _explorer(cfg, 0) as explorer:
            event = await publisher.publish(0)
            await publisher.drain()
            _, name = parse_uri(event.uri)
            with open(os.path.join(SHM_DIR, name), "r+b") as f:  # one flipped bit
                f.seek(-1, os.SEEK_END)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([byte ^ 1]))
            await _sync(explorer, 0)
            assert explorer.counters["versions_rejected"] == 1
            assert _holds(explorer, model)  # from the store copy
            # a reader that fell two versions behind finds its file rewritten
            stale = await publisher.publish(1)
            _step(model, 0.5)
            await publisher.publish(2)
            _step(model, 0.5)
            await publisher.publish(3)  # the same file as version 1
            reader = SharedReceiver(cfg)
            with pytest.raises(IntegrityError, match=r"rewritten|does not match"):
                reader.receive(stale, unique_state_dict(model))

    asyncio.run(scenario())


def test_a_restarted_trainer_removes_what_a_killed_one_left(make_config):
    cfg = make_config(synchronizer={"method": "shared"})
    prefix = file_prefix(cfg.topics().run)
    left = [os.path.join(SHM_DIR, f"{prefix}99999-{slot}") for slot in (0, 1)]
    for path in left:  # as a trainer killed with SIGKILL leaves them
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    others = [  # another run's files, also one whose id starts with this run's
        os.path.join(SHM_DIR, f"{file_prefix('another-run')}1-0"),
        os.path.join(SHM_DIR, f"{file_prefix(cfg.topics().run + '-v2')}1-0"),
    ]
    for path in others:
        with open(path, "wb") as f:
            f.write(b"y")
    try:
        sender = SharedSender(cfg)
        assert not any(os.path.exists(p) for p in left)
        assert all(os.path.exists(p) for p in others)  # not ours to remove
        sender.close()
    finally:
        for path in others:
            os.unlink(path)


def test_sizes_are_checked_before_anything_is_allocated(make_config):
    cfg = make_config(synchronizer={"method": "shared"})
    tok = build_char_tokenizer(cfg.model.charset)
    model = build_tiny_model(cfg.model, tok)
    sender = SharedSender(cfg)
    try:
        tensors = unique_state_dict(model)
        events: list[ModelVersionReady] = []

        async def announce(event):
            events.append(event)

        payload = Payload(0, 0, tensors, base_version=0)
        asyncio.run(sender.send(lambda _full: payload, announce))
        good = events[0]
        reader = SharedReceiver(cfg)
        got = reader.receive(good, tensors)
        assert all(torch.equal(got[n], t) for n, t in tensors.items())
        huge = msgspec.structs.replace(good, bytes=1 << 40)
        with pytest.raises(IntegrityError, match="refusing to allocate"):
            reader.receive(huge, tensors)
        short = msgspec.structs.replace(good, bytes=good.bytes - 8)
        with pytest.raises(IntegrityError, match="holds"):
            reader.receive(short, tensors)
        # another host's file is not loadable here, whatever its name
        elsewhere = msgspec.structs.replace(good, uri=good.uri.replace(reader.host, "elsewhere"))
        assert not reader.can_load(elsewhere) and reader.can_load(good)
        smaller = {n: t for n, t in list(tensors.items())[:-1]}
        with pytest.raises(IntegrityError, match="do not fit"):
            reader.receive(good, smaller | {"extra": torch.zeros(1 << 18)})
    finally:
        sender.close()


def test_a_model_of_many_small_tensors_fits_its_own_size_check(make_config):
    """The size allowed before allocation grows with the number of tensors (a header
    names each): 5,000 tensors with long names go through."""
    cfg = make_config(synchronizer={"method": "shared"})
    tensors = {
        f"model.layers.{i}.mlp.experts.{i % 128}.down_proj.weight": torch.randn(3)
        for i in range(5000)
    }
    sender = SharedSender(cfg)
    try:
        events: list[ModelVersionReady] = []

        async def announce(event):
            events.append(event)

        payload = Payload(0, 0, tensors, base_version=0)
        asyncio.run(sender.send(lambda _full: payload, announce))
        got = SharedReceiver(cfg).receive(events[0], tensors)
        assert all(torch.equal(got[n], t) for n, t in tensors.items())
    finally:
        sender.close()


def test_a_lora_run_keeps_its_base_in_shared_memory_for_late_joiners(make_config):
    """Adapters rotate through the two files; the base they apply on stays in a third, so
    an explorer that joins after several adapters builds base + adapter from shared memory."""
    cfg = make_config(
        synchronizer={"method": "shared", "style": "dynamic_by_trainer"},
        model={"lora": {"enabled": True, "rank": 2}},
    )

    async def scenario():
        from streamrft.sync.lora import attach_lora

        async with _trainer(cfg) as (model, publisher, _):
            model = attach_lora(model, cfg.model.lora)
            publisher.weights = ModelWeights(model, True)
            await publisher.publish(0)  # the base
            for v in (1, 2, 3):  # adapters, more than two: the base's file would be reused
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if ".lora_" in name:
                            p.add_(0.1)
                event = await publisher.publish(v)
                assert event.lora and event.base_version == 0
            async with _explorer(cfg, 0) as late:
                await _sync(late, 3)
                assert late.counters["versions_applied_shared"] == 1
                assert late.counters.get("versions_rejected") == 0
                own = late.engine.model.state_dict()
                for name, tensor in model.state_dict().items():
                    assert torch.equal(own[name], tensor), name

    asyncio.run(scenario())
