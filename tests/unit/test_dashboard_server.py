"""The dashboard's feeds and streams without a broker: a run folder's metrics.jsonl."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import pytest

from streamrft.app.watch.dashboard import feed as feed_mod
from streamrft.app.watch.dashboard.feed import Feed
from streamrft.app.watch.dashboard.server import RUN_ID, Dashboard
from streamrft.app.watch.metrics_log import MetricsLog, metrics_path
from streamrft.infra.config import Config, with_run_id
from streamrft.schemas.events import MetricsEvent
from tests.helpers.waits import until

pytestmark = pytest.mark.unit


def _cfg(runs: Path, run_id: str) -> Config:
    cfg = Config()
    return with_run_id(
        msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, dir=str(runs))), run_id
    )


def _write(runs: Path, run_id: str, steps: range, mode: str = "a") -> None:
    path = metrics_path(runs / run_id)
    if mode == "w" and path.exists():
        path.unlink()
    log = MetricsLog(path)
    for step in steps:
        log.append(
            MetricsEvent(
                run=run_id, component="trainer", step=step, version=step,
                values={"train/reward_mean": step / 10}, created_at=time.time(),
            )
        )  # fmt: skip
    log.close()


def _trainer_points(feed: Feed) -> list:
    return json.loads(feed.payload())["view"]["curves"]["reward"].get("trainer", [])


def test_concurrent_first_requests_share_one_feed(tmp_path):
    runs = tmp_path / "runs"
    _write(runs, "r1", range(3))

    async def scenario():
        dash = Dashboard(_cfg(runs, "r1"))
        try:
            feeds = await asyncio.gather(*(dash.feed("r1") for _ in range(6)))
            assert len({id(f) for f in feeds}) == 1
            assert list(dash.feeds) == ["r1"]
            tasks = [t for t in asyncio.all_tasks() if t.get_name() == "feed r1"]
            assert len(tasks) == 1
        finally:
            await dash.close()

    asyncio.run(scenario())


def test_closed_streams_leave_no_task_behind(tmp_path):
    runs = tmp_path / "runs"
    _write(runs, "r1", range(3))

    async def scenario():
        dash = Dashboard(_cfg(runs, "r1"))
        try:
            feed = await dash.feed("r1")

            async def client() -> None:
                async for _ in dash.stream(feed):
                    pass

            async def connect_and_leave() -> None:
                task = asyncio.create_task(client())
                await asyncio.sleep(0.05)  # sent its first snapshot, waiting for a change
                task.cancel()  # the browser went away: the server cancels the response
                await asyncio.gather(task, return_exceptions=True)

            await connect_and_leave()
            before = len(asyncio.all_tasks())
            for _ in range(20):
                await connect_and_leave()
            assert len(asyncio.all_tasks()) == before
            assert feed.listeners == 0
        finally:
            await dash.close()

    asyncio.run(scenario())


def test_a_feed_nobody_watches_is_stopped(tmp_path):
    runs = tmp_path / "runs"
    _write(runs, "r1", range(3))
    _write(runs, "r2", range(3))

    async def scenario():
        dash = Dashboard(_cfg(runs, "r1"))
        try:
            watched, unwatched = await dash.feed("r1"), await dash.feed("r2")
            stream = dash.stream(watched)
            await stream.__anext__()  # a page has r1 open
            assert watched.listeners == 1
            assert await dash.stop_idle(idle_s=0.0) == ["r2"]
            assert unwatched.task is None and list(dash.feeds) == ["r1"]
            await stream.aclose()
            assert watched.listeners == 0
            assert await dash.stop_idle(idle_s=3600.0) == []  # left just now
            assert await dash.stop_idle(idle_s=0.0) == ["r1"]
            assert dash.feeds == {}
            # asked for again: a new feed
            again = await dash.feed("r1")
            await until(lambda: len(_trainer_points(again)) == 3, 20, "r1 read again")
        finally:
            await dash.close()

    asyncio.run(scenario())


def test_a_metrics_file_is_followed_and_read_again_when_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(feed_mod, "FILE_QUIET_S", 2.5)  # > FILE_POLL_S
    monkeypatch.setattr(feed_mod, "CHUNK_BYTES", 4096)  # many chunks
    runs = tmp_path / "runs"
    _write(runs, "r1", range(200))

    async def scenario():
        feed = Feed(_cfg(runs, "r1"), None, None)
        feed.start()
        try:
            await until(lambda: len(_trainer_points(feed)) == 200, 20, "200 steps")
            payload = json.loads(feed.payload())
            assert payload["kind"] == "file" and payload["live"] is True
            # a finished run's file stops growing: no longer live
            await until(lambda: not feed.live, 20, "not growing")
            assert "not growing" in feed.source
            _write(runs, "r1", range(200, 210))
            await until(lambda: len(_trainer_points(feed)) == 210, 20, "appended steps")
            assert feed.live
            # the file is written anew (shorter): read again from its start, a fresh view
            _write(runs, "r1", range(5), mode="w")
            await until(lambda: len(_trainer_points(feed)) == 5, 20, "the new file")
            assert [x for x, _ in _trainer_points(feed)] == [0, 1, 2, 3, 4]
            assert feed.undecodable == 0
        finally:
            await feed.stop()

    asyncio.run(scenario())


def test_a_failed_feed_says_so_and_starts_over(tmp_path, monkeypatch):
    """A run folder whose config.yaml is no YAML: finding the broker fails; the page says
    'failed: ...', not live; fixed, the feed starts over by itself."""
    monkeypatch.setattr(feed_mod, "FAILED_PAUSE_S", 0.3)
    runs = tmp_path / "runs"
    _write(runs, "r1", range(3))
    config = runs / "r1" / "config.yaml"
    config.write_text("kafka: [not closed\n")

    async def scenario():
        feed = Feed(_cfg(runs, "r1"), None, None)
        feed.start()
        try:
            await until(lambda: feed.source.startswith("failed: "), 20, "failed")
            assert not feed.live
            config.write_text("run: {}\n")
            await until(lambda: len(_trainer_points(feed)) == 3, 20, "read after the retry")
            assert feed.kind == "file"
        finally:
            await feed.stop()

    asyncio.run(scenario())


def test_an_unknown_run_says_so(tmp_path):
    async def scenario():
        feed = Feed(_cfg(tmp_path / "runs", "nothing-here"), None, None)
        feed.start()
        try:
            await until(lambda: feed.source.startswith("unknown run: "), 20, "unknown run")
            assert "no topics on the broker and no run folder" in feed.source
            assert not feed.live
        finally:
            await feed.stop()

    asyncio.run(scenario())


def test_unknown_run_ids_cost_one_listing_per_relook_window(tmp_path, monkeypatch):
    """Requests for ids that are no run (a page looping over random ones) share the list
    of runs: at most one fresh listing per RELOOK_S, whatever their number (at 41ac149
    each one cleared the list and looked up the broker twice, under the lock that opens
    feeds)."""
    from streamrft.app.watch import run_events

    runs = tmp_path / "runs"
    _write(runs, "r1", range(2))
    listings = []

    def slow_find_broker(*_args):
        listings.append(time.monotonic())
        time.sleep(0.2)  # a broker that answers slowly
        return None

    monkeypatch.setattr(run_events, "find_broker", slow_find_broker)

    async def scenario():
        dash = Dashboard(_cfg(runs, "r1"))
        try:
            asked = [dash.feed(f"no-such-run-{i}") for i in range(40)]
            answers = await asyncio.gather(*asked, return_exceptions=True)
            assert all(isinstance(a, LookupError) for a in answers), answers
            assert 1 <= len(listings) <= 2, len(listings)
            assert (await dash.feed("r1")) is dash.feeds["r1"]  # a real run still opens
        finally:
            await dash.close()

    asyncio.run(scenario())


def test_a_dashboard_others_can_reach_needs_allow_remote(tmp_path):
    from streamrft.app.watch.dashboard.server import main
    from streamrft.schemas.errors import StreamRFTError

    with pytest.raises(StreamRFTError, match=r"0\.0\.0\.0 is reachable .* --allow-remote"):
        main(_cfg(tmp_path, "r1"), "0.0.0.0", 0)


def test_run_ids_are_matched_whole():
    assert RUN_ID.fullmatch("run-1_a")
    assert not RUN_ID.fullmatch("run-1\n")
    assert not RUN_ID.fullmatch("a.b")


def test_overrides_without_a_config_are_an_error(capsys):
    from streamrft.app.cli import main

    # (an address nothing can listen on: were -o ignored, serving would fail, not hang)
    argv = ["dashboard", "--host", "256.0.0.1", "--port", "0", "-o", "monitor.dashboard_port=1"]
    assert main(argv) == 2
    assert "-o/--override needs a CONFIG to apply to" in capsys.readouterr().err


def test_a_file_line_longer_than_any_event_is_skipped_as_it_is_read():
    """A ``metrics.jsonl`` without newlines (or with one huge line) is never held whole: the
    line is dropped once past the limit, up to its newline, and the lines after it come."""
    from streamrft.app.watch.dashboard.feed import MAX_LINE_BYTES, LineSplitter

    split = LineSplitter()
    assert split.lines(b'{"a": 1}\n{"b"') == [b'{"a": 1}']
    assert split.lines(b": 2}\n") == [b'{"b": 2}']
    chunk = b"x" * (MAX_LINE_BYTES // 3)
    held = []
    for _ in range(10):  # a line of over 3 limits, in pieces
        assert split.lines(chunk) == []
        held.append(len(split.partial))
    assert max(held) <= MAX_LINE_BYTES and split.skipped == 1
    assert split.lines(b'still the long line\n{"c": 3}\n') == [b'{"c": 3}']
    assert split.partial == b"" and not split.skipping
