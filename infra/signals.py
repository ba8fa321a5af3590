"""Signal handling: the first SIGINT/SIGTERM sets a stop flag; a second one forces exit."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger(__name__)


def install_stop_handlers(stop: asyncio.Event, name: str) -> None:
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def _handler(signum: int) -> None:
        hits["n"] += 1
        if hits["n"] == 1:
            log.info(
                "%s: %s received, stopping after the current unit of work",
                name,
                signal.Signals(signum).name,
            )
            stop.set()
        else:
            log.warning("%s: second signal, exiting now", name)
            os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _handler, sig)
