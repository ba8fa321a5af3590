"""A process's probes on ``monitor.http_port``: ``GET /healthz``, ``/readyz`` and
``/metrics`` (Prometheus text format), for a kubelet, a load balancer or Prometheus.

:class:`ProcessProbes` answers for one component from the events its sender delivered:
alive while its newest status reached the broker within ``monitor.health_timeout_s``
(heartbeats go every few seconds while the event loop runs; a loop that is blocked does not
answer at all), ready once a status got through and the component says it can work
(``Position.ready``). :class:`ProbeServer` serves any :class:`Answers` (the supervisor
serves the whole run's) behind the :class:`~streamrft.infra.web_guard.WebGuard` every
HTTP server of streamrft sits behind; it only reads, and answers GET and HEAD only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from streamrft.infra.config import MonitorConfig
from streamrft.infra.metric_families import ComponentReport, families, gauge
from streamrft.infra.web_guard import WebGuard
from streamrft.infra.web_server import listening_socket, quiet_server
from streamrft.schemas.events import MetricsEvent, StatusEvent

log = logging.getLogger(__name__)


class Answers(Protocol):
    """What a probe server asks: each check as (ok, why), and the metric families."""

    def health(self) -> tuple[bool, str]: ...

    def readiness(self) -> tuple[bool, str]: ...

    def collect(self) -> Iterator[Metric]: ...


class ProcessProbes:
    """The probes' answers for one component, fed with each event its sender delivered."""

    def __init__(
        self,
        run: str,
        component: str,
        role: str,
        health_timeout_s: float,
        ready: Callable[[], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run, self.component, self.role = run, component, role
        self.health_timeout_s = health_timeout_s
        self._ready = ready
        self._clock = clock
        self.started_at = clock()
        self.delivered_at: float | None = None
        """When the newest status reached the broker."""
        self.report = ComponentReport()

    def sent_status(self, event: StatusEvent) -> None:
        self.delivered_at = self._clock()
        self.report.on_status(event)

    def sent_metrics(self, event: MetricsEvent) -> None:
        self.report.on_metrics(event)

    def health(self) -> tuple[bool, str]:
        now = self._clock()
        since = now - (self.delivered_at or self.started_at)
        if since <= self.health_timeout_s:
            what = "last status delivered" if self.delivered_at else "started"
            return True, f"{what} {since:.0f}s ago"
        if self.delivered_at is None:
            return False, f"no status reached the broker in {since:.0f}s since start"
        return False, (
            f"no status reached the broker for {since:.0f}s "
            f"(monitor.health_timeout_s {self.health_timeout_s:g})"
        )

    def readiness(self) -> tuple[bool, str]:
        if self.delivered_at is None:
            return False, "not connected yet (no status reached the broker)"
        if not self._ready():
            st = self.report.status
            return False, f"not ready: {st.detail or st.state.value}" if st else "not ready"
        return True, "ready"

    def collect(self) -> Iterator[Metric]:
        yield from families(self.run, {self.component: self.report})
        labels = [self.run, self.component, self.role]
        for name, check, doc in (
            ("streamrft_healthy", self.health, "1 while /healthz answers 200"),
            ("streamrft_ready", self.readiness, "1 while /readyz answers 200"),
        ):
            family = gauge(name, doc)
            family.add_metric(labels, float(check()[0]))
            yield family


class _Registry:
    """A prometheus_client collector over ``answers`` (a fresh registry per server: nothing
    global, the process's own Python metrics left out)."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers

    def collect(self) -> Iterator[Metric]:
        return self.answers.collect()


def probe_app(answers: Answers) -> Callable[..., Any]:
    """The ASGI app of the three paths."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Registry(answers))

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        checks = {"/healthz": answers.health, "/readyz": answers.readiness}
        if path not in (*checks, "/metrics"):
            status, kind, body = 404, "application/json", b'{"error": "not found"}'
        elif method not in ("GET", "HEAD"):
            status, kind, body = 405, "application/json", b'{"error": "GET or HEAD only"}'
        elif path == "/metrics":
            status, kind, body = 200, CONTENT_TYPE_LATEST, generate_latest(registry)
        else:
            ok, why = checks[path]()
            status, kind = (200 if ok else 503), "application/json"
            body = json.dumps({"ok": ok, "reason": why}).encode()
        headers = [(b"content-type", kind.encode()), (b"content-length", b"%d" % len(body))]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    return app


class ProbeServer:
    """Serves ``answers`` on ``monitor.http_host:http_port`` inside the running event loop;
    ``start``/``stop``, stop safe twice. A port that is taken is a clear error at start."""

    def __init__(self, monitor: MonitorConfig, answers: Answers, name: str) -> None:
        self.monitor, self.answers, self.name = monitor, answers, name
        self.port = 0
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        m = self.monitor
        sock = listening_socket(
            m.http_host, m.http_port, f"{self.name}: set another monitor.http_port"
        )
        self.port = sock.getsockname()[1]
        app = WebGuard(probe_app(self.answers), m.http_host, m.http_allowed_hosts)
        self._server = quiet_server(app, 1.0)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="probes")
        log.info(
            "%s: probes on http://%s:%d (/healthz /readyz /metrics)",
            self.name,
            m.http_host,
            self.port,
        )

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):  # then it is cancelled
            await asyncio.wait_for(self._task, 5)
        self._task = None
