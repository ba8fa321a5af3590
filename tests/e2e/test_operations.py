"""A run operated as a platform engineer would: its topics made by an init step, an explorer
probed on its own port (``/healthz`` alive and ``/readyz`` 503 while it holds no weights,
then 200), the supervisor's ``/metrics`` for the whole run, both equal to what the metrics
topic says, JSON logs, ``streamrft runs`` and ``streamrft stop``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest
import yaml

from streamrft.app.watch.run_events import read_events
from tests.helpers.cli import env, explore_argv, run_argv, start_logged, start_piped, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.probes import check, free_port, sample, scrape

pytestmark = pytest.mark.e2e


def _until(what: str, ready, procs, timeout: float = 240):
    """Poll ``ready()`` until it returns something true; fail if a process ends first."""
    deadline = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"a process ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _topic_values(cfg, component: str, through_step: int) -> dict[str, float]:
    """Each metric name's newest value among ``component``'s metrics events, read off the
    topic up to its last event of ``through_step``."""
    events = []

    def keep(_kind, ev):
        if ev.component == component:
            events.append(ev)

    asyncio.run(read_events(cfg.kafka, cfg.topics(), ["metrics"], keep, follow=False))
    last = max(i for i, ev in enumerate(events) if ev.step == through_step)
    values: dict[str, float] = {}
    for ev in events[: last + 1]:
        values.update(ev.values)
    return values


def _metric_values(samples, component: str) -> dict[str, float]:
    return {
        dict(labels)["name"]: v
        for (name, labels), v in samples.items()
        if name == "streamrft_metric" and dict(labels)["component"] == component
    }


def test_a_run_operated_from_outside(services, make_config, tmp_path):
    run_id = f"ops-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    runs.mkdir()
    boot = services.bootstrap_servers
    cfg = make_config(run={"id": run_id})

    # the init step: the run's topics, before any process of it
    made = subprocess.run(
        streamrft_cmd("topics", str(EXAMPLE), "--create", "--run-id", run_id, "--bootstrap", boot),
        env=env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    assert made.stdout.count(" created") == 7, made.stdout  # the seven topics of a run

    explorer_port, run_port = free_port(), free_port()
    explorer = start_logged(
        explore_argv(
            EXAMPLE, run_id, runs, services, f"monitor.http_port={explorer_port}", index=0
        ),
        tmp_path / "explorer.log",
        tmp_path,
    )
    procs = [explorer]
    run = None
    try:
        eb = f"http://127.0.0.1:{explorer_port}"
        _until("the explorer's probes", lambda: check(eb, "/healthz")[0] == 200, procs)
        connected = lambda: "connected" not in check(eb, "/readyz")[1]["reason"]  # noqa: E731
        _until("the explorer's first status", connected, procs)
        # no trainer yet, so no weights: alive, not ready, and it says why
        status, why = check(eb, "/readyz")
        assert status == 503 and why["reason"].startswith("not ready"), why
        alive, said = check(eb, "/healthz")
        assert alive == 200 and said["reason"].startswith("last status delivered"), said

        settings = [
            "eval.interval=0",
            f"monitor.http_port={run_port}",
            "monitor.log_format=json",
        ]
        run = start_piped(
            run_argv(EXAMPLE, run_id, 500, runs, services, *settings, explorers=0), tmp_path
        )
        procs.append(run)
        rb = f"http://127.0.0.1:{run_port}"
        _until("the explorer's weights", lambda: check(eb, "/readyz")[0] == 200, procs)
        _until("the run's readiness", lambda: check(rb, "/readyz")[0] == 200, procs)
        trained = lambda: sample(scrape(rb), "streamrft_step", component="trainer")  # noqa: E731
        _until("three trainer steps", lambda: trained() and trained()[0] >= 3, procs)

        # each /metrics says what the metrics topic says, to the last bit
        mine, whole = scrape(eb), scrape(rb)
        [step] = sample(mine, "streamrft_metric_step", component="explorer-0")
        assert _metric_values(mine, "explorer-0") == _topic_values(cfg, "explorer-0", step)
        assert "explorer/reward_mean" in _metric_values(mine, "explorer-0")
        [step] = sample(whole, "streamrft_metric_step", component="trainer")
        trainer_values = _metric_values(whole, "trainer")
        assert trainer_values == _topic_values(cfg, "trainer", step)
        assert {"train/loss", "train/reward_mean", "train/staleness_mean"} <= set(trainer_values)
        assert sample(whole, "streamrft_version_lag", component="explorer-0")[0] >= 0
        assert sample(whole, "streamrft_state", component="feeder", state="RUNNING") in ([1], [0])
        assert sample(whole, "streamrft_healthy") == []  # the run's own: no process gauges
        # the supervisor's children serve no probes of their own
        children = yaml.safe_load((runs / run_id / "config.yaml").read_text())
        assert children["monitor"]["http_port"] == 0

        listed = subprocess.run(
            streamrft_cmd("runs", "--bootstrap", boot, "--json"),
            env=env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr[-2000:]
        [row] = [r for r in json.loads(listed.stdout) if r["run"] == run_id]
        assert row["state"] == "active" and row["trainer_step"] >= 3
        assert row["components"] == 3 and row["live"] >= 2  # the feeder may be done

        stop = subprocess.run(
            streamrft_cmd("stop", "--run-id", run_id, "--bootstrap", boot, "--wait", "180"),
            env=env(), capture_output=True, text=True, timeout=240, cwd=tmp_path,
        )  # fmt: skip
        assert stop.returncode == 0, stop.stderr[-2000:]
        assert "trainer stopped at step" in stop.stdout
        _, err = run.communicate(timeout=180)
        assert run.returncode == 0, err[-3000:]
        assert explorer.wait(timeout=120) == 0, (tmp_path / "explorer.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    after = subprocess.run(
        streamrft_cmd("runs", "--bootstrap", boot),
        env=env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    [line] = [ln for ln in after.stdout.splitlines() if ln.startswith(run_id)]
    assert line.split()[1] == "stopped", after.stdout

    # JSON logs: every line of the supervisor's and the trainer's is one object
    trainer_log = (runs / run_id / "logs" / "trainer.log").read_text().splitlines()
    for lines, command in ((err.splitlines(), "run"), (trainer_log, "train")):
        records = [json.loads(line) for line in lines if line.strip()]
        assert records and all(r["command"] == command for r in records)
        assert all({"time", "level", "logger", "message", "pid"} <= set(r) for r in records)
    assert any(
        "shutdown requested (streamrft stop)" in json.loads(ln)["message"] for ln in trainer_log
    )
