"""Metric exporters: every ``MetricsEvent`` of a run, also in TensorBoard, W&B or MLflow.

An exporter takes the run's metrics events in the order they were consumed (``write``),
makes what it holds durable (``flush``, after each poll of the topic) and finishes
(``close``). ``streamrft run`` feeds the ones named in ``monitor.exporters`` as its
monitor consumes the metrics topic; ``streamrft export-metrics`` (``export_metrics``) feeds
them from the topic of any run, running or finished, or from its ``metrics.jsonl``.
What every metric is called in each backend is decided in :mod:`.names`; each exporter
writes a metric's value of a given time once (:mod:`.marks`), so exporting a run again
appends only what is new.

A package that is installed but fails to import (a protobuf version conflict...) is told
apart from one that is missing only at open: an optional exporter (TensorBoard, when not
asked for by name) is then skipped with a warning, any other is a :class:`ConfigError`
naming the package and the import error.

Adding an exporter is a file with a class taking the ``Config`` and a line in
:data:`EXPORTERS`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from streamrft.infra.config import Config
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.events import MetricsEvent

log = logging.getLogger(__name__)


class Exporter(Protocol):
    """Where a run's metrics go besides its topic."""

    name: str
    """The registry name (``tensorboard``...)."""
    where: str
    """Where its files are (a folder, a tracking URI), for messages."""

    def write(self, ev: MetricsEvent) -> None:
        """Take one event (values of steps already written are left out)."""

    def flush(self) -> None:
        """Make what was written so far durable / visible."""

    def close(self) -> None:
        """Flush and release everything; safe to call twice."""


@dataclass(frozen=True)
class Backend:
    """A registered exporter: the package it needs, and how to open it."""

    package: str
    """Import name of the package it needs."""
    pip: str
    """What ``pip install`` takes to get that package."""
    target: str
    """``module:Class`` under this package; the class takes the ``Config``."""
    optional: bool = False
    """Skipped (one log line) when its package is missing, unless asked for by name."""

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def open(self, cfg: Config) -> Exporter:
        """The exporter for run ``cfg``; :class:`BrokenPackage` when its module (or the
        package under it) fails to import."""
        module, _, cls = self.target.partition(":")
        try:
            code = importlib.import_module(f"{__name__}.{module}")
        except Exception as exc:  # any error: importing runs the package's own code
            raise BrokenPackage(self.package, exc) from exc
        factory: Callable[[Config], Exporter] = getattr(code, cls)
        return factory(cfg)


class BrokenPackage(Exception):
    """An exporter's package is installed but does not import."""

    def __init__(self, package: str, error: BaseException) -> None:
        super().__init__(f"{package}: {type(error).__name__}: {error}")
        self.package = package
        self.error = error


EXPORTERS: dict[str, Backend] = {
    "tensorboard": Backend("tensorboard", "tensorboard", "tensorboard:TensorBoardExporter", True),
    "wandb": Backend("wandb", "wandb", "wandb:WandbExporter"),
    "mlflow": Backend("mlflow", "mlflow-skinny", "mlflow:MlflowExporter"),
}
"""Exporters by the name ``monitor.exporters`` and ``export-metrics --to`` use."""


def backends(names: Sequence[str], *, strict: bool) -> list[tuple[str, Backend]]:
    """The backends of ``names`` (each once) that can run. :class:`ConfigError` for an
    unknown name or a missing package; an optional one (TensorBoard) whose package is
    missing is left out with a log line unless ``strict``."""
    out = []
    for name in dict.fromkeys(names):
        backend = EXPORTERS.get(name)
        if backend is None:
            raise ConfigError(
                f"monitor.exporters: unknown exporter {name!r}; known: {', '.join(EXPORTERS)}"
            )
        if backend.installed():
            out.append((name, backend))
        elif backend.optional and not strict:
            log.info("metric exporter %s skipped: `pip install %s` to enable it", name, backend.pip)
        else:
            raise ConfigError(
                f"monitor.exporters: {name} needs the {backend.package!r} package: "
                f"`pip install {backend.pip}` (or leave {name} out of monitor.exporters)"
            )
    return out


def open_backend(cfg: Config, name: str, backend: Backend, *, strict: bool) -> Exporter | None:
    """``backend.open(cfg)``; when its package fails to import, None (with a warning) for
    an optional one unless ``strict``, else a :class:`ConfigError` saying why."""
    try:
        return backend.open(cfg)
    except BrokenPackage as exc:
        if backend.optional and not strict:
            log.warning(
                "monitor.exporters: %s skipped: the %r package is installed but does not "
                "import (%s: %s)",
                name,
                backend.package,
                type(exc.error).__name__,
                exc.error,
            )
            return None
        raise ConfigError(
            f"monitor.exporters: {name}: the {backend.package!r} package is installed but "
            f"does not import ({type(exc.error).__name__}: {exc.error}); repair it "
            f"(`pip install --force-reinstall {backend.pip}`) or leave {name} out of "
            "monitor.exporters"
        ) from exc.error


def open_exporters(cfg: Config, names: Sequence[str], *, strict: bool) -> list[Exporter]:
    """Open the exporters ``names`` for run ``cfg`` (see :func:`backends` and
    :func:`open_backend` for the rules). If one fails to open, those already open are
    closed and the error goes on."""
    opened: list[Exporter] = []
    try:
        for name, backend in backends(names, strict=strict):
            exporter = open_backend(cfg, name, backend, strict=strict)
            if exporter is not None:
                opened.append(exporter)
    except BaseException:
        close_all(opened)
        raise
    return opened


def close_all(exporters: Sequence[Exporter]) -> None:
    """Close every exporter, each even when another fails (the first error goes on)."""
    with contextlib.ExitStack() as stack:
        for exp in exporters:
            stack.callback(exp.close)
