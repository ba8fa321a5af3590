"""Weight broadcast over torch.distributed (gloo on CPU) between real OS processes.

One trainer process (rank 0) and three explorer processes are started once for the module
(spawn start method) and driven through command queues; every result comes back through
one queue with the sha256 of each tensor's bytes. A few in-process tests (threads) cover
what needs no second process.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrft.schemas.errors import SyncError, SyncTimeout
from streamrft.sync import collective
from streamrft.sync.collective import (
    CollectiveReceiver,
    CollectiveSender,
    SameDeviceError,
    parse_rendezvous,
)

pytestmark = pytest.mark.integration

SENDER_TIMEOUT = 5.0
RECEIVER_TIMEOUT = 10.0  # longer than the sender's: receivers fail by the sender's word
EXPLORERS = ("explorer-0", "explorer-1", "explorer-2")


# ------------------------------------------------------------------ worker processes


def _model(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """~4.5 MB of tensors of several dtypes and layouts (a dict like a state dict)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "layers.0.weight": torch.randn(512, 1024, generator=g),  # 2 MiB: split over buckets
        "layers.0.bias": torch.randn(1024, generator=g),
        "embed.weight": torch.randn(300, 257, generator=g).to(torch.bfloat16),
        "proj.weight": torch.randn(600, 700, generator=g).t(),  # non-contiguous, 1.6 MiB
        "token_ids": torch.randint(-(2**40), 2**40, (1000,), generator=g),
        "norm.half": torch.randn(7, 13, generator=g).half(),
        "scale": torch.tensor(float(seed)),
        "empty": torch.empty(0, 3),
        "mask": torch.rand(33, generator=g) > 0.5,
    }
    if kind == "mismatch":
        tensors["layers.0.bias"] = torch.randn(1023, generator=g)
    return tensors


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        name: hashlib.sha256(
            t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, t in tensors.items()
    }


_UNFLATTEN = collective.unflatten_bucket


def _stall_once(seconds: float) -> None:
    def stalled(*args: Any, **kw: Any) -> None:
        collective.unflatten_bucket = _UNFLATTEN
        time.sleep(seconds)
        _UNFLATTEN(*args, **kw)

    collective.unflatten_bucket = stalled


