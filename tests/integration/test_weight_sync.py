"""Weights through the real S3 server: publish -> verify -> apply; tampering is rejected."""

from __future__ import annotations

import asyncio
import contextlib
import io

import pytest
import torch

from streamrft.infra.consume import read_history
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas import IntegrityError, ModelVersionReady, decode_manifest
from streamrft.schemas.codec import STATUS
from streamrft.schemas.events import RunState
from streamrft.sync.follower import Synced
from streamrft.sync.object_store import ObjectStoreLoader, ObjectStorePublisher, parse_uri
from streamrft.sync.weights import apply_state_dict, unique_state_dict
from tests.helpers.waits import until

pytestmark = pytest.mark.integration


def _models(cfg):
    tok = build_char_tokenizer(cfg.model.charset)
    src = build_tiny_model(cfg.model, tok)
    dst = build_tiny_model(msgspec_replace(cfg.model, seed=cfg.model.seed + 1), tok)
    return src, dst


def msgspec_replace(obj, **kw):
    import msgspec

    return msgspec.structs.replace(obj, **kw)


def test_publish_verify_apply_bytes_equal(make_config):
    cfg = make_config(object_store={"shard_size_mb": 1})
    src, dst = _models(cfg)
    assert not torch.equal(src.model.embed_tokens.weight, dst.model.embed_tokens.weight)
    publisher = ObjectStorePublisher(cfg.object_store, cfg.run.id)
    event = publisher.publish(unique_state_dict(src), version=3, step=3)
    assert event.version == 3 and event.bytes > 0
    tensors = ObjectStoreLoader(cfg.object_store).fetch(event)
    apply_state_dict(dst, tensors)
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # tied embeddings stay tied after the in-place copy
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()


def _tamper(cfg, event: ModelVersionReady) -> None:
    bucket, key = parse_uri(event.uri)
    client = ObjectStorePublisher(cfg.object_store, cfg.run.id).client
    manifest = decode_manifest(client.get_object(bucket, key).read())
    shard_key = key.rsplit("/", 1)[0] + "/" + manifest.shards[0].name
    data = bytearray(client.get_object(bucket, shard_key).read())
    data[-1] ^= 0xFF  # flip the last byte of tensor data
    client.put_object(bucket, shard_key, io.BytesIO(bytes(data)), len(data))


def test_tampered_shard_rejected(make_config):
    cfg = make_config()
    src, _ = _models(cfg)
    event = ObjectStorePublisher(cfg.object_store, cfg.run.id).publish(unique_state_dict(src), 1, 1)
    _tamper(cfg, event)
    with pytest.raises(IntegrityError, match="sha256"):
        ObjectStoreLoader(cfg.object_store).fetch(event)


@contextlib.asynccontextmanager
async def explorer_and_trainer_sender(cfg):
    """A live explorer (its sender and control view started; its weight follower is what
    the tests drive) and the trainer's event sender, on fresh topics."""
    from streamrft.infra import admin
    from streamrft.infra.bus import EventSender
    from streamrft.producers.explorer import Explorer

    await admin.ensure_topics(cfg.kafka, cfg.topics())
    explorer = Explorer(cfg, 0)
    await explorer.events.start()
    await explorer.view.start()
    trainer = EventSender(cfg, "trainer", "trainer")
    await trainer.start()
    try:
        yield explorer, trainer
    finally:
        await trainer.stop()
        await explorer.view.stop()
        await explorer.events.stop()


async def _announced(explorer, version: int) -> None:
    view = explorer.view
    await view.wait_until(lambda: version in view.versions, 30, asyncio.Event(), f"v{version}")


def test_explorer_applies_good_version_and_stays_on_it_when_next_is_tampered(make_config):

    cfg = make_config(synchronizer={"style": "dynamic_by_trainer"}, trainer={"max_staleness": 100})
    src, _ = _models(cfg)
    publisher = ObjectStorePublisher(cfg.object_store, cfg.run.id)

    async def scenario():
        async with explorer_and_trainer_sender(cfg) as (explorer, trainer):
            good = publisher.publish(unique_state_dict(src), 0, 0)
            await trainer.control(good)
            assert await explorer.follower.sync_point(0, 0) is Synced.READY
            assert explorer.follower.version == 0
            applied = {k: v.clone() for k, v in explorer.engine.model.state_dict().items()}
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(1.0)
            bad = publisher.publish(unique_state_dict(src), 1, 1)
            _tamper(cfg, bad)
            await trainer.control(bad)
            await _announced(explorer, 1)
            assert await explorer.follower.sync_point(1, 1) is Synced.READY
            return explorer, applied

    explorer, applied = asyncio.run(scenario())
    assert explorer.follower.version == 0
    assert explorer.counters["versions_rejected"] == 1
    assert explorer.counters["versions_applied"] == 1
    for name, tensor in explorer.engine.model.state_dict().items():
        assert torch.equal(tensor, applied[name]), name


