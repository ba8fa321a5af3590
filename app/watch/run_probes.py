"""The probes ``streamrft run``'s supervisor serves for the whole run (``monitor.http_port``;
its children then serve none): every component's families as each would serve them
(:mod:`streamrft.infra.metric_families`, read from the run's topics by the run monitor),
and what only the supervisor knows or sees whole:

- ``streamrft_version_lag{component}``: the trainer's version minus the component's, for
  each explorer, evaluator and serve process holding one and alive (beating, not stopped);
- ``streamrft_restarts{component}``: times the supervisor restarted the component;
- ``streamrft_dead_letters``: records on the run's dead-letter topic, and
  ``streamrft_undecodable_events``: events the monitor could not decode.

Alive while the monitor follows the topics; ready once the trainer has reported in this
attempt (the children started), until it stops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

from streamrft.app.watch.monitor import RunMonitor
from streamrft.app.watch.runs import ACTIVE_S
from streamrft.infra.metric_families import families, gauge
from streamrft.schemas.events import RunState

SAMPLING_ROLES = ("explorer", "evaluator", "serve")


class RunProbes:
    """:class:`~streamrft.infra.probes.Answers` for a run, from its supervisor's monitor."""

    def __init__(
        self,
        monitor: RunMonitor,
        following: asyncio.Task[None],
        restarts: Mapping[str, int],
        started_at: Callable[[], float],
    ) -> None:
        self.monitor = monitor
        self.following = following
        self.restarts = restarts
        self.started_at = started_at

    def health(self) -> tuple[bool, str]:
        if self.following.done():
            return False, "the run monitor stopped following the run's topics"
        return True, "following the run"

    def readiness(self) -> tuple[bool, str]:
        started, trainer = self.started_at(), self.monitor.status.get("trainer")
        if not started:
            return False, "the run's processes are not started yet"
        if trainer is None or trainer.created_at < started:
            return False, "the trainer has not reported in this attempt yet"
        if trainer.state == RunState.STOPPED:
            return False, f"the trainer stopped at step {trainer.step}"
        return True, f"trainer at step {trainer.step}, version {trainer.version}"

    def collect(self) -> Iterator[Metric]:
        run = self.monitor.cfg.run.id or ""
        reports = self.monitor.reports
        yield from families(run, reports)
        lag = gauge("streamrft_version_lag", "The trainer's version minus the component's")
        trainer, now = self.monitor.status.get("trainer"), time.time()
        for component, report in sorted(reports.items()):
            st = report.status
            if trainer is None or st is None or st.role not in SAMPLING_ROLES or st.version < 0:
                continue
            if st.state == RunState.STOPPED or now - st.created_at > ACTIVE_S:
                continue  # gone: its lag would only grow
            lag.add_metric([run, component, st.role], trainer.version - st.version)
        yield lag
        restarts = gauge("streamrft_restarts", "Times the supervisor restarted the component")
        for component, n in sorted(self.restarts.items()):
            restarts.add_metric([run, component, reports.get(component, _NONE).role], n)
        yield restarts
        for name, value, doc in (
            ("streamrft_dead_letters", self.monitor.dead_letters, "Records dead-lettered"),
            (
                "streamrft_undecodable_events",
                self.monitor.undecodable,
                "Events of the run's topics that did not decode",
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["run"])
            family.add_metric([run], value)
            yield family


class _NoReport:
    role = ""


_NONE = _NoReport()
