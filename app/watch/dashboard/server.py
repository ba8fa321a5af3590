"""``streamrft dashboard``: a page that watches runs live, served on 127.0.0.1.

Routes: ``/`` the page (``static/index.html``), ``/static/*`` its assets (vendored: no CDN,
nothing fetched at run time), ``/api/runs`` the runs to choose from (those with topics on
the broker, and run folders with a ``metrics.jsonl``), ``/api/runs/{run}/snapshot`` a run's
state now, ``/api/runs/{run}/events`` the same as Server-Sent Events: a snapshot at once,
then a new one as events arrive (at most one per :data:`MIN_INTERVAL_S`), and again every
:data:`KEEPALIVE_S` without events (the rate "now" ages; proxies keep the stream open). One
:class:`~.feed.Feed` per watched run, started when the run is first asked for, and
stopped once no stream has listened to it for :data:`IDLE_STOP_S`.

Uvicorn runs without capturing signals: SIGINT/SIGTERM set the stop flag
(``install_stop_handlers``), open streams end, the server exits, the feeds stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from streamrft.app.watch import run_events
from streamrft.app.watch.dashboard.feed import LIST_S, Feed, topic_names
from streamrft.app.watch.metrics_log import METRICS_FILE
from streamrft.infra.config import Config, with_run_id
from streamrft.infra.net import is_loopback
from streamrft.infra.signals import install_stop_handlers
from streamrft.infra.web_guard import WebGuard
from streamrft.infra.web_server import listening_socket, quiet_server
from streamrft.schemas.errors import StreamRFTError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,255}")
"""What a run id may be (it is part of topic names); ``fullmatch`` it."""
MIN_INTERVAL_S = 0.3
"""At most one update of a stream this often: a burst of events becomes one update."""
KEEPALIVE_S = 10.0
"""A stream with nothing new sends the snapshot again this often."""
FIRST_WAIT_S = 5.0
"""``/snapshot`` of a feed just started waits this long for its first events."""
RUNS_TTL_S = 3.0
"""The list of runs is looked up again after this long."""
RELOOK_S = 1.0
"""A run id not in the list makes a fresh lookup only when the list is older than this."""
IDLE_STOP_S = 300.0
"""A feed no stream has listened to for this long is stopped (opened again on demand)."""
REAP_S = 30.0
"""How often feeds are checked for that."""


class Dashboard:
    """The runs a dashboard can show, and the feeds of those shown."""

    def __init__(
        self, cfg: Config, bootstrap: str | None = None, infra_dir: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.infra_dir = infra_dir
        self.default_run = cfg.run.id
        self.feeds: dict[str, Feed] = {}
        self.closing = asyncio.Event()
        self._runs: tuple[float, dict[str, Any]] = (0.0, {})
        self._opening = asyncio.Lock()
        """Held while a feed is created: one feed per run."""
        self._listing = asyncio.Lock()
        """Held while the list of runs is looked up: concurrent callers share one lookup."""

    async def runs(self) -> dict[str, Any]:
        """``{"runs": [{run, on_broker, metrics_file, folder, last}], "default": id,
        "broker": where}``; ``last``: the Unix time of the run's newest event known here
        (its open feed, else its run folder's newest write), 0 when unknown."""
        at, cached = self._runs
        if cached and time.monotonic() - at < RUNS_TTL_S:
            return cached
        async with self._listing:
            at, cached = self._runs  # another caller may have looked it up meanwhile
            if cached and time.monotonic() - at < RUNS_TTL_S:
                return cached
            return await self._look_up_runs()

    async def _look_up_runs(self) -> dict[str, Any]:
        broker = await asyncio.to_thread(
            run_events.find_broker, self.cfg, self.bootstrap, self.infra_dir
        )
        names = await topic_names(broker) if broker is not None else None
        on_broker = run_events.runs_on_broker(names or [], self.cfg.kafka.topic_prefix)
        root = Path(self.cfg.run.dir)
        in_files = [p.parent.name for p in root.glob(f"*/{METRICS_FILE}")]
        ids = {r for r in [*on_broker, *in_files, *self.feeds] if RUN_ID.fullmatch(r)}
        if self.default_run:
            ids.add(self.default_run)
        last = await asyncio.to_thread(_last_writes, root, sorted(ids))
        for run, feed in self.feeds.items():
            last[run] = max(last.get(run, 0.0), feed.view.updated_at)
        rows = [
            {
                "run": r,
                "on_broker": r in on_broker,
                "metrics_file": r in in_files,
                "folder": (root / r).is_dir(),
                "last": last.get(r, 0.0),
            }
            for r in sorted(ids)
        ]
        where = f"{broker.kafka.bootstrap_servers} ({broker.source})" if broker else None
        result = {"runs": rows, "default": self.default_run, "broker": where}
        self._runs = (time.monotonic(), result)
        return result

    async def feed(self, run: str) -> Feed:
        """The feed of ``run`` (started now if new); ``LookupError``: no such run."""
        if run in self.feeds:
            return self.feeds[run]
        if not await self._known(run):
            raise LookupError(run)
        async with self._opening:
            if run not in self.feeds:
                feed = Feed(with_run_id(self.cfg, run), self.bootstrap, self.infra_dir)
                self.feeds[run] = feed
                feed.start()
            return self.feeds[run]

    async def _known(self, run: str) -> bool:
        """Whether ``run`` is a run this dashboard can show. A run not in the list may have
        just started: the list is looked up afresh, but at most once per
        :data:`RELOOK_S` whatever the ids asked for (a loop over random ids costs one
        broker listing per :data:`RELOOK_S`, and holds up no feed being opened)."""
        if any(row["run"] == run for row in (await self.runs())["runs"]):
            return True
        if time.monotonic() - self._runs[0] < RELOOK_S:
            return False
        self._runs = (0.0, {})
        return any(row["run"] == run for row in (await self.runs())["runs"])

    async def stream(self, feed: Feed) -> AsyncIterator[bytes]:
        """Server-Sent Events of ``feed``: see the module docstring."""
        feed.listen(+1)
        try:
            sent = feed.seq
            yield b"data: " + feed.payload() + b"\n\n"
            while not self.closing.is_set():
                if feed.seq == sent:
                    if not await self._next_change(feed):
                        yield b"data: " + feed.payload() + b"\n\n"
                    continue
                await asyncio.sleep(MIN_INTERVAL_S)  # let a burst of events land first
                sent = feed.seq
                yield b"data: " + feed.payload() + b"\n\n"
        finally:
            feed.listen(-1)

    async def _next_change(self, feed: Feed) -> bool:
        """Wait for ``feed``'s next change or the dashboard's end, at most
        :data:`KEEPALIVE_S`; False: neither came."""
        changed = asyncio.create_task(feed.changed().wait())
        closing = asyncio.create_task(self.closing.wait())
        try:
            done, _ = await asyncio.wait(
                {changed, closing}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED
            )
            return bool(done)
        finally:  # a closed stream cancels its generator here: leave no task behind
            changed.cancel()
            closing.cancel()

    async def stop_idle(self, idle_s: float = IDLE_STOP_S) -> list[str]:
        """Stop the feeds no stream has listened to for ``idle_s``; their runs."""
        now = time.monotonic()
        idle = [
            run
            for run, feed in self.feeds.items()
            if feed.listeners == 0 and now - feed.idle_since >= idle_s
        ]
        for run in idle:
            feed = self.feeds.pop(run)
            await feed.stop()
            log.info("dashboard: stopped following run %s (nobody watching)", run)
        return idle

    async def reap(self) -> None:
        """:meth:`stop_idle` every :data:`REAP_S` until the dashboard closes."""
        while not self.closing.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.closing.wait(), REAP_S)
            await self.stop_idle()

    async def close(self) -> None:
        self.closing.set()
        for feed in list(self.feeds.values()):
            await feed.stop()


