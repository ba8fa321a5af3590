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
