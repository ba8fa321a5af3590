"""``<run dir>/metrics.jsonl``: every metrics event of a run, as consumed from its topic.

The embedded broker's topics end with the run; this file does not. One JSON object per
line, the ``MetricsEvent`` as it travelled (``run``, ``component``, ``step``, ``version``,
``values``, ``created_at``, ``trained``); a NaN or infinite value is written as ``null``
and read back as NaN. The supervisor writes it while the run goes; the dashboard, the
exporters (``streamrft export-metrics``) and the curves read it when the broker is gone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from streamrft.schemas.events import MetricsEvent

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def _key(ev: MetricsEvent) -> tuple[str, int, int, float]:
    return ev.component, ev.step, ev.version, ev.created_at


def encode_line(ev: MetricsEvent) -> bytes:
    """One event as a JSON line (NaN and infinities as null)."""
    return msgspec.json.encode(ev) + b"\n"


def decode_line(line: bytes | str) -> MetricsEvent:
    """One JSON line back to its event (null values become NaN); ``msgspec.ValidationError``
    or ``msgspec.DecodeError`` for a line that is not one."""
    data = msgspec.json.decode(line)
    if isinstance(data, dict) and isinstance(data.get("values"), dict):
        data["values"] = {k: math.nan if v is None else v for k, v in data["values"].items()}
    return msgspec.convert(data, MetricsEvent)


def iter_metrics(path: Path, ledgers: bool = True) -> Iterator[MetricsEvent]:
    """Every event of a metrics file, in order, one line at a time (a long run's file is
    never held whole). A line that does not parse (a run killed mid-write leaves a partial
    last line) is skipped with a warning naming it. ``ledgers=False``: each event's
    ``trained`` rows (one per group the step trained, most of the file) are left out."""
    with Path(path).open("rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ev = decode_line(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("%s line %d: not a metrics event (%s); skipped", path, n, exc)
                continue
            yield ev if ledgers or not ev.trained else msgspec.structs.replace(ev, trained=[])


def read_metrics(path: Path, ledgers: bool = True) -> list[MetricsEvent]:
    """:func:`iter_metrics` as a list."""
    return list(iter_metrics(path, ledgers))


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


class MetricsLog:
    """Appends events to a metrics file, each once: a resumed run's monitor reads the topic
    from the beginning again, and the events already in the file are not written twice."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        exists = self.path.exists()
        self._seen = (
            {_key(ev) for ev in iter_metrics(self.path, ledgers=False)} if exists else set()
        )
        self._fh = self.path.open("ab")
        if self._fh.tell() and not _ends_with_newline(self.path):
            self._fh.write(b"\n")  # a run killed mid-line: the next event starts afresh
        self.written = 0

    def append(self, ev: MetricsEvent) -> bool:
        """Write ``ev`` unless the file has it; True when written."""
        key = _key(ev)
        if key in self._seen:
            return False
        self._seen.add(key)
        self._fh.write(encode_line(ev))
        self.written += 1
        return True

    def write(self, ev: MetricsEvent) -> None:
        """The monitor's sink method (``monitor.MetricsSink``)."""
        self.append(ev)

    def extend(self, events: Iterable[MetricsEvent]) -> None:
        for ev in events:
            self.append(ev)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
