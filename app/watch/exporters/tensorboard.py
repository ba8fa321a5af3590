"""TensorBoard event files: ``<monitor.tensorboard_dir>/<component>/events.out.tfevents.*``.

Written with TensorBoard's own event writer (no TensorFlow, no torch); one subfolder, a
TensorBoard run, per component (:mod:`.names`), scalars on the component's step with the
event's ``created_at`` as wall time. ``tensorboard --logdir <that folder>`` shows them.
An export again (or a resumed run's monitor) reads the event files already in a
component's folder and adds a new file with only the values created after the newest
wall time of their tag there (:mod:`.marks`).
"""

from __future__ import annotations

import time
from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from streamrft.app.watch.exporters.marks import Watermarks
from streamrft.app.watch.exporters.names import points
from streamrft.infra.config import Config
from streamrft.schemas.events import MetricsEvent


def tensorboard_dir(cfg: Config) -> Path:
    """``monitor.tensorboard_dir``, or ``<run dir>/tensorboard``."""
    return (
        Path(cfg.monitor.tensorboard_dir)
        if cfg.monitor.tensorboard_dir
        else cfg.run_dir / "tensorboard"
    )


def written_times(folder: Path, marks: Watermarks) -> None:
    """Note in ``marks`` the newest wall time (an event's ``created_at``) of every tag in
    the event files of ``folder`` (one component's run)."""
    for path in sorted(folder.glob("events.out.tfevents.*")):  # none: a new folder
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                marks.seen(f"{folder.name}/{value.tag}", event.wall_time)


class TensorBoardExporter:
    name = "tensorboard"

    def __init__(self, cfg: Config) -> None:
        self.root = tensorboard_dir(cfg)
        self.where = str(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._writers: dict[str, EventFileWriter] = {}
        self._marks = Watermarks()
        self._read: set[str] = set()
        """Components whose folder's event files have been read into the marks."""

    def _fresh(self, ev: MetricsEvent, wall: float) -> dict[str, list[Summary.Value]]:
        """The values of ``ev`` (created at ``wall``) not written yet, by component folder."""
        out: dict[str, list[Summary.Value]] = {}
        for p in points(ev):
            if p.component not in self._read:
                self._read.add(p.component)
                written_times(self.root / p.component, self._marks)
            if self._marks.fresh([p], wall):
                value = Summary.Value(tag=p.tag, simple_value=p.value)
                out.setdefault(p.component, []).append(value)
        return out

    def write(self, ev: MetricsEvent) -> None:
        wall = ev.created_at or time.time()
        for component, values in self._fresh(ev, wall).items():
            writer = self._writers.get(component)
            if writer is None:
                writer = self._writers[component] = EventFileWriter(str(self.root / component))
            writer.add_event(Event(wall_time=wall, step=ev.step, summary=Summary(value=values)))

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        writers, self._writers = self._writers, {}
        for writer in writers.values():
            writer.close()
