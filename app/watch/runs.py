"""``streamrft runs``: the runs on a broker, each with its state and last activity, read from
its status topic's heartbeats (nothing else is asked of the processes).

The brokers (:func:`find_brokers`): ``--bootstrap`` alone when given; else the config's,
the embedded services of every run under ``run.dir`` that runs now (``streamrft run``
starts them; ``status`` finds a run's the same way) and ``streamrft infra up``'s: each one
that answers, each once.

A run's state (:func:`run_state`, pure):

- ``active``: a component not stopped has sent a heartbeat within ``ACTIVE_S``;
- ``stopped``: its trainer's newest status is STOPPED (the run ended or was stopped), and
  nothing has beaten since;
- ``quiet``: components reported once, none within ``ACTIVE_S``, the trainer not stopped
  (killed, its host lost, or waiting to be resumed);
- ``new``: topics, but no status yet;
- ``unreadable``: its status topic could not be read (an ACL, say); the other rows stand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiokafka.errors import KafkaError

from streamrft.app.watch.run_events import Broker, reachable, read_events, runs_on_broker
from streamrft.app.watch.run_status import age
from streamrft.infra import admin
from streamrft.infra.bus import HEARTBEAT_S
from streamrft.infra.config import Config, KafkaConfig
from streamrft.infra.endpoints import infra_up, runs_running
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.events import RunState, StatusEvent
from streamrft.schemas.topics import NAME, TopicNames

log = logging.getLogger(__name__)

ACTIVE_S = 6 * HEARTBEAT_S
"""A component whose newest heartbeat is younger than this is taken as alive."""
READ_AT_ONCE = 8
"""Status topics read at the same time."""


@dataclass(frozen=True)
class RunRow:
    run: str
    state: str
    last_activity: float
    """Unix time of the run's newest status (0: none)."""
    components: int
    """Components that ever reported."""
    live: int
    """Components whose newest status is younger than ``ACTIVE_S`` and not STOPPED."""
    trainer_step: int
    """The trainer's newest step (-1: no trainer yet)."""
    broker: str = ""
    """The broker it is on (``host:port``)."""


def _candidates(cfg: Config, bootstrap: str | None, infra_dir: Path):
    if bootstrap:  # named on the command line: that one only
        yield bootstrap, "--bootstrap"
        return
    if cfg.kafka.bootstrap_servers:
        yield cfg.kafka.bootstrap_servers, "the config"
    for run in runs_running(Path(cfg.run.dir)):
        yield run.bootstrap_servers, run.source
    shared = infra_up(infra_dir)
    if shared is not None:
        yield shared.bootstrap_servers, shared.source


def find_brokers(cfg: Config, bootstrap: str | None, infra_dir: Path) -> list[Broker]:
    """The brokers ``runs`` lists (see the module docstring); a :class:`StreamRFTError`
    saying where it looked when none answers."""
    brokers: dict[str, Broker] = {}
    tried = []
    for servers, source in _candidates(cfg, bootstrap, infra_dir):
        if not servers or servers in brokers:
            continue
        if reachable(servers):
            kafka = msgspec.structs.replace(cfg.kafka, bootstrap_servers=servers)
            brokers[servers] = Broker(kafka, source)
        else:
            tried.append(f"{servers} ({source})")
    if not brokers:
        looked = f"tried {'; '.join(tried)}" if tried else "none named"
        raise StreamRFTError(
            f"no broker ({looked}; no run under {cfg.run.dir}/ has its services running, "
            f"no `streamrft infra up` in {infra_dir}): pass --bootstrap HOST:PORT, or a "
            "config naming the broker or run.dir"
        )
    return list(brokers.values())


def run_state(run: str, statuses: dict[str, StatusEvent], now: float) -> RunRow:
    """The row of ``run`` from the newest status of each of its components."""
    live = [
        s
        for s in statuses.values()
        if s.state != RunState.STOPPED and now - s.created_at < ACTIVE_S
    ]
    last = max((s.created_at for s in statuses.values()), default=0.0)
    trainer = statuses.get("trainer")
    if not statuses:
        state = "new"
    elif live:
        state = "active"
    elif trainer is not None and trainer.state == RunState.STOPPED:
        state = "stopped"
    else:
        state = "quiet"
    step = trainer.step if trainer is not None else -1
    return RunRow(run, state, last, len(statuses), len(live), step)


async def newest_statuses(kafka_cfg: KafkaConfig, topics: TopicNames) -> dict[str, StatusEvent]:
    newest: dict[str, StatusEvent] = {}

    def keep(_kind: str, ev: StatusEvent) -> None:
        old = newest.get(ev.component)
        if old is None or ev.created_at >= old.created_at:
            newest[ev.component] = ev

    await read_events(kafka_cfg, topics, ["status"], keep, follow=False, client_id="streamrft-runs")
    return newest


async def list_runs_on(brokers: list[Broker], now: float | None = None) -> list[RunRow]:
    """Every run of every broker of ``brokers``, newest activity first."""
    found = await asyncio.gather(*(list_runs(b.kafka, now) for b in brokers))
    rows = [row for rows in found for row in rows]
    return sorted(rows, key=lambda r: (-r.last_activity, r.run))


async def list_runs(kafka_cfg: KafkaConfig, now: float | None = None) -> list[RunRow]:
    """Every run under ``kafka.topic_prefix`` on the broker, newest activity first."""
    names = await admin.list_topics(kafka_cfg)
    runs = [r for r in runs_on_broker(names, kafka_cfg.topic_prefix) if NAME.match(r)]  # not a.b.c
    runs = [r for r in runs if TopicNames(kafka_cfg.topic_prefix, r).status in names]
    gate = asyncio.Semaphore(READ_AT_ONCE)
    servers = kafka_cfg.bootstrap_servers or ""

    async def row(run: str) -> RunRow:
        try:
            async with gate:
                topics = TopicNames(kafka_cfg.topic_prefix, run)
                statuses = await newest_statuses(kafka_cfg, topics)
        except (KafkaError, StreamRFTError) as exc:  # an ACL refusing it, say: that row only
            log.warning("run %s: its status topic could not be read: %s", run, exc)
            return RunRow(run, "unreadable", 0.0, 0, 0, -1, servers)
        row = run_state(run, statuses, time.time() if now is None else now)
        return dataclasses.replace(row, broker=servers)

    rows = await asyncio.gather(*(row(r) for r in runs))
    return sorted(rows, key=lambda r: (-r.last_activity, r.run))


def runs_table(rows: list[RunRow], now: float, brokers: list[Broker] | None = None) -> str:
    """The rows as a table, after a line naming the brokers read (``brokers``)."""
    where = ""
    if brokers:
        where = "on " + "; ".join(f"{b.kafka.bootstrap_servers} ({b.source})" for b in brokers)
    if not rows:
        return f"no runs {where or 'on this broker'}".rstrip()
    head = ["run", "state", "last activity", "components", "live", "trainer step"]
    body = [
        [
            r.run,
            r.state,
            age(now - r.last_activity) if r.last_activity else "-",
            str(r.components),
            str(r.live),
            str(r.trainer_step) if r.trainer_step >= 0 else "-",
        ]
        for r in rows
    ]
    if brokers and len(brokers) > 1:
        head.append("broker")
        for line, r in zip(body, rows, strict=True):
            line.append(r.broker)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    table = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [head, *body]
    ]
    return "\n".join([where, *table] if where else table)
