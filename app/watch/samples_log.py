"""``<run dir>/samples.jsonl``: the newest decoded samples of each explorer, kept after the
run.

The samples topic ends with the run's embedded broker; this file does not. The supervisor's
monitor keeps the newest :data:`KEEP_PER_EXPLORER` samples of each of at most
:data:`MAX_EXPLORERS` explorers (a few KB each: the file stays small however long the
run) and writes them whole, oldest first, one ``Sample`` as JSON a line, replacing the
file (never a half-written one) at most every :data:`WRITE_EVERY_S` and when the run ends.
A resumed run starts from the file's samples. The dashboard shows a finished run's
samples from it (:func:`read_samples`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path

import msgspec

from streamrft.schemas.codec import SAMPLE
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.samples import Sample, validate_sample

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
KEEP_PER_EXPLORER = 20
"""Samples kept of each explorer, the newest (the dashboard shows 10)."""
MAX_EXPLORERS = 64
"""Explorers whose samples are kept (more: the first ones)."""
WRITE_EVERY_S = 2.0
"""The file is written again at most this often while samples arrive."""
MAX_LINE_BYTES = SAMPLE.max_bytes + 1024
"""A line longer than this is no sample (skipped as the file is read)."""

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Sample)


def samples_path(run_dir: Path) -> Path:
    return Path(run_dir) / SAMPLES_FILE


def read_samples(path: Path) -> list[Sample]:
    """The samples of a samples file, in order; a line that is no valid sample is skipped
    with a warning. An absent file has none."""
    samples = []
    try:
        with Path(path).open("rb") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    if len(line) > MAX_LINE_BYTES:
                        raise SchemaError(f"{len(line)} bytes")
                    samples.append(validate_sample(_DECODER.decode(line)))
                except (msgspec.DecodeError, msgspec.ValidationError, SchemaError) as exc:
                    log.warning("%s line %d: not a sample (%s); skipped", path, n, exc)
    except FileNotFoundError:
        return []
    return samples


class SamplesLog:
    """The newest samples of each explorer, written to ``path`` (the monitor's sink for
    the ``samples`` topic: ``write``, ``flush``, ``close``)."""

    def __init__(
        self,
        path: Path,
        keep: int = KEEP_PER_EXPLORER,
        every_s: float = WRITE_EVERY_S,
        clock=time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.keep = keep
        self.every_s = every_s
        self._clock = clock
        self._by_explorer: dict[str, deque[Sample]] = {}
        self._ids: set[str] = set()
        self._changed = False
        self._written_at = -float("inf")
        for sample in read_samples(self.path):  # a resumed run keeps the earlier ones
            self.write(sample)
        self._changed = False

    def write(self, sample: Sample) -> None:
        """Keep ``sample`` (one already kept, by experience id, is not kept twice)."""
        if sample.experience_id in self._ids:
            return
        kept = self._by_explorer.get(sample.explorer)
        if kept is None:
            if len(self._by_explorer) >= MAX_EXPLORERS:
                return
            kept = self._by_explorer[sample.explorer] = deque()
        if len(kept) >= self.keep:
            self._ids.discard(kept.popleft().experience_id)
        kept.append(sample)
        self._ids.add(sample.experience_id)
        self._changed = True

    @property
    def samples(self) -> list[Sample]:
        """What is kept, oldest first."""
        every = [s for kept in self._by_explorer.values() for s in kept]
        return sorted(every, key=lambda s: s.created_at)

    def flush(self) -> None:
        """Write the file if samples came since it was last written at least
        :data:`WRITE_EVERY_S` ago."""
        if self._changed and self._clock() - self._written_at >= self.every_s:
            self._write()

    def close(self) -> None:
        if self._changed:
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with staged.open("wb") as fh:
            for sample in self.samples:
                fh.write(_ENCODER.encode(sample) + b"\n")
        os.replace(staged, self.path)
        self._changed = False
        self._written_at = self._clock()
