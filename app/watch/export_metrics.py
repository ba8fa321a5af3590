"""``streamrft export-metrics``: a run's metrics into TensorBoard, W&B or MLflow, any time.

The source is the run's metrics topic, read from the beginning on the broker found as
``explore --run-id`` finds it (:func:`~streamrft.app.watch.run_events.find_broker`), with
``--follow`` until Ctrl-C / SIGTERM (flushing after every poll); when no broker is
reachable or it has no metrics topic of the run (a finished run's embedded broker stops
with it), ``<run dir>/metrics.jsonl``; or a file given with ``--from-file``. The source is
named on stderr (``--dir`` names the state folder of ``streamrft infra up`` when it is not
``<run.dir>/infra``). Exporting the same run again appends only what is new (each
exporter writes a metric's value of a given ``created_at`` once, :mod:`.exporters.marks`).
The exporters open at the first event, so a run without metrics leaves no empty W&B or
MLflow run behind.

A running ``streamrft run`` already exports its metrics to its ``monitor.exporters`` as
it goes (TensorBoard by default). A second exporter writing to the same TensorBoard folder
at the same time duplicates every point (each keeps its own marks), so
``export-metrics --follow`` is for a run started without that exporter (``-o
monitor.exporters=[]``, or without ``wandb``/``mlflow``), or to export elsewhere (another
exporter, another ``monitor.tensorboard_dir``). Once a run has finished, exporting it again
to the same place adds only what is missing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from streamrft.app.watch.exporters import Backend, Exporter, backends, close_all, open_backend
from streamrft.app.watch.metrics_log import iter_metrics, metrics_path
from streamrft.app.watch.run_events import Broker, find_broker, read_events
from streamrft.infra import admin
from streamrft.infra.config import Config
from streamrft.infra.signals import install_stop_handlers
from streamrft.schemas.errors import ConfigError, StreamRFTError
from streamrft.schemas.events import MetricsEvent


@dataclass
class Sink:
    """The chosen exporters, opened at the first event (:func:`open_backend`'s rules)."""

    cfg: Config
    chosen: list[tuple[str, Backend]]
    strict: bool
    exporters: list[Exporter] = field(default_factory=list)
    events: int = 0
    opened: bool = False

    def _open(self) -> None:
        self.opened = True
        for name, backend in self.chosen:
            exporter = open_backend(self.cfg, name, backend, strict=self.strict)
            if exporter is not None:
                self.exporters.append(exporter)
        if not self.exporters:
            names = [name for name, _ in self.chosen]
            raise ConfigError(f"monitor.exporters: none of {names} can run here")

    def write(self, ev: MetricsEvent) -> None:
        if not self.opened:
            self._open()
        self.events += 1
        for exp in self.exporters:
            exp.write(ev)

    def flush(self) -> None:
        for exp in self.exporters:
            exp.flush()

    def close(self) -> None:
        exporters, self.exporters = self.exporters, []
        close_all(exporters)


@dataclass(frozen=True)
class Outcome:
    """What an export did, for the final line."""

    events: int
    source: str
    exporters: list[tuple[str, str]]
    """``(name, where its files are)`` of each exporter."""

    def line(self, run_id: str) -> str:
        where = "; ".join(f"{name}: {path}" for name, path in self.exporters)
        return (
            f"exported {self.events} metrics events of run {run_id} from {self.source} to {where}"
        )


def _file_source(path: Path) -> tuple[str, Path]:
    if not path.is_file():
        raise StreamRFTError(f"--from-file: {path} does not exist")
    return f"file {path}", path


async def _topic_has_metrics(broker: Broker, topic: str) -> bool:
    return topic in await admin.list_topics(broker.kafka)


def choose_source(
    cfg: Config, bootstrap: str | None, infra_dir: Path | None = None
) -> tuple[str, Broker | Path]:
    """Where run ``cfg`` 's metrics are read from: its topic on a reachable broker (found
    as :func:`find_broker` finds it), else ``<run dir>/metrics.jsonl``; a
    :class:`StreamRFTError` saying what was looked at when neither is there."""
    topic = cfg.topics().metrics
    jsonl = metrics_path(cfg.run_dir)
    broker = find_broker(cfg, bootstrap, infra_dir)
    if broker is not None and asyncio.run(_topic_has_metrics(broker, topic)):
        return f"topic {topic} on {broker.kafka.bootstrap_servers} ({broker.source})", broker
    if jsonl.is_file():
        why = "no reachable broker" if broker is None else f"no topic {topic} on the broker"
        return f"file {jsonl} ({why})", jsonl
    on_broker = (
        "no reachable broker (looked at --bootstrap, the config, the run's embedded services "
        "and `streamrft infra up`)"
        if broker is None
        else f"the broker {broker.kafka.bootstrap_servers} has no topic {topic}"
    )
    raise StreamRFTError(
        f"run {cfg.run.id}: no metrics to export: {on_broker}, and {jsonl} does not exist "
        "(is the run id right? pass --bootstrap HOST:PORT, or --from-file PATH)"
    )


async def _from_topic(cfg: Config, broker: Broker, sink: Sink, follow: bool) -> None:
    stop = asyncio.Event()
    if follow:
        install_stop_handlers(stop, "export-metrics")
    await read_events(
        broker.kafka,
        cfg.topics(),
        ["metrics"],
        lambda _kind, ev: sink.write(ev),
        follow=follow,
        stop=stop,
        after_poll=lambda records: sink.flush() if records else None,
        client_id="streamrft-export-metrics",
    )


def _from_events(events: Iterable[MetricsEvent], sink: Sink) -> None:
    for ev in events:
        sink.write(ev)


def export_metrics(
    cfg: Config,
    names: Sequence[str],
    *,
    strict: bool = True,
    follow: bool = False,
    bootstrap: str | None = None,
    infra_dir: Path | None = None,
    from_file: Path | None = None,
) -> Outcome:
    """Export run ``cfg.run.id``'s metrics to the exporters ``names`` (see the module
    docstring); :class:`ConfigError` for an exporter that cannot run, before reading."""
    chosen = backends(names, strict=strict)
    if not chosen:
        raise ConfigError(f"monitor.exporters: none of {list(names)} can run here")
    source, where = (
        _file_source(from_file) if from_file else choose_source(cfg, bootstrap, infra_dir)
    )
    if follow and not isinstance(where, Broker):
        print("--follow: the source is a file, exported as it is now", file=sys.stderr)
    print(f"export-metrics: reading run {cfg.run.id}'s metrics from {source}", file=sys.stderr)
    sink = Sink(cfg, chosen, strict)
    try:
        if isinstance(where, Broker):
            asyncio.run(_from_topic(cfg, where, sink, follow))
        else:
            _from_events(iter_metrics(where), sink)
        opened = [(exp.name, exp.where) for exp in sink.exporters]
    finally:
        sink.close()
    if sink.events == 0:
        raise StreamRFTError(f"run {cfg.run.id}: no metrics events in {source}; nothing exported")
    return Outcome(sink.events, source, opened)
