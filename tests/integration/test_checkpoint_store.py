"""Checkpoints in a real S3 server (``consumers/checkpoint_store.py``): a real checkpoint
uploaded, complete only with its manifest, fetched into another folder byte for byte when
newer, refused whole when a file does not match its manifest, and pruned to
``trainer.keep_checkpoints``."""

from __future__ import annotations

import pytest
import torch

from streamrft.consumers.checkpoint import load_checkpoint, save_checkpoint
from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.consumers.checkpoint_store import MANIFEST, CheckpointStore
from streamrft.consumers.state import TrainerState
from streamrft.schemas.errors import IntegrityError

pytestmark = pytest.mark.integration


def saved(root, step: int, scale: float):
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.mul_(scale)
    state = TrainerState(step=step, version=step)
    return save_checkpoint(root, state, model, opt, keep=0), state, model


def test_checkpoints_go_to_the_store_and_come_back_on_another_host(make_config, tmp_path, caplog):
    cfg = make_config(trainer={"keep_checkpoints": 2})
    store = CheckpointStore(cfg)
    host_a, host_b = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    assert store.fetch_newer(host_b) is None and store.complete() == []

    folder, state, model = saved(host_a, 2, 1.0)
    uri = store.upload(folder, state)
    assert uri.endswith(f"{cfg.run.id}/checkpoints/step_00000002/{MANIFEST}")
    [(step, manifest)] = store.complete()
    assert step == 2 and manifest["version"] == 2
    assert set(manifest["files"]) == {p.name for p in folder.iterdir()}

    fetched = store.fetch_newer(host_b)
    assert fetched == host_b / "step_00000002" and latest_checkpoint(host_b) == fetched
    for path in folder.iterdir():
        assert (fetched / path.name).read_bytes() == path.read_bytes()
    copy = torch.nn.Linear(4, 3)
    restored = load_checkpoint(fetched, copy, torch.optim.AdamW(copy.parameters(), lr=0.1))
    assert restored.step == 2 and torch.equal(copy.weight, model.weight)
    assert store.fetch_newer(host_b) is None  # as new as the store's: nothing downloaded

    # an upload cut short (files, no manifest) is never read
    folder4, state4, _ = saved(host_a, 4, 2.0)
    store.store.put(f"{cfg.run.id}/checkpoints/step_00000004/model.safetensors", b"x", "x")
    assert [s for s, _ in store.complete()] == [2] and store.fetch_newer(host_b) is None

    # a file that differs from its manifest: skipped whole, an older one tried (here the
    # local one is as new: nothing installed); a fresh host gets the older good one
    store.upload(folder4, state4)
    key = f"{cfg.run.id}/checkpoints/step_00000004/model.safetensors"
    good = store.store.get(key)
    store.store.put(key, good[:-1] + bytes([good[-1] ^ 1]), "application/octet-stream")
    with caplog.at_level("WARNING"):
        assert store.fetch_newer(host_b) is None
    assert "model.safetensors is not what its manifest says" in caplog.text
    assert latest_checkpoint(host_b) == fetched and not list(host_b.glob(".tmp_*"))
    host_c = tmp_path / "c" / "checkpoints"
    assert store.fetch_newer(host_c) == host_c / "step_00000002"
    with pytest.raises(IntegrityError, match=r"file name '\.\./x'"):  # a name out of the folder
        store._download(host_c, 9, {"files": {"../x": {"size": 0, "sha256": ""}}})
    store.store.put(key, good, "application/octet-stream")
    assert store.fetch_newer(host_b) == host_b / "step_00000004"

    # kept: the newest two, and one marked keep
    (host_a / "step_00000002" / "keep").write_bytes(b"")
    store.upload(host_a / "step_00000002", state)
    for step, scale in ((6, 3.0), (8, 4.0)):
        f, s, _ = saved(host_a, step, scale)
        store.upload(f, s)
    store.store.put(f"{cfg.run.id}/checkpoints/step_00000005/model.safetensors", b"x", "x")
    store.prune()  # also the files of step 5's upload, cut short below the newest complete
    assert sorted(s for s, _ in store.complete()) == [2, 6, 8]
    assert store._steps() == {2, 6, 8}


