"""What an exporter has already written, so a second export of a run appends only the new.

``streamrft export-metrics`` reads a run's metrics from the beginning every time, and a
resumed run's monitor reads its topic again. Each exporter recovers, from its own
backend's files when it opens, the last step written of every metric, and writes a value
only when its step is past that mark. A metric's steps only grow within a component (a
resumed trainer that redoes a step reports it again; the first report is kept).
"""

from __future__ import annotations

from collections.abc import Iterable

from streamrft.infra.app.exporters.names import Point


class Watermarks:
    """The last step written of each metric, by :attr:`Point.name`."""

    def __init__(self, marks: dict[str, int] | None = None) -> None:
        self.marks: dict[str, int] = dict(marks or {})
        self.skipped = 0
        """Values left out because their step was already written."""

    def seen(self, name: str, step: int) -> None:
        """Note that ``name`` holds a value at ``step`` (read back from the backend)."""
        if step > self.marks.get(name, -(2**63)):
            self.marks[name] = step

    def fresh(self, points: Iterable[Point]) -> list[Point]:
        """The points past their metric's mark, marked as written from now."""
        out = []
        for p in points:
            if p.step <= self.marks.get(p.name, -(2**63)):
                self.skipped += 1
                continue
            self.marks[p.name] = p.step
            out.append(p)
        return out
