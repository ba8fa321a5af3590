"""A metrics sink that stalls is never waited for and never holds more than its queue: the
events past it are dropped and counted, the ones queued are written once it moves."""

from __future__ import annotations

import threading

import pytest

from streamrft.app.watch.metric_sinks import SinkWorker
from streamrft.schemas.events import MetricsEvent

pytestmark = pytest.mark.unit


class Stalled:
    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.written: list[int] = []
        self.closed = False

    def write(self, ev: MetricsEvent) -> None:
        self.entered.set()
        self.go.wait(30)
        self.written.append(ev.step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _ev(step: int) -> MetricsEvent:
    return MetricsEvent(run="r", component="trainer", step=step, version=0, values={"a": 1.0})


def test_a_stalled_sink_holds_at_most_its_queue_and_counts_the_rest():
    sink = Stalled()
    worker = SinkWorker(sink, "exporter stalled", max_queued=10)
    worker.write(_ev(0))
    assert sink.entered.wait(10)  # the worker took it, and stalls there
    for step in range(1, 100):
        worker.write(_ev(step))
        worker.flush()  # no room for it either: skipped, never blocking
    assert worker.dropped == 99 - 9  # 10 held: the one being written and 9 waiting
    sink.go.set()
    worker.close()
    assert sink.written == list(range(10)) and sink.closed
