"""Signal handling for every process: the first SIGINT/SIGTERM asks for an orderly stop,
a second one forces the exit (status 130)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

log = logging.getLogger(__name__)


class StopSignals:
    """Installed on the running loop by :func:`install_stop_handlers`."""

    def __init__(self, stop: asyncio.Event, name: str, on_force: Callable[[], None] | None):
        self.stop = stop
        self.name = name
        self.on_force = on_force
        self.received: str | None = None
        """Name of the first signal received (``SIGINT``, ``SIGTERM``), None before one."""

    def _handle(self, signum: int) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            log.info(
                "%s: %s received, stopping after the current unit of work (again to force)",
                self.name,
                self.received,
            )
            self.stop.set()
            return
        log.warning("%s: second signal, exiting now", self.name)
        if self.on_force is not None:
            self.on_force()
        os._exit(130)


def install_stop_handlers(
    stop: asyncio.Event, name: str, on_force: Callable[[], None] | None = None
) -> StopSignals:
    """First SIGINT/SIGTERM: set ``stop``. Second: ``on_force()`` (e.g. kill the children),
    then exit with status 130 at once."""
    handlers = StopSignals(stop, name, on_force)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handlers._handle, sig)
    return handlers
