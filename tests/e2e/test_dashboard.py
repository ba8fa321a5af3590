"""``streamrft dashboard`` in a real headless Chromium, beside a real ``streamrft run``.

The page renders and updates without a reload: the trainer's reward curve gains points,
experiences/s rises above 0, an explorer started by hand appears (and the others are
reassigned: a rebalance) and its STOPPED shows once it is sent SIGTERM, the dead-letter
counter moves when garbage is produced to the run's experiences topic, and markup in a
dead letter shows as text; the samples panel shows both explorers' decoded rollouts, a
hostile sample's markup as text, and filters by reward and task. A finished run whose broker is gone is shown from its
``metrics.jsonl``, with what that file cannot know shown as unknown. A screenshot of each page is
kept in ``test-artifacts/`` (gitignored). Without Chromium or ``tests/browser``'s
node_modules the tests skip, except under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest

from streamrft.app.watch import run_events
from streamrft.app.watch.metrics_log import MetricsLog, metrics_path
from streamrft.infra.config import Config, with_run_id
from streamrft.schemas.codec import DEAD_LETTER, SAMPLE
from streamrft.schemas.events import DeadLetter, MetricsEvent
from streamrft.schemas.samples import Sample, SamplePart
from tests.helpers.browser import Browser, need_browser
from tests.helpers.cli import env, explore_argv, run_argv, start_logged, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import child_pid, frozen, kill_run, processes_mentioning, wait_for

pytestmark = pytest.mark.e2e

ROW = "document.querySelector('#components tr[data-component^=\"{}\"]')"
TRAINER_POINTS = (
    "Number(document.querySelector('#chart-reward path[data-series=\"trainer\"]')"
    "?.dataset.points || 0)"
)
XSS = '<img src=x onerror="window.__pwned = 1">'
"""Markup in a component id or a dead letter's reason: the page shows it as text."""


def _start_dashboard(tmp_path: Path, runs: Path, run_id: str, *more: str):
    """``streamrft dashboard --run-id RUN_ID --runs-dir RUNS --port 0``; (process, URL)."""
    url_file = tmp_path / f"dashboard-{run_id}.url"
    argv = streamrft_cmd(
        "dashboard", "--run-id", run_id, "--runs-dir", str(runs), "--port", "0",
        "--url-file", str(url_file), *more,
    )  # fmt: skip
    proc = subprocess.Popen(
        argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    wait_for(url_file.is_file, proc, 60, "the dashboard to serve")
    url = url_file.read_text().strip()
    assert url.startswith("http://127.0.0.1:") and url.endswith(f"/?run={run_id}")
    return proc, url


def _stop_dashboard(proc: subprocess.Popen) -> str:
    """SIGTERM: it stops cleanly (exit 0) with open streams; its stdout."""
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return out


def _count(browser: Browser, selector: str, attr: str) -> int:
    return int(browser.eval(f"document.querySelector('{selector}').dataset.{attr}"))


async def _produce_garbage(bootstrap: str, topic: str, letters: str) -> None:
    """Garbage to ``topic`` (the trainer dead-letters it), and a dead letter with markup in
    its reason straight to ``letters``."""
    from aiokafka import AIOKafkaProducer

    letter = DeadLetter(
        source_topic=topic, partition=0, offset=0, key=None, value=b"", reason=f"bad {XSS}",
        error_type="SchemaError", component=XSS, created_at=time.time(),
    )  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"\xff\x00 not a message \x13\x37", key=b"garbage")
        await producer.send_and_wait(
            letters, DEAD_LETTER.encode(letter), headers=DEAD_LETTER.headers()
        )
    finally:
        await producer.stop()


async def _produce_sample(bootstrap: str, topic: str) -> None:
    """A sample whose task id, policy text and inserted text hold markup, reward 9 (no
    rollout of the run has it: a filter finds this one alone)."""
    from aiokafka import AIOKafkaProducer

    sample = Sample(
        experience_id="hostile#0", task_id=f"xss-{XSS}", explorer="app", explorer_step=0,
        workflow="math", model_version=0, reward=9.0, created_at=time.time(),
        parts=[
            SamplePart(role="prompt", text="<b>bold?</b> 2+2="),
            SamplePart(role="policy", text=f"4 {XSS}"),
            SamplePart(role="inserted", text="<script>window.__pwned = 2</script>"),
        ],
    )  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, SAMPLE.encode(sample), headers=SAMPLE.headers())
    finally:
        await producer.stop()


