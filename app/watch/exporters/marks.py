"""What an exporter has already written, so a second export of a run appends only the new.

``streamrft export-metrics`` reads a run's metrics from the beginning every time, and a
resumed run's monitor reads its topic again. A value is new when its event's
``created_at`` is later than the newest ``created_at`` already written of the same metric
(a ``(component, key)`` pair, :attr:`Point.name`): time moves forward across restarts,
steps do not. An explorer restarted by the supervisor, and every explorer of a resumed
run, counts its steps from 0 again; its new values are written although their steps
were written before (the backend then holds both attempts at the same steps, as
TensorBoard holds a restarted job's). A resumed trainer that redoes a step reports it
again, and both reports are kept.

Each exporter recovers the marks, when it opens, from what its backend stores: the wall
time of TensorBoard's events, the timestamp of MLflow's metrics, a file of its own beside
W&B's. The times are in the backend's own unit (seconds, or MLflow's milliseconds), the
same one the exporter compares in.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamrft.app.watch.exporters.names import Point

NEVER = float("-inf")
"""The mark of a metric nothing was written of yet."""


class Watermarks:
    """The newest ``created_at`` written of each metric, by :attr:`Point.name`."""

    def __init__(self, marks: dict[str, float] | None = None) -> None:
        self.marks: dict[str, float] = dict(marks or {})
        self.skipped = 0
        """Values left out because a value at their time or later was already written."""

    def seen(self, name: str, at: float) -> None:
        """Note that ``name`` holds a value created at ``at`` (read back from the backend)."""
        if at > self.marks.get(name, NEVER):
            self.marks[name] = at

    def fresh(self, points: Iterable[Point], at: float) -> list[Point]:
        """The points, created at ``at``, later than their metric's mark; marked as
        written from now."""
        out = []
        for p in points:
            if at <= self.marks.get(p.name, NEVER):
                self.skipped += 1
                continue
            self.marks[p.name] = at
            out.append(p)
        return out
