"""A run's status and metrics events as Prometheus metric families: the one mapping behind
a process's own ``/metrics`` (the events it sent) and the supervisor's (every component's,
as read from the run's topics), so both say the same of a component.

Every family is labelled ``run``, ``component`` and ``role``:

- ``streamrft_step``, ``streamrft_version``, ``streamrft_heartbeat_timestamp_seconds``,
  ``streamrft_working``, ``streamrft_starved``: the component's newest status event;
  ``streamrft_state{state}`` is 1 for the state it reports and 0 for the others;
- ``streamrft_status_counter{name}``: each running total its status carries
  (``experiences_published``, ``sync_seconds``, ``dead_letters``...): they only grow
  within one process's life (``rate()`` applies), a few are levels (``spool_bytes``,
  ``tasks_partitions``);
- ``streamrft_metric{name}``: the newest value of each name of its metrics events
  (``train/loss``, ``train/staleness_mean``, ``eval/accuracy``...), exactly as on the
  metrics topic; ``streamrft_metric_step``: the step of its newest metrics event.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric

from streamrft.schemas.events import MetricsEvent, RunState, StatusEvent

LABELS = ["run", "component", "role"]
STATES = [s.value for s in RunState]


@dataclass
class ComponentReport:
    """What is known of one component: its newest status and each metric's newest value."""

    status: StatusEvent | None = None
    values: dict[str, float] = field(default_factory=dict)
    metric_step: int = -1

    def on_status(self, ev: StatusEvent) -> None:
        if self.status is None or ev.created_at >= self.status.created_at:
            self.status = ev

    def on_metrics(self, ev: MetricsEvent) -> None:
        self.values.update(ev.values)
        self.metric_step = ev.step

    @property
    def role(self) -> str:
        return self.status.role if self.status is not None else ""


def gauge(name: str, doc: str, extra: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=[*LABELS, *extra])


def families(run: str, reports: Mapping[str, ComponentReport]) -> Iterator[Metric]:
    """The families of every component in ``reports`` (by component id), in a fixed order."""
    step = gauge("streamrft_step", "Steps done (the component's status)")
    version = gauge("streamrft_version", "Model version the component holds (-1: none yet)")
    beat = gauge(
        "streamrft_heartbeat_timestamp_seconds", "Unix time of the component's newest status"
    )
    state = gauge("streamrft_state", "1 for the sync-protocol state reported", ["state"])
    working = gauge("streamrft_working", "1 while it holds work not yet published")
    starved = gauge("streamrft_starved", "Trainer: 1 while it waits for experiences")
    counter = gauge(
        "streamrft_status_counter", "A running total of the component's status", ["name"]
    )
    metric = gauge("streamrft_metric", "Newest value of a metric of the metrics topic", ["name"])
    metric_step = gauge("streamrft_metric_step", "Step of the component's newest metrics event")
    for component, report in sorted(reports.items()):
        labels = [run, component, report.role]
        st = report.status
        if st is not None:
            step.add_metric(labels, st.step)
            version.add_metric(labels, st.version)
            beat.add_metric(labels, st.created_at)
            for name in STATES:
                state.add_metric([*labels, name], 1.0 if st.state.value == name else 0.0)
            working.add_metric(labels, float(st.working))
            starved.add_metric(labels, float(st.starved))
            for name, value in sorted(st.counters.items()):
                counter.add_metric([*labels, name], value)
        if report.metric_step >= 0:
            metric_step.add_metric(labels, report.metric_step)
            for name, value in sorted(report.values.items()):
                metric.add_metric([*labels, name], value)
    yield from (step, version, beat, state, working, starved, counter, metric, metric_step)
