"""Where the run monitor sends every metrics event: ``metrics.jsonl`` and the exporters;
and every sample: ``samples.jsonl``.

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

from streamrft.app.watch.metrics_log import MetricsLog, metrics_path
from streamrft.app.watch.samples_log import SamplesLog, samples_path
from streamrft.infra.config import Config

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 60.0
"""How long closing a run waits for a sink to write what it was given."""
MAX_QUEUED = 1000
"""Events a sink may be behind by (a trainer event with its ledger is tens of KB); more
are dropped and counted, with one warning, rather than held for a sink that stalls."""


class Sink(Protocol):
    def write(self, ev: Any) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


_FLUSH = object()
_CLOSE = object()


class SinkWorker:
    """One sink on its own thread. ``write`` and ``flush`` only enqueue and never raise or
    block: an event finding ``max_queued`` waiting is dropped (``dropped``, one warning);
    ``close`` waits (up to ``CLOSE_WAIT_S``) until everything queued was written."""

    def __init__(self, sink: Sink, name: str, max_queued: int = MAX_QUEUED) -> None:
        self.sink = sink
        self.name = name
        self.failed: str | None = None
        self.dropped = 0
        """Events not written: the sink held ``max_queued`` already (the one it was writing
        included)."""
        self.max_queued = max_queued
        self._room = threading.Semaphore(max_queued)
        """One per event the queue may still take (flush and close markers take none)."""
        self._flush_queued = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"sink-{name}", daemon=True)
        self._thread.start()

    def write(self, ev: Any) -> None:
        if self.failed is not None:
            return
        if self._room.acquire(blocking=False):
            self._queue.put(ev)
        else:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "%s is %d events behind (stalled?); events are dropped and counted until "
                    "it catches up (`streamrft export-metrics` can send the run again later)",
                    self.name,
                    self.max_queued,
                )

    def flush(self) -> None:
        if self.failed is None and not self._flush_queued:  # one waiting flush is enough
            self._flush_queued = True
            self._queue.put(_FLUSH)

    def close(self) -> None:
        self._queue.put(_CLOSE)
        if self.dropped:
            log.warning("%s: %d events were dropped (it was behind)", self.name, self.dropped)
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
                if item is _FLUSH:
                    self._flush_queued = False
                    if self.failed is None:
                        self.sink.flush()
                    continue
                try:
                    if self.failed is None:  # else: queued before the failure was noticed
                        self.sink.write(item)
                finally:
                    self._room.release()
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


def open_samples_sink(cfg: Config) -> SinkWorker:
    """``<run dir>/samples.jsonl`` (the newest samples of each explorer) on its worker."""
    samples = SamplesLog(samples_path(cfg.run_dir))
    return SinkWorker(samples, f"samples file {samples.path}")


def open_sinks(cfg: Config) -> list[SinkWorker]:
    """``<run dir>/metrics.jsonl`` and the exporters of ``monitor.exporters``, each on its
    worker. Blocking (an exporter may reach a server): call it off the event loop. An
    exporter that cannot open raises (a configuration error), closing what was opened."""
    metrics_file = MetricsLog(metrics_path(cfg.run_dir))
    sinks = [SinkWorker(metrics_file, f"metrics file {metrics_file.path}")]
    if not cfg.monitor.exporters:
        return sinks
    from streamrft.app.watch.exporters import open_exporters

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
