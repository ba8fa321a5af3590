"""Waiting on a condition inside a test's event loop, with a deadline (never a bare sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(ready: Callable[[], object], timeout: float, what: str, every: float = 0.05):
    """Poll ``ready()`` until it is truthy; fail naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ready():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(every)


def outcome_within(
    call: Callable[[], object], timeout: float, unblock: Callable[[], None]
) -> BaseException | None:
    """What ``call()`` raised (None: it returned), run on a thread given ``timeout`` seconds;
    a call still blocked then is let go by ``unblock()`` (e.g. a writer opens the FIFO it
    waits on) and fails the test."""
    import threading

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        unblock()
        thread.join(timeout)
        raise AssertionError(f"the call was still blocked after {timeout:.0f}s")
    return outcome[0]


def open_fifo_writer(path: object) -> None:
    """Open the FIFO ``path`` for writing, then close it: a reader blocked opening it goes on."""
    import os

    try:
        os.close(os.open(str(path), os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waits on it
        pass
