"""Where the run monitor sends every metrics event: ``metrics.jsonl`` and the exporters.

Each sink runs on a thread of its own behind a queue (``SinkWorker``): the supervisor's
event loop, which also handles signals and restarts children, never waits on a file or
on an exporter's network, and a sink that fails is dropped with a warning naming it; the
run, and every other sink, go on.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Protocol

from streamrft.infra.app.metrics_log import MetricsLog, metrics_path
from streamrft.infra.config import Config
from streamrft.schemas.events import MetricsEvent

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 60.0
"""How long closing a run waits for a sink to write what it was given."""


class Sink(Protocol):
    def write(self, ev: MetricsEvent) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


_FLUSH = object()
_CLOSE = object()


class SinkWorker:
    """One sink on its own thread. ``write`` and ``flush`` only enqueue and never raise;
    ``close`` waits (up to ``CLOSE_WAIT_S``) until everything given was written."""

    def __init__(self, sink: Sink, name: str) -> None:
        self.sink = sink
        self.name = name
        self.failed: str | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"sink-{name}", daemon=True)
        self._thread.start()

    def write(self, ev: MetricsEvent) -> None:
        if self.failed is None:
            self._queue.put(ev)

    def flush(self) -> None:
        if self.failed is None:
            self._queue.put(_FLUSH)

    def close(self) -> None:
        self._queue.put(_CLOSE)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning(
                "%s: still writing after %.0f s; the run ends without waiting for it",
                self.name,
                CLOSE_WAIT_S,
            )

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _CLOSE:
                    if self.failed is None:
                        self.sink.close()
                    return
                if self.failed is not None:
                    continue  # what was queued before the failure was noticed
                if item is _FLUSH:
                    self.sink.flush()
                else:
                    self.sink.write(item)
            except Exception as exc:  # any exporter error: drop this sink, keep the run
                self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if self.failed is None:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning(
                "%s failed (%s); it gets no more metrics in this run (the run goes on; "
                "monitor.exporters, or `streamrft export-metrics` later)",
                self.name,
                self.failed,
            )
            try:
                self.sink.close()
            except Exception as close_exc:
                log.warning("%s: closing after the failure failed too: %s", self.name, close_exc)


def open_sinks(cfg: Config) -> list[SinkWorker]:
    """``<run dir>/metrics.jsonl`` and the exporters of ``monitor.exporters``, each on its
    worker. Blocking (an exporter may reach a server): call it off the event loop. An
    exporter that cannot open raises (a configuration error), closing what was opened."""
    metrics_file = MetricsLog(metrics_path(cfg.run_dir))
    sinks = [SinkWorker(metrics_file, f"metrics file {metrics_file.path}")]
    if not cfg.monitor.exporters:
        return sinks
    from streamrft.infra.app.exporters import open_exporters

    try:
        exporters = open_exporters(cfg, cfg.monitor.exporters, strict=False)
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks + [
        SinkWorker(e, f"exporter {getattr(e, 'name', type(e).__name__)}") for e in exporters
    ]


def close_sinks(sinks: list[SinkWorker]) -> None:
    """Close every sink (each waits for its queue); blocking."""
    for sink in sinks:
        sink.close()