def _worker(name: str, role: str, commands: Any, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    endpoint: Any
    if role == "trainer":
        endpoint = CollectiveSender("127.0.0.1", 0, SENDER_TIMEOUT, bucket_mb=1, backend="gloo")
    else:
        endpoint = CollectiveReceiver(name, RECEIVER_TIMEOUT)
    kind, tensors = "", {}
    results.put({"name": name, "ok": True, "op": "started"})
    while True:
        op, kw = commands.get()
        if op == "exit":
            endpoint.close()
            return
        out: dict[str, Any] = {"name": name, "op": op, "ok": True}
        t0 = time.monotonic()
        try:
            if op == "open":
                out["uri"] = endpoint.open_epoch(kw["members"])
            elif op == "set_timeout":
                endpoint.timeout_s = kw["timeout_s"]
            elif op == "broadcast":
                src = _model("base", kw["seed"])
                endpoint.broadcast(src, kw["version"])
                out["digests"] = _digests(src)
            elif op == "receive":
                if kw["kind"] != kind:  # a fresh model, unlike any the trainer sends
                    kind, tensors = kw["kind"], _model(kw["kind"], 1000 + len(name))
                ptrs = {k: v.data_ptr() for k, v in tensors.items()}
                if kw.get("stall"):  # hang once mid-transfer, as a stuck explorer would
                    _stall_once(kw["stall"])
                try:
                    endpoint.receive(kw["uri"], tensors, kw["version"])
                finally:
                    collective.unflatten_bucket = _UNFLATTEN
                out["digests"] = _digests(tensors)
                out["in_place"] = ptrs == {k: v.data_ptr() for k, v in tensors.items()}
                out["epoch"] = endpoint.epoch
            else:
                raise ValueError(op)
        except Exception as exc:
            out.update(ok=False, error=type(exc).__name__, message=str(exc)[:500])
        out["elapsed"] = time.monotonic() - t0
        results.put(out)


class Cluster:
    """The worker processes and their queues."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.commands: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}

    def start(self, name: str, role: str) -> None:
        self.commands[name] = self.ctx.Queue()
        proc = self.ctx.Process(
            target=_worker, args=(name, role, self.commands[name], self.results), daemon=True
        )
        proc.start()
        self.procs[name] = proc

    def send(self, name: str, op: str, **kw: Any) -> None:
        self.commands[name].put((op, kw))

    def collect(self, names: list[str] | tuple[str, ...], timeout: float = 40.0):
        """One result from each of ``names`` (by name)."""
        out: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while set(out) != set(names):
            try:
                res = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no result from {set(names) - set(out)}") from None
            assert res["name"] not in out, res
            out[res["name"]] = res
        return out

    def call(self, name: str, op: str, **kw: Any) -> dict[str, Any]:
        self.send(name, op, **kw)
        return self.collect([name])[name]

    def open(self, members: list[str]) -> str:
        res = self.call("trainer", "open", members=members)
        assert res["ok"], res
        return res["uri"]

    def sync(self, uri, version, seed, receivers, kinds=None, stall=None):
        """Receivers ask for ``version``, then the trainer broadcasts it; all results."""
        kinds, stall = kinds or {}, stall or {}
        for name in receivers:
            kind = kinds.get(name, "base")
            self.send(name, "receive", uri=uri, version=version, kind=kind, stall=stall.get(name))
        self.send("trainer", "broadcast", version=version, seed=seed)
        return self.collect(["trainer", *receivers])

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if proc.is_alive():
                self.send(name, "exit")
        for proc in self.procs.values():
            proc.join(timeout=10)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        c.start("trainer", "trainer")
        for name in EXPLORERS:
            c.start(name, "explorer")
        c.collect(["trainer", *EXPLORERS], timeout=60)
        yield c
    finally:
        c.stop()
    assert all(p.exitcode == 0 for p in c.procs.values()), {
        n: p.exitcode for n, p in c.procs.items()
    }


def _assert_synced(res: dict[str, dict[str, Any]], receivers: list[str]) -> None:
    assert res["trainer"]["ok"], res["trainer"]
    want = res["trainer"]["digests"]
    for name in receivers:
        assert res[name]["ok"], res[name]
        assert res[name]["digests"] == want, name
        assert res[name]["in_place"], name


# ------------------------------------------------------------------------ the tests


def test_two_explorers_two_versions_then_a_late_joiner(cluster):
    two = ["explorer-0", "explorer-1"]
    uri = cluster.open(two)
    rdv = parse_rendezvous(uri)
    assert rdv.backend == "gloo" and rdv.members == tuple(two) and rdv.port > 0
    for version in (1, 2):
        res = cluster.sync(uri, version, seed=version, receivers=two)
        _assert_synced(res, two)
    assert res["explorer-0"]["epoch"] == rdv.epoch
    # a third explorer arrives: the trainer opens a new epoch with all three
    three = [*two, "explorer-2"]
    uri3 = cluster.open(three)
    rdv3 = parse_rendezvous(uri3)
    assert rdv3.epoch > rdv.epoch and rdv3.port != rdv.port  # port 0: a fresh store
    res = cluster.sync(uri3, 3, seed=3, receivers=three)
    _assert_synced(res, three)
    assert {res[n]["epoch"] for n in three} == {rdv3.epoch}  # the old group was re-formed
    res = cluster.sync(uri3, 4, seed=4, receivers=three)
    _assert_synced(res, three)


def test_member_that_never_comes_times_out_then_new_epoch_works(cluster):
    two = ["explorer-0", "explorer-1"]
    uri = cluster.open(two)
    res = cluster.sync(uri, 1, seed=11, receivers=["explorer-0"])  # explorer-1 never asks
    trainer = res["trainer"]
    assert not trainer["ok"] and trainer["error"] == "SyncTimeout", trainer
    assert "explorer-1" in trainer["message"]
    # upper bounds: what the other behaviour would take, with room for a busy machine
    assert SENDER_TIMEOUT - 0.5 < trainer["elapsed"] < 3 * SENDER_TIMEOUT
    # the member that did come is told at once, not after its own (longer) timeout
    assert res["explorer-0"]["error"] == "SyncTimeout", res["explorer-0"]
    assert res["explorer-0"]["elapsed"] < RECEIVER_TIMEOUT
    # that epoch is closed; a fresh one with the same members works
    again = cluster.call("trainer", "broadcast", version=2, seed=12)
    assert again["error"] == "SyncError" and "open a new epoch" in again["message"]
    uri2 = cluster.open(two)
    res = cluster.sync(uri2, 2, seed=12, receivers=two)
    _assert_synced(res, two)


def test_member_skipping_a_version_times_out_and_the_epoch_goes_on(cluster):
    cluster.call("trainer", "set_timeout", timeout_s=3.0)
    try:
        two = ["explorer-0", "explorer-1"]
        uri = cluster.open(two)
        _assert_synced(cluster.sync(uri, 5, seed=5, receivers=two), two)
        res = cluster.sync(uri, 6, seed=6, receivers=["explorer-0"])  # explorer-1 skips v6
        assert res["trainer"]["error"] == "SyncTimeout", res["trainer"]
        assert 2.5 < res["trainer"]["elapsed"] < RECEIVER_TIMEOUT
        assert res["explorer-0"]["error"] == "SyncTimeout"
        # explorer-1 asks for v6 too late: told at once that the trainer gave up on it
        late = cluster.call("explorer-1", "receive", uri=uri, version=6, kind="base")
        assert late["error"] == "SyncTimeout" and late["elapsed"] < RECEIVER_TIMEOUT / 2, late
        # the same epoch carries the next version to both
        _assert_synced(cluster.sync(uri, 7, seed=7, receivers=two), two)
    finally:
        cluster.call("trainer", "set_timeout", timeout_s=SENDER_TIMEOUT)


def test_member_stuck_mid_transfer_times_out_then_new_epoch_works(cluster):
    cluster.call("trainer", "set_timeout", timeout_s=3.0)
    try:
        two = ["explorer-0", "explorer-1"]
        uri = cluster.open(two)
        res = cluster.sync(uri, 1, seed=31, receivers=two, stall={"explorer-1": 6.0})
        trainer = res["trainer"]
        assert trainer["error"] == "SyncTimeout", trainer
        assert 2.5 < trainer["elapsed"] < RECEIVER_TIMEOUT
        # explorer-1 wakes up after the trainer gave up: whatever it got, nobody hangs
        again = cluster.call("trainer", "broadcast", version=2, seed=32)
        assert again["error"] == "SyncError" and "open a new epoch" in again["message"]
        uri2 = cluster.open(two)
        _assert_synced(cluster.sync(uri2, 2, seed=32, receivers=two), two)
    finally:
        cluster.call("trainer", "set_timeout", timeout_s=SENDER_TIMEOUT)


def test_mismatched_model_raises_sync_error_everywhere(cluster):
    two = ["explorer-0", "explorer-1"]
    uri = cluster.open(two)
    res = cluster.sync(uri, 1, seed=21, receivers=two, kinds={"explorer-1": "mismatch"})
    assert res["trainer"]["error"] == "SyncError", res["trainer"]
    assert "explorer-1" in res["trainer"]["message"]
    assert "explorer-0" not in res["trainer"]["message"]
    for name in two:
        assert res[name]["error"] == "SyncError", res[name]
        assert res[name]["elapsed"] < SENDER_TIMEOUT  # before any timeout
    # nothing was posted on the group, so it carries the next version once models match
    res = cluster.sync(uri, 2, seed=22, receivers=two)
    _assert_synced(res, two)


# -------------------------------------------------------------- in-process (threads)


def test_open_epoch_does_not_block_and_an_empty_group_times_out():
    sender = CollectiveSender("127.0.0.1", 0, timeout_s=5.0, bucket_mb=1, backend="gloo")
    try:
        t0 = time.monotonic()
        uri = sender.open_epoch(["nobody"])
        assert time.monotonic() - t0 < 2.5  # not the 5 s a wait for the members would take
        t0 = time.monotonic()
        with pytest.raises(SyncTimeout, match="nobody did not join"):
            sender.broadcast({"w": torch.zeros(4)}, 1)
        assert 4.5 < time.monotonic() - t0 < 15
        assert not sender.usable
        with pytest.raises(SyncError, match="open a new epoch"):
            sender.broadcast({"w": torch.zeros(4)}, 2)
        uri2 = sender.open_epoch(["nobody"])
        assert parse_rendezvous(uri2).epoch > parse_rendezvous(uri).epoch
        assert sender.usable
    finally:
        sender.close()
    with pytest.raises(SyncError):
        sender.broadcast({"w": torch.zeros(4)}, 3)


def test_receiver_refuses_a_uri_it_is_not_in():
    receiver = CollectiveReceiver("explorer-5", timeout_s=1.0)
    with pytest.raises(SyncError, match="not a member"):
        receiver.receive("gloo://127.0.0.1:1/1?members=explorer-0", {"w": torch.zeros(1)}, 1)
    with pytest.raises(SyncError):
        receiver.receive("s3://bucket/x", {"w": torch.zeros(1)}, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fixed_port_keeps_one_store_and_separates_epochs():
    """A fixed port: one store for the sender's life, every epoch in its own namespace."""
    port = _free_port()
    sender = CollectiveSender("127.0.0.1", port, timeout_s=10.0, bucket_mb=0.01, backend="gloo")
    receiver = CollectiveReceiver("explorer-0", timeout_s=10.0)
    dst = {"a": torch.zeros(3000), "b": torch.zeros(5, 7, dtype=torch.bfloat16)}
    try:
        epochs = []
        for version in range(1, 4):
            if version != 2:  # epochs 1 and 2; version 2 reuses the first
                uri = sender.open_epoch(["explorer-0"])
                epochs.append(parse_rendezvous(uri))
            src = {"a": torch.randn(3000), "b": torch.randn(5, 7).to(torch.bfloat16)}
            errors: list[BaseException] = []

            def run(uri: str = uri, version: int = version, errors: list = errors) -> None:
                try:
                    receiver.receive(uri, dst, version)
                except BaseException as exc:
                    errors.append(exc)

            thread = threading.Thread(target=run)
            thread.start()
            sender.broadcast(src, version)
            thread.join(timeout=15)
            assert not thread.is_alive() and not errors, errors
            assert all(torch.equal(dst[k], src[k]) for k in src)
            assert receiver.epoch == epochs[-1].epoch
        assert {e.port for e in epochs} == {port}
        assert epochs[1].epoch > epochs[0].epoch
    finally:
        receiver.close()
        sender.close()


def _mixed_model(seed: int) -> dict[str, torch.Tensor]:
    """Tensors bigger than a bucket (0.25 MiB below), mixed dtypes, non-contiguous ones and
    many tiny ones: every path of the bucket plan (in place, packed, split, staged)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "big.f32": torch.randn(300_001, generator=g),  # 1.1 MiB: five buckets of its own
        "big.bf16": torch.randn(700, 300, generator=g).to(torch.bfloat16),  # 0.4 MiB
        "big.t": torch.randn(400, 500, generator=g).t(),  # non-contiguous, split
        "mid.f16": torch.randn(60_000, generator=g).half(),  # packed, spans two buckets
        "ids": torch.randint(-(2**40), 2**40, (5000,), generator=g),
        "mask": torch.rand(999, generator=g) > 0.5,
        "f64": torch.randn(33, 3, generator=g, dtype=torch.float64),
        "empty": torch.empty(0, 5),
    }
    for i in range(600):  # many tiny tensors, some of two elements
        tensors[f"tiny.{i:03d}"] = torch.randn(2 + (i * 7) % 40, generator=g)
    return tensors


def _send_and_receive(sender, receiver, uri, src, dst, version) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            receiver.receive(uri, dst, version)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    sender.broadcast(src, version)
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors, errors


def test_every_bucket_path_carries_exact_bytes_in_place_version_after_version():
    sender = CollectiveSender("127.0.0.1", 0, timeout_s=20.0, bucket_mb=0.25, backend="gloo")
    receiver = CollectiveReceiver("explorer-0", timeout_s=20.0)
    dst = _mixed_model(99)
    dst["big.t"] = torch.zeros(400, 500).t()  # the receiver's own non-contiguous layout
    dst["big.f32"] = torch.nn.Parameter(dst["big.f32"])  # a parameter that requires grad
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    try:
        uri = sender.open_epoch(["explorer-0"])
        for version in (1, 2, 3):
            src = _mixed_model(version)
            _send_and_receive(sender, receiver, uri, src, dst, version)
            assert _digests({k: v.detach() for k, v in dst.items()}) == _digests(src), version
            assert {k: v.data_ptr() for k, v in dst.items()} == ptrs
            for t in dst.values():  # the next version must really arrive, staging included
                t.detach().zero_()
        assert dst["big.f32"].requires_grad
        # some buckets went in place, the small tensors packed, on both sides alike
        for stats in (sender.last_stats, receiver.last_stats):
            assert 0 < stats["packed"] < stats["buckets"], stats
    finally:
        receiver.close()
        sender.close()


def test_contiguous_big_tensors_go_on_the_wire_without_packing():
    sender = CollectiveSender("127.0.0.1", 0, timeout_s=20.0, bucket_mb=0.5, backend="gloo")
    receiver = CollectiveReceiver("explorer-0", timeout_s=20.0)
    src = {f"w{i}": torch.randn(200_000 + i) for i in range(4)}  # 0.76 MiB each: 2 buckets
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    try:
        uri = sender.open_epoch(["explorer-0"])
        _send_and_receive(sender, receiver, uri, src, dst, 1)
        assert all(torch.equal(dst[k], src[k]) for k in src)
        # nothing was copied into a bucket on either side: every bucket went in place
        for stats in (sender.last_stats, receiver.last_stats):
            assert stats["buckets"] == 8 and stats["packed"] == 0, stats
        assert sender.last_stats["pack_s"] == 0.0
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize(
    ("tensors", "packed"),
    [(2, False), (40, True)],  # 2 MiB tensors go in place, 0.1 MiB ones are packed
)
def test_broadcast_bench_reports_its_figures_and_equal_bytes(tensors, packed):
    bench = Path(__file__).resolve().parents[2] / "bench" / "broadcast.py"
    argv = ["--mb", "4", "--tensors", str(tensors), "--bucket-mb", "1", "--repeats", "2"]
    proc = subprocess.run(
        [sys.executable, str(bench), *argv], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["bench"], result["method"], result["backend"]) == ("weight_sync", "nccl", "gloo")
    assert result["bytes_equal"] is True
    assert (result["tensors"], result["repeats"]) == (tensors, 2)
    for key in ("ratio_vs_raw_broadcast", "broadcast_s", "raw_flat_s", "raw_tensors_s"):
        assert result[key] > 0, key
    assert result["raw_s"] == min(result["raw_flat_s"], result["raw_tensors_s"])
    for side in ("sender_phases", "receiver_phases"):
        assert (result[side]["packed"] > 0) == packed, result[side]


def test_a_transfer_that_fails_mid_bucket_drops_its_staging_buffers(monkeypatch):
    """A broadcast abandoned mid-transfer may still be writing into (or reading from) its
    staging buffers: neither side keeps them for the next version, which then arrives
    exactly through fresh ones."""
    sender = CollectiveSender("127.0.0.1", 0, timeout_s=2.0, bucket_mb=0.25, backend="gloo")
    receiver = CollectiveReceiver("explorer-0", timeout_s=6.0)
    src = _mixed_model(1)  # many small tensors: several packed buckets
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    unflatten = collective.unflatten_bucket

    def stalled(*args: Any, **kw: Any) -> None:  # the explorer hangs on its first bucket
        monkeypatch.setattr(collective, "unflatten_bucket", unflatten)
        time.sleep(5.0)
        unflatten(*args, **kw)

    errors: list[BaseException] = []

    def run() -> None:
        try:
            receiver.receive(uri, dst, 1)
        except BaseException as exc:
            errors.append(exc)

    try:
        uri = sender.open_epoch(["explorer-0"])
        monkeypatch.setattr(collective, "unflatten_bucket", stalled)
        thread = threading.Thread(target=run)
        thread.start()
        with pytest.raises(SyncTimeout):
            sender.broadcast(src, 1)
        thread.join(timeout=30)
        assert not thread.is_alive() and len(errors) == 1, errors
        assert isinstance(errors[0], SyncError), errors
        assert sender._staging._bufs == [] and receiver._staging._bufs == []
        uri = sender.open_epoch(["explorer-0"])
        src = _mixed_model(2)
        _send_and_receive(sender, receiver, uri, src, dst, 2)
        assert _digests(dst) == _digests(src)
    finally:
        receiver.close()
        sender.close()


def test_members_on_the_trainers_gpu_are_found_when_the_group_forms_and_left_out():
    """Device identities as NCCL ranks report them (fake UUIDs: gloo carries the same
    protocol): explorer-0 sits on the trainer's GPU, explorer-1 on its own. The first
    group does not form and says who shares a device; the next one, without them, works."""
    sender = CollectiveSender(
        "127.0.0.1", 0, timeout_s=10.0, bucket_mb=1, backend="gloo", device_id="GPU-aaaa"
    )
    same = CollectiveReceiver("explorer-0", timeout_s=10.0, device_id="GPU-aaaa")
    other = CollectiveReceiver("explorer-1", timeout_s=10.0, device_id="GPU-bbbb")
    src = {"w": torch.randn(64)}
    dst = {"w": torch.zeros(64)}
    errors: dict[str, BaseException] = {}

    def receive(receiver, uri) -> None:
        try:
            receiver.receive(uri, {"w": torch.zeros(64)}, 1)
        except BaseException as exc:
            errors[receiver.member_id] = exc

    try:
        uri = sender.open_epoch(["explorer-0", "explorer-1"])
        threads = [threading.Thread(target=receive, args=(r, uri)) for r in (same, other)]
        for t in threads:
            t.start()
        with pytest.raises(SameDeviceError) as caught:
            sender.broadcast(src, 1)
        for t in threads:
            t.join(timeout=30)
        assert caught.value.members == ("explorer-0",)
        assert "share a GPU" in str(caught.value)
        # every member was told at once, by the trainer, not by a timeout
        assert set(errors) == {"explorer-0", "explorer-1"}
        assert all(type(e) is SyncError and "share a GPU" in str(e) for e in errors.values())
        assert not sender.usable
        uri = sender.open_epoch(["explorer-1"])
        _send_and_receive(sender, other, uri, src, dst, 2)
        assert torch.equal(dst["w"], src["w"])
    finally:
        for endpoint in (same, other, sender):
            endpoint.close()