def _filter_samples(browser: Browser, field: str, value: str) -> int:
    """Type ``value`` into the samples filter ``field``; the samples shown."""
    browser.eval(
        f"(() => {{ const f = document.querySelector('#sample-{field}'); f.value = {value!r}; "
        "f.dispatchEvent(new Event('input')); return f.value; })()"
    )
    return _count(browser, "#samples", "count")


def _check_samples(browser: Browser, bootstrap: str, topic: str) -> None:
    """The run's explorers' samples are shown decoded; a hostile one is shown as text; the
    filters by reward and task work."""
    browser.wait("Number(document.querySelector('#samples').dataset.count) >= 2", 60, "samples")
    prompts = browser.eval(
        "[...document.querySelectorAll('#samples .part-prompt')].map(p => p.textContent)"
    )
    assert all(p.endswith("=") for p in prompts), prompts  # addition tasks, decoded
    explorers = browser.eval(
        "[...document.querySelectorAll('#samples .sample')].map(s => s.dataset.explorer)"
    )
    assert {"explorer-0", "explorer-1"} <= set(explorers), explorers
    asyncio.run(_produce_sample(bootstrap, topic))
    browser.wait(
        "[...document.querySelectorAll('#samples .sample')].some(s => s.dataset.explorer === 'app')",
        60,
        "the hostile sample",
    )
    assert _filter_samples(browser, "min", "5") == 1  # rewards of the run are at most 1
    text = browser.eval("document.querySelector('#samples .sample-text').textContent")
    assert text == f"<b>bold?</b> 2+2=4 {XSS}<script>window.__pwned = 2</script>"
    assert (
        browser.eval(
            "document.querySelectorAll('#samples img, #samples b, #samples script').length"
        )
        == 0
    )
    assert browser.eval("window.__pwned === undefined") is True
    assert _filter_samples(browser, "min", "") >= 3
    assert _filter_samples(browser, "task", "xss-") == 1
    assert _filter_samples(browser, "task", "") >= 3


def _assert_shown_as_text(browser: Browser, table: str) -> None:
    assert browser.eval("window.__pwned === undefined") is True
    assert browser.eval(f"document.querySelectorAll('{table} img').length") == 0
    cells = browser.eval(f"[...document.querySelectorAll('{table} td')].map(c => c.textContent)")
    assert any(XSS in cell for cell in cells), cells


