"""One way to read a run from outside it: its event topics, on the broker that holds them.

The monitor of ``streamrft run``, ``streamrft status``, ``tail --run-id``, the exporters
(``export-metrics``) and the dashboard all read a run through here: a group-less reader
(nothing committed, any number of readers) of the run's ``metrics``, ``status``,
``control`` and ``dead_letters`` topics from their beginning, following them or stopping
once they have gone quiet. ``find_broker`` finds the broker of a run the way ``explore
--run-id`` does, and says None when none is reachable: the embedded broker of a finished
run stops with it (then ``<run dir>/metrics.jsonl`` is what is left, ``metrics_log``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from streamrft.infra import admin, kafka
from streamrft.infra.config import Config, KafkaConfig
from streamrft.infra.consume import Record, consume
from streamrft.infra.endpoints import INFRA_DIR, infra_up, of_run, of_run_config
from streamrft.infra.pids import port_open
from streamrft.schemas.codec import CONTROL, DEAD_LETTER, METRICS, SAMPLE, STATUS, Codec
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.topics import TopicNames

log = logging.getLogger(__name__)

EVENT_CODECS: dict[str, Codec[Any]] = {
    "metrics": METRICS,
    "status": STATUS,
    "control": CONTROL,
    "dead_letters": DEAD_LETTER,
    "samples": SAMPLE,
}
"""The run's event topics by kind, and how each decodes (``samples``: the decoded
rollouts explorers show)."""


@dataclass(frozen=True)
class Broker:
    """A reachable broker of a run, and where it was found (for messages)."""

    kafka: KafkaConfig
    source: str


def reachable(bootstrap: str, timeout: float = 1.0) -> bool:
    """Whether any of ``host:port[,host:port...]`` accepts a TCP connection."""
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            if port_open(int(port), timeout, host.strip("[]") or "127.0.0.1"):
                return True
        except ValueError:
            continue
    return False


def _candidates(cfg: Config, bootstrap: str | None, infra_dir: Path | None):
    if bootstrap:  # named on the command line: that one only
        yield bootstrap, "--bootstrap"
        return
    if cfg.kafka.bootstrap_servers:
        yield cfg.kafka.bootstrap_servers, "the config"
    if cfg.run.id:
        try:
            found = of_run(cfg)
        except StreamRFTError:  # its embedded services have stopped: its config.yaml
            found = of_run_config(cfg)
        if found is not None and found.bootstrap_servers:
            yield found.bootstrap_servers, found.source
            return  # the run's own record says where it ran: no other broker holds it
    found = infra_up(infra_dir or Path(cfg.run.dir) / INFRA_DIR)
    if found is not None and found.bootstrap_servers:
        yield found.bootstrap_servers, found.source


def find_broker(
    cfg: Config, bootstrap: str | None = None, infra_dir: Path | None = None
) -> Broker | None:
    """The broker of run ``cfg.run.id``: ``bootstrap`` (then that one only), else the
    config's, else the run's own record (its embedded services while they run, else its
    resolved ``config.yaml``; when the run folder has one, no other broker is tried), else
    ``streamrft infra up``'s (``infra_dir``, default ``<run.dir>/infra``); the first that
    answers. None: none does."""
    return _search(cfg, bootstrap, infra_dir)[0]


def _search(cfg: Config, bootstrap: str | None, infra_dir: Path | None):
    tried: list[str] = []
    for servers, source in _candidates(cfg, bootstrap, infra_dir):
        if reachable(servers):
            return Broker(
                msgspec.structs.replace(cfg.kafka, bootstrap_servers=servers), source
            ), tried
        tried.append(f"{servers} ({source})")
    return None, tried


def need_broker(cfg: Config, bootstrap: str | None = None, infra_dir: Path | None = None) -> Broker:
    """``find_broker``, or a clear error saying what was tried."""
    found, tried = _search(cfg, bootstrap, infra_dir)
    if found is None:
        looked = "; ".join(tried) if tried else "no broker named anywhere"
        metrics = cfg.run_dir / "metrics.jsonl"
        left = (
            f"a finished run's embedded broker stopped with it: its metrics remain in {metrics}"
            if metrics.exists()
            else f"and there is no run folder {cfg.run_dir} with a metrics.jsonl either"
        )
        raise StreamRFTError(f"run {cfg.run.id}: no reachable broker (tried: {looked}); {left}")
    return found


async def check_run_exists(broker: Broker, topics: TopicNames) -> None:
    """Raise a clear error unless the broker holds the run's topics (reading a topic that
    does not exist would create it on a broker that creates topics on demand)."""
    names = await admin.list_topics(broker.kafka)
    if topics.status in names:
        return
    others = runs_on_broker(names, topics.prefix)
    raise StreamRFTError(
        f"run {topics.run}: no topics on {broker.kafka.bootstrap_servers} (found via "
        f"{broker.source}); runs there: {', '.join(others) or 'none'}"
    )


Handler = Callable[[str, Any], Any]


async def read_events(
    kafka_cfg: KafkaConfig,
    topics: TopicNames,
    kinds: Sequence[str],
    handle: Handler,
    *,
    follow: bool,
    stop: asyncio.Event | None = None,
    on_bad: Callable[[Record], Any] | None = None,
    after_poll: Callable[[list[Record]], Any] | None = None,
    client_id: str = "streamrft-reader",
) -> int:
    """Read the run's event topics of ``kinds`` from the beginning; ``handle(kind, event)``
    gets every good event in each partition's order. ``follow``: until ``stop`` is set (then
    drained until quiet). Else until caught up with the end each partition had at its last
    fetch, or quiet for about a second: a live run's heartbeats never go quiet, so "the
    end" is where the reader caught up. Undecodable records go to ``on_bad`` (default: a
    warning). Returns how many were handled.
    """
    if follow and stop is None:
        stop = asyncio.Event()  # never set: follow until cancelled
    names = {topics.of(kind): kind for kind in kinds}
    codecs = {name: EVENT_CODECS[kind] for name, kind in names.items()}

    def bad(rec: Record) -> Any:
        if on_bad is not None:
            return on_bad(rec)
        log.warning("undecodable event on %s offset %s: %s", rec.topic, rec.offset, rec.error)
        return None

    reader = kafka.event_reader(kafka_cfg, list(codecs), client_id)
    await kafka.start_client(reader, client_id)
    done, quiet = asyncio.Event(), 0

    async def after(records: list[Record]) -> None:
        nonlocal quiet
        if after_poll is not None:
            await _maybe_await(after_poll(records))
        quiet = 0 if records else quiet + 1
        if not follow and (quiet >= 4 or await caught_up(reader, len(names))):
            done.set()

    try:
        return await consume(
            reader,
            codecs,
            lambda rec: handle(names[rec.topic], rec.obj),
            on_bad=bad,
            stop=stop if follow else done,
            until_quiet=4 if follow else None,
            poll_ms=250,
            after_poll=after,
        )
    finally:
        with contextlib.suppress(Exception):
            await reader.stop()


async def caught_up(reader: Any, topics: int) -> bool:
    """Every partition of the ``topics`` subscribed topics is assigned, has been fetched
    once, and is read up to that fetch's high-water mark."""
    parts = reader.assignment()
    if len({tp.topic for tp in parts}) < topics:
        return False
    for tp in parts:
        high = reader.highwater(tp)
        if high is None or await reader.position(tp) < high:
            return False
    return True


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


def runs_on_broker(topic_names: Sequence[str], prefix: str) -> list[str]:
    """Run ids with topics under ``<prefix>.`` among ``topic_names``, sorted."""
    runs = set()
    for name in topic_names:
        head, _, kind = name.rpartition(".")
        pre, _, run = head.partition(".")
        if pre == prefix and run and TopicNames.kind_of(name) == kind:
            runs.add(run)
    return sorted(runs)