def test_crafted_versions_are_rejected_and_the_explorer_lives_on(make_config):
    """Events that point at a manifest of another schema (its digest right), claim 10^15
    bytes, or name another run's version: each is a rejected version with its reason, the
    explorer keeps version 0 (at 41ac149 the first two crashed it, every restart again)."""
    import hashlib
    import json

    cfg = make_config(synchronizer={"style": "dynamic_by_trainer"}, trainer={"max_staleness": 100})
    src, _ = _models(cfg)
    publisher = ObjectStorePublisher(cfg.object_store, cfg.run.id)
    other = ObjectStorePublisher(cfg.object_store, f"{cfg.run.id}-other")

    async def scenario():
        async with explorer_and_trainer_sender(cfg) as (explorer, trainer):
            good = publisher.publish(unique_state_dict(src), 0, 0)
            await trainer.control(good)
            assert await explorer.follower.sync_point(0, 0) is Synced.READY
            blob = json.dumps({"version": "one", "shards": []}).encode()
            key = f"{cfg.run.id}/v00000001/manifest.json"
            publisher.store.put(key, blob, "application/json")
            crafted = [
                msgspec_replace(
                    good,
                    version=1,
                    uri=publisher.store.uri(key),
                    manifest_sha256=hashlib.sha256(blob).hexdigest(),
                ),
                msgspec_replace(good, version=2, bytes=10**15),
                msgspec_replace(other.publish(unique_state_dict(src), 3, 3), version=3),
            ]
            for event in crafted:
                await trainer.control(event)
                await _announced(explorer, event.version)
                assert await explorer.follower.sync_point(event.version, 0) is Synced.READY
            return explorer

    explorer = asyncio.run(scenario())
    assert explorer.follower.version == 0
    assert explorer.counters["versions_rejected"] == 3
    assert explorer.counters["versions_applied"] == 1


def test_refusals_are_on_the_status_topic_and_a_restart_does_not_load_them_again(make_config):
    """A tampered version (rejected when loaded) and an event by a method the run does not
    use (refused unloaded) are in the explorer's status with their reasons; an explorer of
    the same name started afterwards reads them back and loads neither (at 41ac149 the
    rejections lived in the process only: every restart loaded a bad version again)."""
    cfg = make_config(synchronizer={"style": "dynamic_by_trainer"}, trainer={"max_staleness": 100})
    src, _ = _models(cfg)
    publisher = ObjectStorePublisher(cfg.object_store, cfg.run.id)
    hostile = "gloo://10.9.9.9:29500/1?members=explorer-0"

    async def first_life():
        async with explorer_and_trainer_sender(cfg) as (explorer, trainer):
            await trainer.control(publisher.publish(unique_state_dict(src), 0, 0))
            assert await explorer.follower.sync_point(0, 0) is Synced.READY
            bad = publisher.publish(unique_state_dict(src), 1, 1)
            _tamper(cfg, bad)
            await trainer.control(bad)
            refused = msgspec_replace(bad, version=2, method="nccl", uri=hostile)
            await trainer.control(refused)
            await _announced(explorer, 2)
            assert await explorer.follower.sync_point(1, 1) is Synced.READY
            return explorer

    async def second_life():
        async with explorer_and_trainer_sender(cfg) as (explorer, _trainer):
            # as Explorer._start: a first status (nothing rejected yet by this process)
            # goes out before the first sync point, and must not erase the memory
            await explorer.events.status(RunState.RUNNING, "started")
            await _announced(explorer, 2)
            await asyncio.wait_for(explorer.view.caught_up.wait(), 30)
            await asyncio.sleep(1.0)  # the view has read that first status too by now
            assert await explorer.follower.sync_point(1, 1) is Synced.READY
            return explorer

    first = asyncio.run(first_life())
    statuses = asyncio.run(read_history(cfg.kafka, cfg.topics().status, STATUS, "own-status"))
    said = [e for e in statuses if e.component == "explorer-0"][-1].rejected
    assert first.follower.version == 0
    assert first.counters["versions_rejected"] == 1 and first.counters["versions_refused"] == 1
    by_version = {r.version: r for r in said}
    assert by_version[1].kind == "integrity" and "sha256" in by_version[1].reason
    assert by_version[2].kind == "refused" and by_version[2].method == "nccl"
    assert f"synchronizer.method: {cfg.synchronizer.method}" in by_version[2].reason

    second = asyncio.run(second_life())
    assert second.follower.version == 0  # version 1 was not loaded again
    assert second.counters.get("versions_rejected") == 0
    assert second.counters["versions_applied"] == 1
    assert {(r.version, r.kind) for r in second.events.rejections} == {
        (1, "integrity"),
        (2, "refused"),
    }


