"""``streamrft stop --run-id ID``: ask a run to stop from anywhere that reaches its broker.

It publishes a ``Shutdown`` on the run's control topic, as ``streamrft run``'s supervisor
does at the end of a run: every component (trainer, explorers, evaluators, serve
processes, on any host) stops after its current unit of work, the trainer with a
checkpoint, so the run can be resumed with its id. With ``wait_s`` it then follows the
status topic until the trainer reports STOPPED after the Shutdown (or the time is up).
"""

from __future__ import annotations

import asyncio
import time

from streamrft.app.watch.run_events import read_events
from streamrft.infra.bus import EventSender
from streamrft.infra.config import Config
from streamrft.schemas.events import RunState, Shutdown, StatusEvent

COMPONENT = "stop-command"


async def stop_run(cfg: Config, reason: str, wait_s: float) -> StatusEvent | None:
    """Send the Shutdown; with ``wait_s`` > 0, return the trainer's STOPPED status once it
    comes (None: not within ``wait_s``, or not waited for)."""
    sent_at = time.time()
    async with EventSender(cfg, COMPONENT, COMPONENT) as sender:
        await sender.control(Shutdown(reason=reason, created_at=sent_at))
    if wait_s <= 0:
        return None
    return await _trainer_stopped(cfg, sent_at, wait_s)


async def _trainer_stopped(cfg: Config, since: float, wait_s: float) -> StatusEvent | None:
    found: list[StatusEvent] = []
    done = asyncio.Event()

    def on_status(_kind: str, ev: StatusEvent) -> None:
        if ev.component == "trainer" and ev.state == RunState.STOPPED and ev.created_at >= since:
            found.append(ev)
            done.set()

    reading = read_events(
        cfg.kafka, cfg.topics(), ["status"], on_status, follow=True, stop=done,
        client_id="streamrft-stop",
    )  # fmt: skip
    try:
        await asyncio.wait_for(reading, wait_s)
    except asyncio.TimeoutError:
        return None
    return found[0] if found else None