def test_the_dashboard_follows_a_live_run_in_a_real_browser(tmp_path):
    need_browser()
    runs = tmp_path / "runs"
    run_id = f"dash-{os.getpid()}-{int(time.time())}"
    run = start_logged(
        run_argv(
            EXAMPLE,
            run_id,
            80,
            runs,
            None,
            "eval.interval=10",
            "trainer.idle_timeout_s=900",  # held below while an explorer joins by hand
            "trainer.warmup_sft_steps=20",  # a reward that rises: a curve worth looking at
            explorers=2,
            summary=tmp_path / "summary.json",
        ),
        tmp_path / "run.log",
        tmp_path,
    )
    dash = hand = browser = None
    try:
        wait_for(lambda: (runs / run_id / "config.yaml").is_file(), run, 120, "the run to start")
        dash, url = _start_dashboard(tmp_path, runs, run_id)
        browser = Browser()
        browser.goto(url)
        browser.eval("window.__loadedOnce = 'same page'")  # gone if the page reloads
        browser.wait(
            "document.querySelector('#source').dataset.live === 'true' && "
            "document.querySelector('#source-text').textContent.startsWith('broker ')",
            60,
            "the run's broker as its source",
        )
        browser.wait(f"{TRAINER_POINTS} >= 3", 240, "the trainer's rewards")
        browser.wait(f"{ROW.format('trainer')}?.dataset.state === 'RUNNING'", 60, "the trainer")
        browser.wait(f"{ROW.format('explorer-1')}", 60, "the second explorer")
        browser.wait(
            "document.querySelector('#kpi-rate-label').textContent === 'experiences/s' && "
            "parseFloat(document.querySelector('#kpi-rate').textContent.replace(/,/g, '')) > 0",
            90,
            "experiences/s above 0",
        )

        # an explorer started by hand joins; SIGTERM makes it report STOPPED. The trainer is
        # held from here until garbage waits on its topic: on a busy machine that explorer's
        # start (imports, the model) can take longer than the whole run
        cfg = with_run_id(
            msgspec.structs.replace(
                Config(), run=msgspec.structs.replace(Config().run, dir=str(runs))
            ),
            run_id,
        )
        broker = run_events.find_broker(cfg)
        assert broker is not None
        with frozen(child_pid(run_id, "train")):
            hand = start_logged(
                explore_argv(EXAMPLE, run_id, runs, None), tmp_path / "hand.log", tmp_path
            )
            hand_row = ROW.format(f"explorer-{hand.pid}-")
            # live: RUNNING, or waiting for the version its batch needs from the held trainer
            live = "['RUNNING', 'WAITING_SYNC'].includes(" + hand_row + "?.dataset.state)"
            browser.wait(live, 300, "the hand-started explorer")
            # it joined the explorers' group: the others were reassigned their tasks partitions
            browser.wait(
                "Number(document.querySelector('#rebalances').textContent) >= 1", 60, "rebal."
            )
            hand.send_signal(signal.SIGTERM)
            assert hand.wait(timeout=90) == 0, (tmp_path / "hand.log").read_text()[-3000:]
            browser.wait(f"{hand_row}?.dataset.state === 'STOPPED'", 60, "the explorer's STOPPED")
            _check_samples(browser, broker.kafka.bootstrap_servers, cfg.topics().samples)

            # garbage on the experiences topic: the trainer dead-letters it, the counter moves
            before = _count(browser, "#dead-letter-count", "count")
            topic = cfg.topics().experiences
            asyncio.run(
                _produce_garbage(broker.kafka.bootstrap_servers, topic, cfg.topics().dead_letters)
            )
        browser.wait(
            f"Number(document.querySelector('#dead-letter-count').dataset.count) > {before + 1}",
            60,
            "the dead letters",
        )
        letters = browser.eval(
            "[...document.querySelectorAll('#dead-letters tr')].map(r => r.textContent)"
        )
        assert sum(topic in row for row in letters) >= 2, letters
        _assert_shown_as_text(browser, "#dead-letters")
        assert browser.eval("window.__loadedOnce") == "same page"  # all of it without a reload
        shot = browser.screenshot("dashboard.png")
        assert shot.stat().st_size > 10_000
        assert browser.errors() == []

        assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
        # the run's embedded broker stopped with it: the page says so, and keeps what it read
        browser.wait(
            "document.querySelector('#source').dataset.live === 'false' && "
            "document.querySelector('#source-text').textContent.includes('gone')",
            60,
            "the broker gone",
        )
        steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
        assert browser.eval(TRAINER_POINTS) >= steps
        assert "dashboard: http://127.0.0.1:" in _stop_dashboard(dash)
        # a dashboard started now finds no broker: the run folder's metrics.jsonl shows it
        assert metrics_path(runs / run_id).is_file()
        dash, url = _start_dashboard(tmp_path, runs, run_id)
        browser.goto(url)
        browser.wait(
            "document.querySelector('#source-text').textContent.includes('metrics.jsonl')",
            60,
            "the run's metrics.jsonl as its source",
        )
        browser.wait(f"document.querySelector('#kpi-step').textContent === '{steps}'", 30, "steps")
        assert browser.eval(TRAINER_POINTS) >= steps
        # the file holds metrics only: no dead-letter count, rebalances or versions announced
        for kpi in ("dead-letter-count", "rebalances", "kpi-versions"):
            assert browser.eval(f"document.querySelector('#{kpi}').textContent") == "–"
            note = browser.eval(f"document.querySelector('#{kpi}-note').textContent")
            assert note == "not in metrics.jsonl"
        browser.screenshot("dashboard-ended.png")
        _stop_dashboard(dash)
        dash = None
    except BaseException:
        kill_run(run_id)  # the run's children too: nothing of a failed test outlives it
        raise
    finally:
        if browser is not None:
            browser.close()
        for proc in (hand, dash, run):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not processes_mentioning(run_id)