def test_lora_explorer_builds_base_then_applies_adapter_and_rejects_a_tampered_one(make_config):
    import msgspec

    from streamrft.sync.lora import adapter_config_json, adapter_state_dict, attach_lora

    cfg = make_config(
        model={"lora": {"enabled": True, "rank": 4}},
        synchronizer={"style": "dynamic_by_trainer"},
        trainer={"max_staleness": 100},
    )
    src, _ = _models(cfg)
    src = attach_lora(src, cfg.model.lora)
    publisher = ObjectStorePublisher(cfg.object_store, cfg.run.id)

    def adapter_event(version):
        with torch.no_grad():
            for name, p in src.named_parameters():
                if "lora_" in name:
                    p.add_(0.01 * version)
        ev = publisher.publish(
            adapter_state_dict(src),
            version,
            version,
            lora=True,
            extra_files={"adapter_config.json": adapter_config_json(src)},
        )
        return msgspec.structs.replace(ev, base_version=0)

    async def scenario():
        async with explorer_and_trainer_sender(cfg) as (explorer, trainer):
            await trainer.control(publisher.publish(unique_state_dict(src), 0, 0))
            assert await explorer.follower.sync_point(0, 0) is Synced.READY
            v1 = adapter_event(1)
            assert v1.bytes < 100_000
            await trainer.control(v1)
            await _announced(explorer, 1)
            assert await explorer.follower.sync_point(1, 1) is Synced.READY
            good = {k: v.clone() for k, v in explorer.engine.model.state_dict().items()}
            for name, tensor in src.state_dict().items():
                assert torch.equal(tensor, good[name]), name  # base + adapter equal the trainer's
            bad = adapter_event(2)
            _tamper(cfg, bad)
            await trainer.control(bad)
            await _announced(explorer, 2)
            assert await explorer.follower.sync_point(2, 2) is Synced.READY
            return explorer, good

    explorer, good = asyncio.run(scenario())
    assert explorer.follower.version == 1 and explorer.follower.weights.base_version == 0
    assert explorer.counters["versions_rejected"] == 1
    for name, tensor in explorer.engine.model.state_dict().items():
        assert torch.equal(tensor, good[name]), name


def test_retired_versions_are_deleted_from_the_bucket_and_only_theirs(make_config):
    """``StorePublisher.retire`` deletes a version's manifest and shards, nothing of the
    versions kept nor of another run's with the same numbers."""
    from streamrft.schemas.errors import SyncError

    cfg = make_config()
    src, _ = _models(cfg)
    publisher = ObjectStorePublisher(cfg.object_store, cfg.run.id)
    other = ObjectStorePublisher(cfg.object_store, f"{cfg.run.id}-other")
    events = [publisher.publish(unique_state_dict(src), v, v) for v in range(3)]
    theirs = other.publish(unique_state_dict(src), 0, 0)
    client, bucket = publisher.client, cfg.object_store.bucket

    def folders(run: str) -> set[str]:  # (the local gateway lists an emptied folder: no bytes)
        names = client.list_objects(bucket, prefix=f"{run}/", recursive=True)
        return {o.object_name.split("/")[1] for o in names if not o.is_dir}

    assert publisher.retire([0, 1]) >= 4  # a manifest and a shard each at least
    assert folders(cfg.run.id) == {"v00000002"}
    assert folders(f"{cfg.run.id}-other") == {"v00000000"}
    loader = ObjectStoreLoader(cfg.object_store, cfg.run.id)
    with pytest.raises(SyncError):
        loader.fetch(events[0])
    assert set(loader.fetch(events[2])) == set(unique_state_dict(src))
    assert set(ObjectStoreLoader(cfg.object_store, f"{cfg.run.id}-other").fetch(theirs))
    assert publisher.retire([0, 1]) == 0  # gone already: nothing to delete


def test_after_a_rejection_a_batch_still_waits_for_the_version_it_needs(make_config):
    """Batch 2 needs version 2 (fixed style, no offset); version 2 fails its check, version 1
    is good: the explorer does not sample batch 2 with version 1, it waits for version 3."""
    cfg = make_config(
        synchronizer={"style": "fixed", "sync_offset": 0, "sync_timeout": 60.0},
        trainer={"max_staleness": 100},
    )
    src, _ = _models(cfg)
    publisher = ObjectStorePublisher(cfg.object_store, cfg.run.id)

    async def scenario():
        async with explorer_and_trainer_sender(cfg) as (explorer, trainer):
            await trainer.control(publisher.publish(unique_state_dict(src), 0, 0))
            assert await explorer.follower.sync_point(0, 0) is Synced.READY
            await trainer.control(publisher.publish(unique_state_dict(src), 1, 1))
            bad = publisher.publish(unique_state_dict(src), 2, 2)
            _tamper(cfg, bad)
            await trainer.control(bad)
            await _announced(explorer, 2)
            waiting = asyncio.create_task(explorer.follower.sync_point(2, 2))
            # version 2 tried and rejected (announced before version 3, whatever the load)
            await until(lambda: explorer.counters.get("versions_rejected") >= 1, 60, "v2 rejected")
            held_while_waiting = explorer.follower.version
            assert not waiting.done()
            await trainer.control(publisher.publish(unique_state_dict(src), 3, 3))
            assert await asyncio.wait_for(waiting, 60) is Synced.READY
            return explorer, held_while_waiting

    explorer, held_while_waiting = asyncio.run(scenario())
    assert held_while_waiting in (0, 1) and explorer.follower.version == 3
    assert explorer.counters["versions_rejected"] == 1
