"""A process's probes (``monitor.http_port``): what /healthz and /readyz answer and when,
/metrics equal to the events sent (parsed back by prometheus_client's parser), the server's
refusals, the run's probes, ``streamrft runs``' states and the JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import time

import msgspec
import pytest

from streamrft.app.process import setup_logging
from streamrft.app.watch.monitor import RunMonitor
from streamrft.app.watch.run_probes import RunProbes
from streamrft.app.watch.runs import ACTIVE_S, run_state
from streamrft.infra.config import Config, MonitorConfig
from streamrft.infra.probes import ProbeServer, ProcessProbes
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.events import MetricsEvent, RunState, StatusEvent
from tests.helpers.probes import Samples, get, sample, scrape

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status(component="explorer-0", role="explorer", t=1000.0, **kw) -> StatusEvent:
    fields = {"state": RunState.RUNNING, "step": 3, "version": 2, "created_at": t}
    return StatusEvent(component=component, role=role, **{**fields, **kw})


def metrics(component="explorer-0", step=3, values=None) -> MetricsEvent:
    return MetricsEvent(
        run="r1", component=component, step=step, version=2, values=values or {}, created_at=1.0
    )


def test_alive_while_statuses_reach_the_broker_and_not_after():
    clock, ready = Clock(), [False]
    probes = ProcessProbes("r1", "explorer-0", "explorer", 60.0, lambda: ready[0], clock)
    assert probes.health() == (True, "started 0s ago")  # the grace of a starting process
    clock.now += 61
    ok, why = probes.health()
    assert not ok and "no status reached the broker in 61s since start" in why
    probes.sent_status(status(t=clock.now))
    assert probes.health()[0]
    clock.now += 59
    assert probes.health() == (True, "last status delivered 59s ago")
    clock.now += 2
    ok, why = probes.health()
    assert not ok and "for 61s (monitor.health_timeout_s 60)" in why


def test_ready_once_connected_and_the_component_says_it_can_work():
    clock, ready = Clock(), [False]
    probes = ProcessProbes("r1", "explorer-0", "explorer", 60.0, lambda: ready[0], clock)
    ok, why = probes.readiness()
    assert not ok and "not connected" in why
    probes.sent_status(status(detail="waiting for version 0"))
    assert probes.readiness() == (False, "not ready: waiting for version 0")
    ready[0] = True
    assert probes.readiness() == (True, "ready")


def _serve_and_scrape(probes, *paths, headers=None) -> list[tuple[int, bytes]]:
    async def go():
        server = ProbeServer(MonitorConfig(http_port=0), probes, "test")
        await server.start()
        try:
            base = f"http://127.0.0.1:{server.port}"
            return [await asyncio.to_thread(get, base + p, headers) for p in paths]
        finally:
            await server.stop()
            await server.stop()  # safe twice

    return asyncio.run(go())


def _parsed(probes) -> Samples:
    async def go():
        server = ProbeServer(MonitorConfig(http_port=0), probes, "test")
        await server.start()
        try:
            return await asyncio.to_thread(scrape, f"http://127.0.0.1:{server.port}")
        finally:
            await server.stop()

    return asyncio.run(go())


def test_metrics_say_exactly_what_the_events_said():
    probes = ProcessProbes("r1", "trainer", "trainer", 60.0, lambda: True)
    sent = status(
        "trainer",
        "trainer",
        state=RunState.REQUIRE_SYNC,
        step=7,
        version=6,
        starved=True,
        counters={"experiences_trained": 224.0, "sync_seconds": 0.1 + 0.2},
    )
    probes.sent_status(sent)
    probes.sent_metrics(metrics("trainer", 6, {"train/loss": 0.1 + 0.2, "eval/accuracy": 0.5}))
    probes.sent_metrics(metrics("trainer", 7, {"train/loss": 1e-300, "train/lr": -3.5e-4}))
    probes.sent_metrics(metrics("trainer", 7, {"train/kl": float("nan")}))
    got = _parsed(probes)
    me = {"run": "r1", "component": "trainer", "role": "trainer"}
    assert sample(got, "streamrft_step", **me) == [7]
    assert sample(got, "streamrft_version", **me) == [6]
    assert sample(got, "streamrft_heartbeat_timestamp_seconds", **me) == [1000.0]
    assert sample(got, "streamrft_starved", **me) == [1] and sample(got, "streamrft_working") == [0]
    assert sample(got, "streamrft_state", state="REQUIRE_SYNC") == [1]
    assert sorted(sample(got, "streamrft_state")) == [0, 0, 0, 1]
    assert sample(got, "streamrft_status_counter", name="experiences_trained") == [224]
    assert sample(got, "streamrft_status_counter", name="sync_seconds") == [0.1 + 0.2]
    # each name's newest value, to the last bit; the step of the newest event
    assert sample(got, "streamrft_metric", name="train/loss") == [1e-300]
    assert sample(got, "streamrft_metric", name="train/lr") == [-3.5e-4]
    assert sample(got, "streamrft_metric", name="eval/accuracy") == [0.5]
    assert math.isnan(sample(got, "streamrft_metric", name="train/kl")[0])
    assert sample(got, "streamrft_metric_step", **me) == [7]
    assert sample(got, "streamrft_healthy", **me) == [1] and sample(got, "streamrft_ready") == [1]


def test_the_server_answers_get_and_head_on_its_three_paths_only():
    probes = ProcessProbes("r1", "explorer-0", "explorer", 60.0, lambda: False)
    (h, hb), (r, rb), (m, _), (x, _) = _serve_and_scrape(
        probes, "/healthz", "/readyz", "/metrics", "/admin"
    )
    assert (h, json.loads(hb)["ok"]) == (200, True)
    assert (r, json.loads(rb)) == (503, {"ok": False, "reason": "not connected yet (no status "
                                         "reached the broker)"})  # fmt: skip
    assert m == 200 and x == 404
    # DNS rebinding: a page of another name resolving to 127.0.0.1 is refused
    [(code, body)] = _serve_and_scrape(probes, "/metrics", headers={"Host": "evil.example"})
    assert code == 421 and b"not a name of this server" in body

    async def post():
        server = ProbeServer(MonitorConfig(http_port=0), probes, "test")
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"DELETE /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            )
            head = await reader.read()
            writer.close()
            return head
        finally:
            await server.stop()

    answer = asyncio.run(post())
    assert answer.startswith(b"HTTP/1.1 405") and b"allow: get, head" in answer.lower()


def test_a_taken_port_is_a_clear_error():
    async def go():
        first = ProbeServer(MonitorConfig(http_port=0), ProcessProbes("r", "c", "r", 60, bool), "a")
        await first.start()
        try:
            taken = MonitorConfig(http_port=first.port)
            await ProbeServer(taken, ProcessProbes("r", "c", "r", 60, bool), "explorer-1").start()
        finally:
            await first.stop()

    with pytest.raises(StreamRFTError, match=r"explorer-1: set another monitor\.http_port"):
        asyncio.run(go())


def test_the_runs_probes_add_lag_restarts_and_dead_letters():
    cfg = msgspec.structs.replace(Config(), run=msgspec.structs.replace(Config().run, id="r1"))
    monitor = RunMonitor(cfg)
    now = time.time()
    monitor.on_status(status("trainer", "trainer", version=9, t=now))
    monitor.on_status(status("explorer-0", version=8, t=now))
    monitor.on_status(status("explorer-1", version=-1, t=now))
    monitor.on_status(status("explorer-2", version=3, t=now, state=RunState.STOPPED))
    monitor.on_status(status("explorer-3", version=4, t=now - ACTIVE_S - 1))  # gone
    monitor.on_status(status("feeder", "feeder", version=-1, t=now))
    monitor.on_metrics(metrics("explorer-0", 4, {"explorer/reward_mean": 0.75}))
    monitor.dead_letters = 3

    async def go():
        following = asyncio.create_task(asyncio.sleep(60))
        answers = RunProbes(monitor, following, {"explorer-0": 2}, lambda: now - 10)
        try:
            server = ProbeServer(MonitorConfig(http_port=0), answers, "supervisor")
            await server.start()
            base = f"http://127.0.0.1:{server.port}"
            got = await asyncio.to_thread(scrape, base)
            ready = await asyncio.to_thread(get, base + "/readyz")
            following.cancel()
            await asyncio.sleep(0)
            dead = await asyncio.to_thread(get, base + "/healthz")
            await server.stop()
            return got, ready, dead
        finally:
            following.cancel()

    got, ready, dead = asyncio.run(go())
    assert sample(got, "streamrft_version_lag", component="explorer-0") == [1]
    assert sample(got, "streamrft_version_lag", component="explorer-1") == []  # holds none
    assert sample(got, "streamrft_version_lag", component="feeder") == []
    assert sample(got, "streamrft_version_lag", component="explorer-2") == []  # stopped
    assert sample(got, "streamrft_version_lag", component="explorer-3") == []  # silent
    assert sample(got, "streamrft_restarts", component="explorer-0", role="explorer") == [2]
    assert sample(got, "streamrft_dead_letters", run="r1") == [3]
    assert sample(got, "streamrft_metric", component="explorer-0", name="explorer/reward_mean") == [
        0.75
    ]
    assert ready[0] == 200 and b"version 9" in ready[1]
    assert dead[0] == 503 and b"stopped following" in dead[1]


def test_a_run_is_active_stopped_quiet_or_new():
    now = 10_000.0
    assert run_state("a", {}, now).state == "new"
    live = {"trainer": status("trainer", "trainer", t=now - 5, step=12)}
    row = run_state("a", live, now)
    assert (row.state, row.live, row.trainer_step, row.last_activity) == ("active", 1, 12, now - 5)
    ended = {
        "trainer": status("trainer", "trainer", t=now - 3, state=RunState.STOPPED),
        "explorer-0": status(t=now - 2, state=RunState.STOPPED),
    }
    assert run_state("a", ended, now).state == "stopped"
    killed = {"trainer": status("trainer", "trainer", t=now - ACTIVE_S - 1)}
    assert run_state("a", killed, now).state == "quiet"
    # the trainer stopped but an explorer of it still beats: the run is not over
    ended["explorer-0"] = status(t=now - 1)
    assert run_state("a", ended, now).state == "active"


def test_json_logs_are_one_object_a_line(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    setup_logging("INFO", "json", "explore")
    try:
        log = logging.getLogger("streamrft.test")
        log.info("two\nlines %s", "é")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
        logging.getLogger("aiokafka").info("quiet library")  # WARNING and up only
    finally:  # the worker's logging as it was (pytest's capture handlers)
        handlers, level = saved
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
    lines = err.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "two\nlines é" and first["level"] == "INFO"
    assert first["logger"] == "streamrft.test" and first["command"] == "explore"
    assert first["time"].endswith("Z") and first["pid"] > 0
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_the_run_is_ready_from_its_trainers_report_in_this_attempt_until_it_stops():
    cfg = msgspec.structs.replace(Config(), run=msgspec.structs.replace(Config().run, id="r1"))
    monitor, started = RunMonitor(cfg), [0.0]
    answers = RunProbes(monitor, None, {}, lambda: started[0])  # type: ignore[arg-type]
    monitor.on_status(status("trainer", "trainer", t=100.0))  # an earlier attempt's
    assert answers.readiness() == (False, "the run's processes are not started yet")
    started[0] = 200.0
    assert answers.readiness()[1] == "the trainer has not reported in this attempt yet"
    monitor.on_status(status("trainer", "trainer", t=201.0, step=4, version=3))
    assert answers.readiness() == (True, "trainer at step 4, version 3")
    monitor.on_status(status("trainer", "trainer", t=260.0, step=9, state=RunState.STOPPED))
    assert answers.readiness() == (False, "the trainer stopped at step 9")
