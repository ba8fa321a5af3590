"""``streamrft stop --run-id ID``: ask a run to stop from anywhere that reaches its broker.

It publishes a ``Shutdown`` on the run's control topic, as ``streamrft run``'s supervisor
does at the end of a run: every component (trainer, explorers, evaluators, serve
processes, on any host) stops after its current unit of work, the trainer with a
checkpoint, so the run can be resumed with its id. With ``wait_s`` it then reads the
status topic from where it ended before the Shutdown (not the run's whole history, and no
clock compared across hosts) until the trainer reports STOPPED, or the time is up.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import TopicPartition

from streamrft.infra import kafka
from streamrft.infra.bus import EventSender
from streamrft.infra.config import Config
from streamrft.infra.consume import Record, consume
from streamrft.schemas.codec import STATUS
from streamrft.schemas.events import RunState, Shutdown, StatusEvent

COMPONENT = "stop-command"


async def stop_run(cfg: Config, reason: str, wait_s: float) -> StatusEvent | None:
    """Send the Shutdown; with ``wait_s`` > 0, return the trainer's STOPPED status once it
    comes (None: not within ``wait_s``, or not waited for)."""
    status = TopicPartition(cfg.topics().status, 0)  # event topics have one partition
    reader = kafka.event_reader(cfg.kafka, [], "streamrft-stop")
    await kafka.start_client(reader, "stop's status reader")
    try:
        reader.assign([status])
        await reader.seek_to_end(status)
        await reader.position(status)  # the end as it is now, before the Shutdown
        async with EventSender(cfg, COMPONENT, COMPONENT) as sender:
            await sender.control(Shutdown(reason=reason, created_at=time.time()))
        if wait_s <= 0:
            return None
        return await _trainer_stopped(reader, status.topic, wait_s)
    finally:
        await reader.stop()


async def _trainer_stopped(reader, topic: str, wait_s: float) -> StatusEvent | None:
    found: list[StatusEvent] = []

    def on_status(rec: Record) -> bool:
        ev = rec.obj
        if ev.component == "trainer" and ev.state == RunState.STOPPED:
            found.append(ev)
            return False  # done
        return True

    try:
        await asyncio.wait_for(consume(reader, {topic: STATUS}, on_status, poll_ms=250), wait_s)
    except asyncio.TimeoutError:
        pass
    return found[0] if found else None
