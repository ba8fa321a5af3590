"""Concurrent requests coalesced into one engine call.

Requests that arrive while the engine is busy wait in a queue; when it is free, every
waiting request with the same ``n`` and sampling settings (temperature, ``max_tokens``,
``top_p``, ``top_k``) as the oldest one (up to
``max_batch`` prompts) goes into the next engine call, the others into the calls after it.
One caller at a time reaches the engine, so a version swapped in by the caller between two
calls (``call`` holds the caller's lock) never lands inside one. A request's ``seed`` seeds
the call only when it is the oldest of its batch (seeding is best effort, as in the OpenAI
API).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.schemas.errors import ServiceError


@dataclass(frozen=True)
class Sampling:
    """What one engine call samples with, besides its prompts and seed."""

    n: int
    temperature: float
    max_tokens: int
    top_p: float = 1.0
    top_k: int = 0


Call = Callable[[list[list[int]], Sampling, int], Awaitable[tuple[list[list[Rollout]], int]]]
"""``(prompts, sampling, seed) -> (rollouts per prompt, version)``."""


def engine_call(
    engine: RolloutEngine, prompts: list[list[int]], sampling: Sampling, seed: int
) -> list[list[Rollout]]:
    """One ``engine.rollout`` call of ``prompts`` with ``sampling`` (blocking)."""
    return engine.rollout(
        prompts,
        sampling.n,
        sampling.temperature,
        sampling.max_tokens,
        seed,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )


@dataclass
class _Waiting:
    prompt: list[int]
    key: Sampling
    seed: int
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Batcher:
    """See the module docstring; ``call`` does one engine call (in a thread)."""

    def __init__(self, call: Call, max_batch: int) -> None:
        self.call = call
        self.max_batch = max_batch
        self.queue: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._current: list[_Waiting] = []
        """The batch of the engine call in progress."""
        self.calls = 0

    async def sample(
        self, prompt: list[int], sampling: Sampling, seed: int
    ) -> tuple[list[Rollout], int]:
        """``sampling.n`` rollouts of ``prompt`` and the version that sampled them."""
        if self._worker is None:
            self._worker = asyncio.create_task(self._run())
            self._worker.add_done_callback(self._ended)
        waiting = _Waiting(prompt, sampling, seed)
        self.queue.append(waiting)
        self._wake.set()
        return await waiting.done

    def _next_batch(self) -> list[_Waiting]:
        key = self.queue[0].key
        batch = [w for w in self.queue if w.key == key][: self.max_batch]
        taken = {id(w) for w in batch}
        self.queue = [w for w in self.queue if id(w) not in taken]
        return batch

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                batch = self._current = self._next_batch()
                prompts = [w.prompt for w in batch]
                try:
                    rollouts, version = await self.call(prompts, batch[0].key, batch[0].seed)
                    answers = list(zip(batch, rollouts, strict=True))
                except Exception as exc:  # handed to every request of the batch
                    for w in batch:
                        if not w.done.done():
                            w.done.set_exception(exc)
                    continue
                self.calls += 1
                for w, r in answers:
                    if not w.done.done():
                        w.done.set_result((r, version))

    def _ended(self, worker: asyncio.Task) -> None:
        """The worker ended (it only ends by a failure past its own handling, or a close):
        every request waiting gets that error, and the next request starts a new worker,
        so no request waits for ever on a dead one."""
        if self._worker is worker:
            self._worker = None
        error = (
            ServiceError("the request batcher was closed")
            if worker.cancelled()
            else ServiceError(f"the request batcher failed: {worker.exception()!r}")
        )
        waiting, self.queue, self._current = self._current + self.queue, [], []
        for w in waiting:
            if not w.done.done():
                w.done.set_exception(error)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
