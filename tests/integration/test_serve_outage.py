"""Serve mode through a broker outage: what the broker does not take is spooled to disk
(bounded: 503 past it), a stop ends within its shutdown timeout, and every spooled group is
published once when the broker is back, by the same server or by the next one of the run
(a server killed with SIGKILL included). A spool whose disk is full or read-only (a tmpfs
of a few pages: the kernel's own ENOSPC and EROFS) loses nothing either.

Each test has a broker of its own (the embedded Tansu broker, killed and restarted; in
memory, so the restarted broker holds exactly what was published after the outage), and
the server's real HTTP API is called over a socket.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from streamrft.infra import admin
from streamrft.infra.config import from_dict
from streamrft.infra.consume import read_history
from streamrft.infra.local.services import LocalServices
from streamrft.producers.serving.api import build_app
from streamrft.producers.serving.server import Server, spool_folder
from streamrft.producers.serving.spool import decode
from streamrft.schemas.codec import EXPERIENCE_GROUP
from tests.helpers.cli import overrides, start_logged, streamrft_cmd
from tests.helpers.paths import ADDITION, EXAMPLE
from tests.helpers.processes import wait_for
from tests.helpers.tiny_disk import tiny_disk
from tests.helpers.waits import until

pytestmark = pytest.mark.integration

ATTEMPT_S = 2.0
SHUTDOWN_S = 5.0
SERVE = {
    "serve_initial": True,
    "port": 0,
    "publish_attempt_s": ATTEMPT_S,
    "shutdown_timeout_s": SHUTDOWN_S,
    "group_timeout_s": 0.0,
}
MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 4,
    "max_positions": 32,
}


@pytest.fixture
def broker(tmp_path):
    with LocalServices(tmp_path / "services", object_store=False) as svc:
        yield svc


def _config(svc: LocalServices, tmp_path: Path, run_id: str, **serve):
    return from_dict(
        {
            "run": {"name": "t", "id": run_id, "dir": str(tmp_path / "runs")},
            "kafka": {"bootstrap_servers": svc.endpoints.bootstrap_servers},
            "taskset": {"path": str(ADDITION)},
            "model": MODEL,
            "serve": {**SERVE, **serve},
        }
    )


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    return await asyncio.to_thread(_http, url, body)


async def _rewarded(url: str) -> tuple[int, dict]:
    """A completion of 2 choices, both rewarded: one group once committed."""
    status, completion = await _call(
        f"{url}/v1/completions", {"prompt": "1+2=", "max_tokens": 2, "n": 2}
    )
    if status == 200:
        fb = await _call(f"{url}/feedback", {"response_id": completion["id"], "reward": 1.0})
        assert fb == (200, {"rewarded": 2})
    return status, completion


def _url(cfg, server_name: str) -> str | None:
    path = cfg.run_dir / "serve" / f"{server_name}.json"
    return json.loads(path.read_text())["url"] if path.exists() else None


async def _start(cfg) -> tuple[Server, asyncio.Task, str]:
    server = Server(cfg)
    task = asyncio.create_task(server.run(build_app(server, None), None))
    await until(lambda: _url(cfg, server.name) or task.done(), 60, "the server's URL")
    assert not task.done(), task.exception()
    return server, task, _url(cfg, server.name)


async def _stop(server: Server, task: asyncio.Task) -> float:
    """Ask ``server`` to stop as SIGTERM does; how long it took."""
    started = time.monotonic()
    server.stop.set()
    await asyncio.wait_for(task, 60)
    return time.monotonic() - started


async def _published_ids(cfg) -> list[str]:
    groups = await read_history(
        cfg.kafka, cfg.topics().experiences, EXPERIENCE_GROUP, f"t-{uuid.uuid4().hex[:8]}", 3
    )
    return [g.id for g in groups]


def _spooled_ids(folder: Path) -> list[str]:
    return [g.id for path in sorted(folder.glob("*.spool")) for g in decode(path.read_bytes())]


async def _broker_back(svc: LocalServices, cfg) -> None:
    await asyncio.to_thread(svc.restart, "broker")
    await admin.ensure_topics(cfg.kafka, cfg.topics())  # a memory broker restarts empty


def test_an_outage_spools_to_disk_up_to_its_bound_then_each_group_is_published_once(
    broker, tmp_path
):
    bound = 4000  # a group of 2 short choices is about 900 bytes
    cfg = _config(broker, tmp_path, f"outage-{uuid.uuid4().hex[:8]}", spool_max_bytes=bound)

    async def scenario() -> tuple[list[str], list[str]]:
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        server, task, url = await _start(cfg)
        try:
            assert (await _rewarded(url))[0] == 200
            # a response waiting for its commit: the trainer's idle timeout does not run out
            assert server._position().working
            await asyncio.to_thread(broker.kill, "broker")

            # the first commit tries for publish_attempt_s, then answers 202: on disk
            assert (await _rewarded(url))[0] == 200
            started = time.monotonic()
            status, body = await _call(f"{url}/commit", {})
            assert time.monotonic() - started < 2 * ATTEMPT_S + 2
            assert status == 202, body
            assert body["spooled_groups"] == 2 and body["published_groups"] == 0
            committed = list(body["group_ids"])
            folder = spool_folder(cfg)
            assert sorted(_spooled_ids(folder)) == sorted(committed)

            # rewarded, not committed yet: it stays with the server through what follows
            kept = (await _rewarded(url))[1]["id"]
            # until the bound: each commit spooled at once (no try while the broker is away)
            for _ in range(30):
                completion = (await _rewarded(url))[1]
                started = time.monotonic()
                status, body = await _call(f"{url}/commit", {"response_id": completion["id"]})
                assert time.monotonic() - started < 2.0
                if status != 202:
                    break
                assert body["spooled_groups"] == 1
                committed += body["group_ids"]
            assert status == 503 and "spool is full" in body["error"]["message"], body
            assert len(committed) >= 3
            assert server.spool.size() <= bound and len(server.spool.pending()) >= 2
            assert sorted(_spooled_ids(folder)) == sorted(committed)
            held = [g.id for g in server.held_back]  # the commit that did not fit
            assert len(held) == 1
            # full: completions are refused before sampling, commits too
            status, refused = await _rewarded(url)
            assert status == 503 and "spool" in refused["error"]["message"]
            assert (await _call(f"{url}/commit", {}))[0] == 503
            assert server.recorder.held == 2  # the refused commit left the kept response
            assert server.counters["groups_spooled"] == len(committed)
            assert server.counters["spool_bytes"] == server.spool.size()

            await _broker_back(broker, cfg)
            await until(
                lambda: not server.spool.pending() and not server.held_back, 60, "spool drained"
            )
            assert server.spool.size() == 0 and server.refusal() is None
            # served and published again at once: the kept response and a new one
            assert (await _rewarded(url))[0] == 200
            status, body = await _call(f"{url}/commit", {})
            assert status == 200 and body["published_groups"] == 2, body
            assert body["spooled_groups"] == 0 and any(kept in g for g in body["group_ids"])
            committed += held + body["group_ids"]
            assert server.recorder.held == 0 and not server._position().working
        finally:
            await _stop(server, task)
        return committed, await _published_ids(cfg)

    committed, published = asyncio.run(scenario())
    assert len(published) == len(set(published)), "a group was published twice"
    assert sorted(published) == sorted(committed)


def test_a_stop_in_an_outage_ends_in_time_and_the_next_server_publishes_the_spool(broker, tmp_path):
    cfg = _config(broker, tmp_path, f"stop-{uuid.uuid4().hex[:8]}")

    async def first() -> float:
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        server, task, url = await _start(cfg)
        for _ in range(3):  # rewarded, never committed: published (or spooled) at stop
            assert (await _rewarded(url))[0] == 200
        await asyncio.to_thread(broker.kill, "broker")
        return await _stop(server, task)

    async def next_process() -> list[str]:  # a loop of its own, as a new process has
        await _broker_back(broker, cfg)
        server, task, _ = await _start(cfg)
        try:
            await until(lambda: not server.spool.pending(), 60, "the spool published")
            assert server.counters["groups_published"] == 3
        finally:
            await _stop(server, task)
        return await _published_ids(cfg)

    took = asyncio.run(first())
    assert took < SHUTDOWN_S + 3, f"the stop took {took:.1f}s"
    spooled = _spooled_ids(spool_folder(cfg))
    assert len(spooled) == 3
    published = asyncio.run(next_process())
    assert sorted(published) == sorted(spooled) and len(set(published)) == 3


def test_a_stop_that_can_neither_publish_nor_spool_counts_what_it_loses(broker, tmp_path):
    cfg = _config(broker, tmp_path, f"lost-{uuid.uuid4().hex[:8]}", spool_max_bytes=1000)

    async def scenario() -> tuple[float, Server]:
        await admin.ensure_topics(cfg.kafka, cfg.topics())
        server, task, url = await _start(cfg)
        for _ in range(3):  # 3 groups in one batch: more than 1000 bytes
            assert (await _rewarded(url))[0] == 200
        await asyncio.to_thread(broker.kill, "broker")
        return await _stop(server, task), server

    took, server = asyncio.run(scenario())
    assert took < SHUTDOWN_S + 3, f"the stop took {took:.1f}s"
    assert server.counters["groups_lost"] == 3 and server.spool.pending() == []


def test_what_a_killed_server_spooled_is_published_by_the_next(broker, tmp_path):
    """A real ``streamrft serve`` process spools a commit, then is killed with SIGKILL."""
    run_id = f"crash-{uuid.uuid4().hex[:8]}"
    cfg = _config(broker, tmp_path, run_id)
    settings = [f"run.dir={tmp_path / 'runs'}", f"taskset.path={ADDITION}"]
    settings += [
        f"serve.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in SERVE.items()
    ]
    settings += [f"model.{k}={v}" for k, v in MODEL.items()]
    settings += [f"kafka.bootstrap_servers={broker.endpoints.bootstrap_servers}"]
    argv = streamrft_cmd("serve", str(EXAMPLE), "--run-id", run_id, *overrides(*settings))
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    proc = start_logged(argv, tmp_path / "serve.log", tmp_path)
    folder = cfg.run_dir / "serve"
    try:
        wait_for(lambda: any(folder.glob("*.json")), proc, 120, "serve to start")
        url = json.loads(next(folder.glob("*.json")).read_text())["url"]
        assert asyncio.run(_rewarded(url))[0] == 200
        broker.kill("broker")
        status, body = _http(f"{url}/commit", {})
        assert status == 202 and body["spooled_groups"] == 1, body
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert _spooled_ids(spool_folder(cfg)) == body["group_ids"]

    async def restarted() -> list[str]:
        await _broker_back(broker, cfg)
        server, task, _ = await _start(cfg)
        try:
            await until(lambda: not server.spool.pending(), 60, "the spool published")
        finally:
            await _stop(server, task)
        return await _published_ids(cfg)

    assert asyncio.run(restarted()) == body["group_ids"]


def test_a_full_disk_in_an_outage_keeps_every_commit_and_publishes_each_once(broker, tmp_path):
    with tiny_disk(tmp_path / "disk") as disk:
        run_id = f"enospc-{uuid.uuid4().hex[:8]}"
        cfg = _config(broker, tmp_path, run_id, spool_dir=str(disk.path / "spool"))

        async def scenario() -> tuple[list[str], list[str]]:
            await admin.ensure_topics(cfg.kafka, cfg.topics())
            server, task, url = await _start(cfg)
            try:
                assert (await _rewarded(url))[0] == 200
                await asyncio.to_thread(broker.kill, "broker")
                disk.fill()
                # neither the broker nor the disk takes it: 503, the group kept in memory
                status, body = await _call(f"{url}/commit", {})
                message = body["error"]["message"]
                assert status == 503 and "cannot be written" in message, body
                assert "No space left on device" in message
                held = [g.id for g in server.held_back]
                assert len(held) == 1 and server.spool.pending() == []
                assert (await _rewarded(url))[0] == 503  # refused before sampling meanwhile
                # the flush loop meets the full disk again and again, and goes on
                await until(lambda: server.counters["spool_errors"] >= 3, 120, "3 tries")
                assert not task.done() and [g.id for g in server.held_back] == held

                disk.free()
                # (held_back is empty while the loop tries it: wait for the spool's file)
                await until(server.spool.pending, 60, "the held group spooled")
                assert not server.held_back
                assert _spooled_ids(server.spool.folder) == held
                assert (await _rewarded(url))[0] == 200
                status, body = await _call(f"{url}/commit", {})
                assert status == 202 and body["spooled_groups"] == 1, body
                committed = held + body["group_ids"]

                await _broker_back(broker, cfg)
                await until(lambda: not server.spool.pending(), 60, "the spool published")
                assert server.counters["groups_published"] == 2
            finally:
                await _stop(server, task)
            assert server.counters.get("groups_lost") == 0
            return committed, await _published_ids(cfg)

        committed, published = asyncio.run(scenario())
    assert len(published) == len(set(published)), "a group was published twice"
    assert sorted(published) == sorted(committed)


def test_a_stop_with_the_disk_full_and_the_broker_away_counts_every_group_lost(broker, tmp_path):
    with tiny_disk(tmp_path / "disk") as disk:
        run_id = f"full-{uuid.uuid4().hex[:8]}"
        cfg = _config(broker, tmp_path, run_id, spool_dir=str(disk.path / "spool"))

        async def scenario() -> tuple[float, Server]:
            await admin.ensure_topics(cfg.kafka, cfg.topics())
            server, task, url = await _start(cfg)
            for _ in range(3):  # rewarded, never committed: for the stop to publish
                assert (await _rewarded(url))[0] == 200
            await asyncio.to_thread(broker.kill, "broker")
            disk.fill()
            return await _stop(server, task), server

        took, server = asyncio.run(scenario())
        assert took < SHUTDOWN_S + 3, f"the stop took {took:.1f}s"
        assert server.counters["groups_lost"] == 3 and server.spool.pending() == []
        assert server.counters["spool_errors"] >= 1


def test_a_read_only_spool_publishes_a_file_once_and_deletes_it_when_it_can(broker, tmp_path):
    """A file published while its disk is read-only stays held by the server (no one
    publishes it again) until it can be deleted."""
    with tiny_disk(tmp_path / "disk") as disk:
        run_id = f"erofs-{uuid.uuid4().hex[:8]}"
        cfg = _config(broker, tmp_path, run_id, spool_dir=str(disk.path / "spool"))

        async def scenario() -> tuple[list[str], list[str]]:
            await admin.ensure_topics(cfg.kafka, cfg.topics())
            server, task, url = await _start(cfg)
            try:
                assert (await _rewarded(url))[0] == 200
                await asyncio.to_thread(broker.kill, "broker")
                status, body = await _call(f"{url}/commit", {})
                assert status == 202 and body["spooled_groups"] == 1, body
                committed = list(body["group_ids"])
                disk.read_only()
                await _broker_back(broker, cfg)
                await until(lambda: server.counters.get("groups_published") == 1, 60, "published")
                await until(lambda: server.counters.get("spool_errors") >= 3, 120, "3 deletions")
                assert server.spool.pending() != [] and server.counters["groups_published"] == 1
                disk.read_only(False)
                await until(lambda: not server.spool.pending(), 60, "the file deleted")
                assert server.counters["groups_published"] == 1
            finally:
                await _stop(server, task)
            return committed, await _published_ids(cfg)

        committed, published = asyncio.run(scenario())
    assert published == committed