def _last_writes(root: Path, runs: list[str]) -> dict[str, float]:
    """Run -> the newest modification time of its folder or the files in it."""
    out = {}
    for run in runs:
        folder = root / run
        with contextlib.suppress(OSError):
            out[run] = max([folder.stat().st_mtime, *(p.stat().st_mtime for p in folder.iterdir())])
    return out


def _error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


def build_app(dash: Dashboard, bound: str = "127.0.0.1") -> Any:
    """The FastAPI app of ``dash`` (see the module docstring), behind the web guard: only
    the names of ``bound`` (the address it listens on) as ``Host``, no cross-site
    ``Origin`` (a page elsewhere, or DNS rebinding, cannot read a run's view)."""
    from fastapi import FastAPI
    from fastapi.responses import FileResponse, Response, StreamingResponse
    from fastapi.staticfiles import StaticFiles

    app = FastAPI(title="streamrft dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    async def index() -> Any:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/runs")
    async def runs() -> Any:
        return await dash.runs()

    async def feed_of(run: str) -> Feed | Any:
        if not RUN_ID.fullmatch(run):
            return _error(400, f"bad run id {run[:80]!r}: letters, digits, '_' and '-' only")
        try:
            return await dash.feed(run)
        except LookupError:
            return _error(404, f"unknown run {run!r}: not on the broker, no {METRICS_FILE}")

    @app.get("/api/runs/{run}/snapshot")
    async def snapshot(run: str) -> Any:
        feed = await feed_of(run)
        if not isinstance(feed, Feed):
            return feed
        if feed.seq == 0:  # a feed just started: give it a moment to find its source
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(feed.changed().wait(), FIRST_WAIT_S)
        return Response(feed.payload(), media_type="application/json")

    @app.get("/api/runs/{run}/events")
    async def events(run: str) -> Any:
        feed = await feed_of(run)
        if not isinstance(feed, Feed):
            return feed
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(dash.stream(feed), media_type="text/event-stream", headers=headers)

    return WebGuard(app, bound)