def _finished_run(runs: Path, run_id: str, steps: int) -> None:
    """A run folder as a finished run leaves it: ``metrics.jsonl``, no broker."""
    path = metrics_path(runs / run_id)
    log = MetricsLog(path)
    t0 = time.time() - 600
    for step in range(1, steps + 1):
        values = {
            "train/reward_mean": step / steps,
            "train/step_seconds": 0.5,
            "train/staleness_groups_0": 24.0,
            "train/staleness_groups_1": 8.0,
        }
        if step == 1:
            values["train/staleness_groups_-1"] = 2.0  # sampled with a newer version
        if step % 5 == 0:
            values["eval/accuracy"] = 0.5 + step / (4 * steps)
        log.append(MetricsEvent(run=run_id, component="trainer", step=step, version=step - 1,
                                values=values, created_at=t0 + step))  # fmt: skip
        log.append(MetricsEvent(run=run_id, component="explorer-0", step=step, version=step - 1,
                                values={"explorer/reward_mean": step / steps / 2,
                                        "explorer/groups": 32.0},
                                created_at=t0 + step + 0.5))  # fmt: skip
    log.append(MetricsEvent(run=run_id, component=XSS, step=1, version=0,
                            values={"explorer/groups": 1.0}, created_at=t0 + 1))  # fmt: skip
    log.close()
    os.utime(path, (t0 + steps + 1, t0 + steps + 1))  # written when the run ended


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_finished_run_is_shown_from_its_metrics_file(tmp_path):
    """No broker holds the run (no services, none configured): the page reads the run
    folder's metrics.jsonl and says so; the API answers bad requests with clear errors."""
    runs = tmp_path / "runs"
    run_id = f"finished-{os.getpid()}"
    _finished_run(runs, run_id, steps=25)
    dash, url = _start_dashboard(tmp_path, runs, run_id)
    browser = None
    try:
        base = url.split("?")[0]
        status, body = _get(f"{base}api/runs")
        assert status == 200
        (row,) = [r for r in body["runs"] if r["run"] == run_id]
        assert (row["on_broker"], row["metrics_file"], row["folder"]) == (False, True, True)
        assert row["last"] > time.time() - 3600
        assert _get(f"{base}api/runs/no-such-run/snapshot") == (
            404,
            {"error": "unknown run 'no-such-run': not on the broker, no metrics.jsonl"},
        )
        status, body = _get(f"{base}api/runs/bad.id/snapshot")
        assert status == 400 and "bad run id" in body["error"]
        need_browser()
        browser = Browser()
        browser.goto(url)
        browser.wait(
            "document.querySelector('#source-text').textContent.includes('metrics.jsonl')",
            60,
            "metrics.jsonl as the source",
        )
        # 25 trainer rewards and 25 of explorer-0
        browser.wait("document.querySelector('#chart-reward').dataset.points == 50", 30, "rewards")
        assert browser.eval(TRAINER_POINTS) == 25
        assert _count(browser, "#chart-eval", "points") == 5
        # groups 1, 0 and -1 versions old (-1: sampled with a version newer than the trainer's)
        assert _count(browser, "#chart-staleness", "bars") == 3
        assert (
            browser.eval("document.querySelector('#chart-staleness rect.newer').dataset.k") == "-1"
        )
        assert browser.eval("document.querySelector('#kpi-step').textContent") == "25"
        assert browser.eval("document.querySelector('#kpi-version').textContent") == "24"
        # a run that ended long ago is not live; what the file cannot know is not shown as 0
        assert browser.eval("document.querySelector('#source').dataset.live") == "false"
        assert browser.eval("document.querySelector('#dead-letter-count').textContent") == "–"
        rows = browser.eval(
            "[...document.querySelectorAll('#components tr')].map(r => r.dataset.component)"
        )
        assert rows == [XSS, "explorer-0", "trainer"]
        _assert_shown_as_text(browser, "#components")
        assert browser.eval("document.querySelector('#runs li.active').dataset.run") == run_id
        browser.screenshot("dashboard-finished.png")
        assert browser.errors() == []
    finally:
        if browser is not None:
            browser.close()
        if dash.poll() is None:
            _stop_dashboard(dash)
