"""The stager's bookkeeping (``sync/stager.py``) with an in-process view and receive: a
version whose background receive just failed is handled once, by the sync point that
chooses it, not a second time by the background policy."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import torch

from streamrft.infra.bus import Counters
from streamrft.schemas.errors import IntegrityError, StoreUnavailable, SyncTimeout
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.stager import Staged, Stager, StagerHooks
from streamrft.sync.staging import StageMemory, StagingArea

pytestmark = pytest.mark.unit


def _event(version: int) -> ModelVersionReady:
    return ModelVersionReady(
        version=version,
        method="object_store",
        uri=f"s3://b/run/v{version}/manifest.json",
        manifest_sha256="0" * 64,
        bytes=16,
        step=version,
        created_at=time.time(),
    )


class _View:
    """The part of a control view a stager reads: versions, and a wait on a predicate."""

    def __init__(self, events: list[ModelVersionReady]) -> None:
        self.versions = {e.version: e for e in events}

    async def wait_until(self, ready, timeout, stop, what) -> bool:
        while not ready():
            if stop.is_set():
                return False
            await asyncio.sleep(0.01)
        return True


def _stager(
    receive, failed, events: list[ModelVersionReady], stop: asyncio.Event, held=lambda: 0
) -> Stager:
    """A stager on host memory whose view holds ``events``, staging nothing by itself."""
    hooks = StagerHooks(
        wanted=lambda: None,
        receive=receive,
        serves=lambda staged, event: event is not None and staged.event == event,
        failed=failed,
        held=held,
    )
    area = StagingArea(StageMemory(torch.device("cpu")))
    return Stager(area, hooks, _View(events), stop, Counters(), "explorer-0")


def test_a_failure_in_the_background_is_handled_once_by_the_sync_point_that_takes_it():
    bad, good = _event(1), _event(2)
    policy: list[int] = []

    def receive(event, stage) -> Staged:
        if event.version == 1:
            raise IntegrityError("sha256 does not match")
        return Staged(event, {"w": torch.ones(2)})

    async def failed(event, exc) -> None:
        policy.append(event.version)

    async def scenario() -> None:
        stop = asyncio.Event()
        stager = _stager(receive, failed, [bad, good], stop)
        job = stager._start(bad)  # received in the background, nobody waiting
        await job.task
        with pytest.raises(IntegrityError, match="sha256"):
            async with stager.taken(bad):
                pass
        stager.start()  # the background policy finds nothing left to handle
        async with stager.taken(good) as staged:
            assert staged.event == good and torch.equal(staged.tensors["w"], torch.ones(2))
        assert stager.area.lent() == frozenset()
        stop.set()
        stager.close()

    asyncio.run(scenario())
    assert policy == []


def test_a_sync_point_never_takes_the_failure_of_another_announcement_of_its_version():
    """A broadcast of version 1 is received in the background when the sync point chooses
    version 1's store copy (the trainer announced it because the broadcast failed): the
    broadcast's failure is the background policy's (a broadcast failed: its store copy
    serves), and the sync point receives the store copy it chose, not the broadcast's error
    as the store copy's (which stayed on older weights, or rejected the store copy)."""
    broadcast = msgspec.structs.replace(_event(1), method="nccl", uri="gloo://h:1/0?members=e")
    store = _event(1)
    gate = threading.Event()
    policy: list[str] = []

    def receive(event, stage) -> Staged:
        if event.method == "nccl":
            assert gate.wait(30), "the gate was never opened"
            raise SyncTimeout("weight-sync epoch 0: version 1 was not sent within 30s")
        return Staged(event, {"w": torch.ones(2)})

    async def failed(event, exc) -> None:
        policy.append(event.method)

    async def scenario() -> ModelVersionReady:
        stop = asyncio.Event()
        stager = _stager(receive, failed, [broadcast, store], stop)
        stager._start(broadcast)  # joined in the background
        take = asyncio.create_task(_took(stager, store))
        for _ in range(10):  # the sync point reaches the receive under way (loop turns)
            await asyncio.sleep(0)
        gate.set()
        took = await take
        stager.start()  # the background policy handles the broadcast's failure
        await asyncio.wait_for(_until(lambda: policy), 30)
        stop.set()
        stager.close()
        return took

    assert asyncio.run(scenario()) == store
    assert policy == ["nccl"]