def url_of(host: str, port: int, run: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?run={run}" if run else "")


async def serve(dash: Dashboard, host: str, port: int, url_file: Path | None = None) -> None:
    """Serve ``dash`` on ``host:port`` until SIGINT/SIGTERM; print the URL (and write it to
    ``url_file``, removed again at the end) once it is listening."""
    sock = listening_socket(
        host, port, "dashboard: pass --port or set monitor.dashboard_port (0: a free port)"
    )
    url = url_of(host, sock.getsockname()[1], dash.default_run)
    stop = asyncio.Event()
    install_stop_handlers(stop, "dashboard")
    # longer than any request takes (a topic listing is cut at LIST_S)
    http = quiet_server(build_app(dash, host), LIST_S + 5)
    serving = asyncio.create_task(http.serve(sockets=[sock]))
    print(f"dashboard: {url}", flush=True)
    if url_file is not None:
        tmp = url_file.with_name(url_file.name + f".{os.getpid()}.tmp")
        tmp.write_text(url + "\n")
        tmp.replace(url_file)
    stopped = asyncio.create_task(stop.wait())
    reaper = asyncio.create_task(dash.reap(), name="dashboard feeds reaper")
    try:
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        reaper.cancel()
        dash.closing.set()
        http.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await dash.close()
        if url_file is not None:
            url_file.unlink(missing_ok=True)
        sock.close()


def main(
    cfg: Config,
    host: str,
    port: int,
    bootstrap: str | None = None,
    infra_dir: Path | None = None,
    url_file: Path | None = None,
    allow_remote: bool = False,
) -> None:
    """``streamrft dashboard``: serve the page until stopped. A ``host`` other machines can
    reach is refused unless ``allow_remote``: the page has no authentication."""
    if not is_loopback(host):
        if not allow_remote:
            raise StreamRFTError(
                f"dashboard: --host {host} is reachable from other machines and the dashboard "
                "has no authentication (it shows run ids, statuses, counters and dead-letter "
                "reasons); bind 127.0.0.1 and reach it through an SSH tunnel, or pass "
                "--allow-remote to serve it behind a proxy that authenticates"
            )
        print(
            f"streamrft: warning: the dashboard on {host} is reachable from other machines "
            "and has no authentication of its own (--allow-remote)",
            file=sys.stderr,
            flush=True,
        )

    async def run() -> None:
        await serve(Dashboard(cfg, bootstrap, infra_dir), host, port, url_file)

    asyncio.run(run())
