"""The stager's bookkeeping (``sync/stager.py``) with an in-process view and receive: a
version whose background receive just failed is handled once, by the sync point that
chooses it, not a second time by the background policy."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from streamrft.infra.bus import Counters
from streamrft.schemas.errors import IntegrityError
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
        hooks = StagerHooks(
            wanted=lambda: None,
            receive=receive,
            serves=lambda staged, event: event is not None and staged.event == event,
            failed=failed,
            held=lambda: 0,
        )
        stager = Stager(
            StagingArea(StageMemory(torch.device("cpu"))),
            hooks,
            _View([bad, good]),
            stop,
            Counters(),
            "explorer-0",
        )
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