def test_an_upload_survives_local_retention_and_failures_are_counted(make_config, tmp_path):
    """The files are linked into a staging folder at submit: local retention deleting the
    checkpoint folder meanwhile does not stop the upload; offsets are committed (the
    callback) only once it is complete; a store that fails is counted, tried again, and
    leaves the checkpoint local."""
    import asyncio
    import shutil

    from streamrft.consumers.checkpoint_store import CheckpointUploads
    from streamrft.infra.bus import Counters

    cfg = make_config()
    store = CheckpointStore(cfg)
    root = tmp_path / "checkpoints"
    folder, state, _ = saved(root, 3, 1.0)
    durable: list[int] = []
    counters = Counters()

    async def committed(s):
        durable.append(s.step)

    async def go():
        uploads = CheckpointUploads(store, committed, counters)
        uploads.submit(folder, state)
        shutil.rmtree(folder)  # retention took it at once
        await uploads.drain()

    asyncio.run(go())
    assert durable == [3] and [s for s, _ in store.complete()] == [3]
    assert counters.get("checkpoints_stored") == 1 and not list(root.glob(".upload_*"))

    import streamrft.consumers.checkpoint_store as module
    from streamrft.sync.object_store import S3Store

    broken = CheckpointStore(cfg)  # then its store goes away
    down = make_config(object_store={"endpoint": "127.0.0.1:9"}).object_store
    broken.store = S3Store(down, create_bucket=False)
    folder5, state5, _ = saved(root, 5, 1.0)
    module.RETRY_S, saved_retry = 0.01, module.RETRY_S
    try:

        async def fail():
            uploads = CheckpointUploads(broken, committed, counters)
            uploads.submit(folder5, state5)
            await uploads.drain()

        asyncio.run(fail())
    finally:
        module.RETRY_S = saved_retry
    assert durable == [3] and counters.get("checkpoint_upload_failures") == module.RETRIES
    assert (folder5 / "model.safetensors").is_file() and not list(root.glob(".upload_*"))


def test_a_kept_best_is_uploaded_and_its_mark_follows_the_newer_best(make_config, tmp_path):
    """``trainer.keep_best`` in the uploads: a waiting checkpoint marked keep is not replaced
    by a newer one; the same step saved again replaces its own waiting upload; a best no
    longer loses its mark whether its upload waits, is under way, or is done; fetching
    older checkpoints never points ``latest`` back."""
    import asyncio

    from streamrft.consumers.checkpoint import KEEP_MARKER, mark_keep
    from streamrft.consumers.checkpoint_store import CheckpointUploads
    from streamrft.infra.bus import Counters

    cfg = make_config(trainer={"keep_checkpoints": 1})
    store = CheckpointStore(cfg)
    root = tmp_path / "checkpoints"
    durable: list[int] = []

    async def committed(s):
        durable.append(s.step)

    def marked() -> dict[int, bool]:
        return {step: KEEP_MARKER in m["files"] for step, m in store.complete()}

    async def go():
        uploads = CheckpointUploads(store, committed, Counters())
        f1, s1, _ = saved(root, 1, 1.0)
        uploads.submit(f1, s1)
        await asyncio.sleep(0)  # under way
        f2, s2, _ = saved(root, 2, 1.0)
        mark_keep(f2)
        uploads.submit(f2, s2)  # waits, marked: the best
        f3, s3, _ = saved(root, 3, 1.0)
        uploads.submit(f3, s3)  # waits behind it: step 2 is not replaced
        f3b, _, _ = saved(root, 3, 2.0)
        uploads.submit(f3b, s3)  # step 3 saved again: replaces its own waiting upload
        await uploads.drain()
        assert durable == [1, 2, 3] and marked() == {2: True, 3: False}
        f4, s4, _ = saved(root, 4, 1.0)
        mark_keep(f4)
        uploads.submit(f4, s4)
        await uploads.unmark(2)  # done: unmarked in the store now
        await uploads.drain()
        assert marked() == {4: True}  # 2 unmarked, then pruned like 3 (keep_checkpoints 1)
        f5, s5, _ = saved(root, 5, 1.0)
        mark_keep(f5)
        uploads.submit(f5, s5)
        await asyncio.sleep(0)  # under way
        assert uploads._uploading == 5
        await uploads.unmark(5)  # after its upload
        await uploads.drain()
        assert marked()[5] is False

    asyncio.run(go())
    # a host with only step 5 fetches the others without pointing latest back
    other = tmp_path / "other"
    store.fetch_newer(other)
    assert latest_checkpoint(other).name == "step_00000005"
    got = store.fetch_missing(other)
    assert {p.name for p in got} == {f"step_0000000{s}" for s in marked() if s != 5}
    assert latest_checkpoint(other).name == "step_00000005"