async def _took(stager: Stager, event: ModelVersionReady) -> ModelVersionReady:
    async with stager.taken(event) as staged:
        return staged.event


async def _until(ready) -> None:
    while not ready():
        await asyncio.sleep(0.01)


def test_a_receive_close_cut_off_keeps_its_stage_until_its_thread_ends_and_a_take_works():
    """close() while a receive runs in its thread (which cannot be stopped): its stage is
    lent to nothing else until the thread has ended, and a later take of that version waits
    for it, then receives the version again into the stage (it failed with 'lent already',
    which rejected a good version). A receive close() cancels before it began holds nothing."""
    wanted = _event(1)
    gate, entered = threading.Event(), threading.Event()
    calls: list[int] = []  # the versions received, in order

    def receive(event, stage) -> Staged:
        calls.append(event.version)
        raw = stage.host_bytes(8)
        if len(calls) == 1:  # the one close() cuts off
            entered.set()
            assert gate.wait(30), "the gate was never opened"
        raw.fill_(len(calls))  # which receive wrote it
        return Staged(event, {"w": raw})

    async def failed(event, exc) -> None:
        raise AssertionError(f"no failure expected: {exc!r}")

    async def scenario() -> None:
        stop = asyncio.Event()
        stager = _stager(receive, failed, [wanted], stop)
        stager._start(wanted)
        assert await asyncio.to_thread(entered.wait, 30)
        stager.close()
        take = asyncio.create_task(_took_w(stager, wanted))
        for _ in range(10):  # the cancellation and the take go round (loop turns)
            await asyncio.sleep(0)
        assert not take.done() and calls == [1]  # the take waits for the thread...
        assert stager.area.lent() == {"version"}  # ...which still has the stage
        gate.set()
        second = await asyncio.wait_for(take, 30)
        assert torch.equal(second, torch.full((8,), 2, dtype=torch.uint8))
        assert calls == [1, 1] and stager.area.lent() == frozenset()
        stager._start(wanted)
        stager.close()  # before the receive began: it never lends the stage
        third = await asyncio.wait_for(_took_w(stager, wanted), 30)
        assert torch.equal(third, torch.full((8,), 3, dtype=torch.uint8))
        assert calls == [1, 1, 1] and stager.area.lent() == frozenset()
        stop.set()
        stager.close()

    asyncio.run(scenario())


async def _took_w(stager: Stager, event: ModelVersionReady) -> torch.Tensor:
    async with stager.taken(event) as staged:
        return staged.tensors["w"].clone()


def test_pauses_after_failures_keep_only_versions_that_may_still_be_received():
    """An announcement that failed in the background is left alone a while (a pause each):
    the pauses of versions retired, or no newer than the one held, are forgotten as new
    ones come (they piled up, one per failed announcement, for the run's life)."""
    events = [_event(v) for v in (1, 2, 3, 4)]
    held = [0]
    handled: list[int] = []

    def receive(event, stage) -> Staged:
        raise StoreUnavailable("the store did not answer")

    async def failed(event, exc) -> None:
        handled.append(event.version)

    async def scenario() -> set:
        stop = asyncio.Event()
        stager = _stager(receive, failed, events, stop, held=lambda: held[0])
        stager.start()
        for event in events[:3]:
            await stager._start(event).task  # nobody waits: the background policy's
        await asyncio.wait_for(_until(lambda: len(handled) == 3), 30)
        assert {v for v, _ in stager._retry_at} == {1, 2, 3}
        held[0] = 2  # the model holds version 2 now...
        del stager.view.versions[3]  # ...and version 3 was retired
        await stager._start(events[3]).task
        await asyncio.wait_for(_until(lambda: len(handled) == 4), 30)
        stop.set()
        stager.close()
        return set(stager._retry_at)

    assert asyncio.run(scenario()) == {(4, events[3].uri)}
