"""A run's ``samples.jsonl``: the newest samples of each explorer, bounded, written whole;
a resumed run starts from it; the dashboard of a finished run (no broker: its
``metrics.jsonl``) shows its samples from it, and again when it is rewritten."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from streamrft.app.watch.dashboard.feed import Feed
from streamrft.app.watch.dashboard.view import LATEST_SAMPLES, RunView
from streamrft.app.watch.metrics_log import MetricsLog, metrics_path
from streamrft.app.watch.samples_log import SamplesLog, read_samples, samples_path
from streamrft.infra.config import Config, with_run_id
from streamrft.schemas.events import MetricsEvent
from streamrft.schemas.samples import Sample, SamplePart

pytestmark = pytest.mark.unit


def sample(explorer: str, step: int, reward: float = 0.5) -> Sample:
    return Sample(
        experience_id=f"{explorer}-g{step}#0",
        task_id=f"add-{step}",
        explorer=explorer,
        explorer_step=step,
        workflow="math",
        model_version=step,
        reward=reward,
        parts=[SamplePart(role="prompt", text=f"{step}+1="), SamplePart(role="policy", text="x")],
        created_at=1000.0 + step + (0.5 if explorer.endswith("1") else 0.0),
    )


def finished_run(runs, run_id: str) -> Config:
    """The config of run ``run_id`` under ``runs``, whose folder holds a finished run's
    ``metrics.jsonl`` (five trainer steps) and no broker holds."""
    log = MetricsLog(metrics_path(runs / run_id))
    for step in range(5):
        values = {"train/reward_mean": step / 10}
        ev = MetricsEvent(run=run_id, component="trainer", step=step, version=step, values=values)
        log.append(ev)
    log.close()
    cfg = Config()
    run = msgspec.structs.replace(cfg.run, dir=str(runs))
    return with_run_id(msgspec.structs.replace(cfg, run=run), run_id)


async def until(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.05)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_newest_of_each_explorer_are_kept_and_written_whole(tmp_path):
    path = samples_path(tmp_path)
    clock = Clock()
    log = SamplesLog(path, keep=5, every_s=2.0, clock=clock)
    for step in range(12):
        log.write(sample("explorer-0", step))
        log.write(sample("explorer-1", step))
    log.write(sample("explorer-0", 11))  # published twice: kept once
    log.flush()
    kept = read_samples(path)
    assert [(s.explorer, s.explorer_step) for s in kept] == [
        (e, step) for step in range(7, 12) for e in ("explorer-0", "explorer-1")
    ]
    # within WRITE_EVERY_S of the last write: kept in memory, the file as it was
    log.write(sample("explorer-0", 12))
    clock.now = 1.0
    log.flush()
    assert len(read_samples(path)) == 10 and read_samples(path)[-1].explorer_step == 11
    clock.now = 2.5
    log.flush()
    assert read_samples(path)[-1].explorer_step == 12
    log.write(sample("explorer-1", 13))
    log.close()  # whatever the clock
    assert [s.explorer_step for s in read_samples(path)][-2:] == [12, 13]
    assert not list(tmp_path.glob(".samples.jsonl.*"))  # no staging file left


def test_a_resumed_run_starts_from_the_file_and_bad_lines_are_skipped(tmp_path, caplog):
    path = samples_path(tmp_path)
    first = SamplesLog(path, keep=3)
    for step in range(3):
        first.write(sample("explorer-0", step))
    first.close()
    with path.open("a") as fh:
        fh.write('{"not": "a sample"}\n')
    resumed = SamplesLog(path, keep=3)
    assert "line 4: not a sample" in caplog.text
    resumed.write(sample("explorer-0", 1))  # read back from the file: not twice
    resumed.write(sample("explorer-0", 3))
    resumed.close()
    assert [s.explorer_step for s in read_samples(path)] == [1, 2, 3]
    assert read_samples(tmp_path / "none.jsonl") == []


def test_the_view_takes_a_files_samples_in_place_of_its_own():
    view = RunView(run="r1")
    for step in range(3):
        view.apply("samples", sample("explorer-0", step))
    view.samples_from_file([sample("explorer-1", s) for s in range(LATEST_SAMPLES + 4)])
    shown = view.snapshot()["samples"]
    assert {s["explorer"] for s in shown} == {"explorer-1"}
    assert [s["step"] for s in shown] == list(range(LATEST_SAMPLES + 3, 3, -1))
    assert view.events["samples"] == LATEST_SAMPLES + 4


def test_a_finished_runs_dashboard_shows_its_samples_from_the_run_folder(tmp_path):
    runs = tmp_path / "runs"
    cfg = finished_run(runs, "r1")
    log = SamplesLog(samples_path(runs / "r1"))
    for step in range(4):
        log.write(sample("explorer-0", step, reward=step / 4))
    log.close()

    def shown(feed: Feed) -> list[dict]:
        return json.loads(feed.payload())["view"]["samples"]

    async def scenario():
        feed = Feed(cfg, None, None)
        feed.start()
        try:
            await until(lambda: len(shown(feed)) == 4, "the file's 4 samples")
            payload = json.loads(feed.payload())
            assert payload["kind"] == "file" and "samples" in payload["source"]
            first = shown(feed)[0]  # newest first
            assert (first["explorer"], first["step"], first["reward"]) == ("explorer-0", 3, 0.75)
            assert [p["text"] for p in first["parts"]] == ["3+1=", "x"]
            time.sleep(0.01)  # a rewritten file has a newer mtime
            log.write(sample("explorer-1", 9))
            log.close()
            await until(lambda: len(shown(feed)) == 5, "the rewritten file")
            assert shown(feed)[0]["explorer"] == "explorer-1"
        finally:
            await feed.stop()

    asyncio.run(scenario())