def test_the_poison_record_lives_beside_the_checkpoints_in_the_store(make_config, tmp_path):
    """The trainer's poison record (crashes per group) in a real S3 server: none at first,
    then what the last write made; a trainer on another host (its own folder) counts on
    from it, and a third sets the group aside."""
    import asyncio

    from streamrft.consumers.checkpoint_store import StoredRecord
    from streamrft.consumers.poison import RECORD, InFlight
    from streamrft.consumers.shared_copy import SharedCopy

    cfg = make_config()
    store = CheckpointStore(cfg)
    shared = StoredRecord(CheckpointStore(cfg, quick=True), RECORD)
    assert shared.read() is None and shared.where.endswith(f"{cfg.run.id}/checkpoints/{RECORD}")

    async def killed(host: str, companion: str) -> None:  # a trainer killed on X
        record = InFlight(tmp_path / host / RECORD, 2, shared)
        copy = SharedCopy(shared, "poison_record")
        assert record.recover() == set()
        for written in (record.last, record.begin(["X", companion])):
            if written is not None:
                copy.submit(*written)
                assert await copy.stored(written.seq)
        copy.close()

    for host, companion in (("a", "c1"), ("b", "c2")):
        asyncio.run(killed(host, companion))
    assert b'"X": 1' in shared.read()  # the batch in flight and the count before it
    third = InFlight(tmp_path / "c" / RECORD, 2, shared)
    assert third.recover() == {"X"} and third.crashes == {"X": 2, "c1": 1, "c2": 1}
    assert store.complete() == [] and store._steps() == set()  # not taken for a checkpoint


def test_the_poison_records_store_copy_never_holds_the_trainer(
    make_config, tmp_path, monkeypatch, caplog
):
    """The poison record's copy in the store is written on a daemon thread, one write at a
    time: with the store behind a relay that takes requests and never answers, each
    record is on this host's disk when the write returns, a wait for the store's copy ends
    after :data:`~streamrft.consumers.shared_copy.WAIT_S` and the next ones do not wait;
    records made meanwhile replace each other, and once the store answers again the
    newest one is written (the ones it replaced never are)."""
    import asyncio
    import json

    from streamrft.consumers import shared_copy
    from streamrft.consumers.checkpoint_store import StoredRecord
    from streamrft.consumers.poison import RECORD, InFlight
    from streamrft.consumers.shared_copy import SharedCopy
    from streamrft.infra.bus import Counters
    from tests.harness.throttle import lagged
    from tests.helpers.waits import until

    monkeypatch.setattr(shared_copy, "WAIT_S", 1.0)
    monkeypatch.setattr(shared_copy, "RETRY_S", 0.2)
    cfg = make_config()
    store = CheckpointStore(cfg)
    tried: list[int] = []

    class Watched(StoredRecord):  # the real store's copy; which records were sent to it
        def write(self, data: bytes) -> None:
            tried.append(json.loads(data)["seq"])
            super().write(data)

    with lagged(cfg.object_store.endpoint) as relay:
        section = {"endpoint": relay.endpoint, "bucket": cfg.object_store.bucket}
        slow = make_config(run={"id": cfg.run.id}, object_store=section)
        place = Watched(CheckpointStore(slow, quick=True), RECORD)
        local = tmp_path / "a" / RECORD
        record = InFlight(local, 2, place)
        counters = Counters()

        async def go() -> None:
            copy = SharedCopy(place, "poison_record", counters)
            record.recover()
            first = record.begin(["X", "a"])
            copy.submit(*first)
            assert await copy.stored(first.seq)  # the store keeps up: waited for
            relay.delay_s = 3600.0  # from now on it takes requests and never answers
            copy.submit(*record.done(["X", "a"]))  # replaced at once by the next one:
            hung = record.begin(["Y"])
            copy.submit(*hung)
            assert not await copy.stored(hung.seq)  # waited WAIT_S in vain
            assert copy.slow and tried[-1] == hung.seq  # under way, hung
            for ids in (["Y"], ["Z"]):  # the next steps: not waited for at all
                copy.submit(*record.done(ids))
                newest = record.begin(["Z"]) if ids == ["Y"] else record.done(ids)
                copy.submit(*newest)
                assert not await asyncio.wait_for(copy.stored(newest.seq), 0.5)
                assert json.loads(local.read_bytes())["seq"] == newest.seq  # on disk: all
            relay.delay_s = 0.0  # answers again: the hung request times out, a new one goes
            await until(lambda: copy.stored_seq == newest.seq, 120, "the newest record stored")
            assert await copy.drain(5.0)

        with caplog.at_level("WARNING", "streamrft.consumers.shared_copy"):
            asyncio.run(go())
    assert store.read_record(RECORD) == record.last.data
    assert tried[0] == 1 and tried[-1] == record.last.seq  # the recovery's write, then...
    replaced = set(range(1, record.last.seq + 1)) - set(tried)
    assert replaced >= {2, 4, 5, 6}  # replaced while one was under way: never sent
    assert counters["poison_record_late"] == 3
    assert caplog.text.count("is not written to") == 1
