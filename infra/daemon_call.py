"""A blocking call awaited from the event loop on a daemon thread of its own.

``asyncio.to_thread`` runs a call on the loop's pool, whose threads ``asyncio.run`` and
the interpreter's exit both wait for: a call abandoned at a deadline (user code stuck in
a workflow, an upload to a slow store when a signal asks the process to stop) would hold
the process past it. A daemon thread ends with the process instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


def on_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "call") -> asyncio.Future:
    """``fn(*args)`` on a daemon thread named ``name``; the future has its result or its
    error. A future cancelled or no longer awaited leaves the thread to finish alone (its
    result dropped), or to end with the process."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():  # abandoned
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as err:  # handed to the awaiting task, whatever it is
            result, exc = None, err
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future
