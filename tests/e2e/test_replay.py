"""``streamrft train --from-run / --from-beginning / --from-offsets``: train from a recorded
experience stream with no explorers, as real processes on a broker that outlives the run.

A short run records its experiences on the session's broker; a replay of it into a new run
id consumes exactly the groups it recorded (deduplicated by experience id as the trainer
does), trains each step on the same groups as the run did, and ends by itself; the
train-only case (experiences an application published to a run that never trained) and
the refusals are checked the same way.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamrft.infra import admin, kafka
from streamrft.infra.config import KafkaConfig
from streamrft.infra.consume import read_history
from streamrft.infra.local.services import Endpoints
from streamrft.schemas.codec import EXPERIENCE_GROUP, METRICS
from streamrft.schemas.topics import TopicNames
from tests.helpers.cli import env, overrides, run_argv, run_ok, service_overrides, streamrft_cmd
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e

STEPS = 4
SMALL = (
    "trainer.batch_size=8",
    "explorer.batch_size=8",
    "explorer.repeat_times=4",
    "trainer.warmup_sft_steps=0",
    "eval.interval=0",
    "trainer.save_interval=0",
)
"""The example shrunk: 8 groups of 4 per step, no warm-up; the replay uses the same."""


@dataclass(frozen=True)
class Recorded:
    run_id: str
    runs: Path
    groups: list
    """The run's experiences topic, decoded, in the order read."""
    ledger: dict[int, list[str]]
    """Trainer step -> the group ids it trained."""


def _kafka(services: Endpoints) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=services.bootstrap_servers)


def _read(services: Endpoints, run_id: str, kind: str) -> list:
    topics = TopicNames("streamrft", run_id)
    codec = EXPERIENCE_GROUP if kind == "experiences" else METRICS
    return asyncio.run(read_history(_kafka(services), topics.of(kind), codec, f"t-{kind}", 3))


def _trainer_metrics(services: Endpoints, run_id: str) -> tuple[dict[int, list[str]], list]:
    events = [m for m in _read(services, run_id, "metrics") if m.component == "trainer"]
    ledger = {m.step: [row.group_id for row in m.trained] for m in events if m.trained}
    return ledger, events


def _consumed_as_the_trainer_does(groups: list) -> tuple[int, int]:
    """Groups and experiences a trainer keeps: a group none of whose experience ids was
    seen before (``ExperienceBuffer.offer``)."""
    seen: set[str] = set()
    kept = 0
    exps = 0
    for g in groups:
        ids = [e.id for e in g.experiences]
        if not seen.intersection(ids):
            kept += 1
            exps += len(ids)
        seen.update(ids)
    return kept, exps


def _train(services: Endpoints, runs: Path, run_id: str, *flags: str, timeout: float = 300):
    argv = streamrft_cmd(
        "train",
        str(EXAMPLE),
        "--run-id",
        run_id,
        *flags,
        *overrides(f"run.dir={runs}", *SMALL),
        *service_overrides(services),
    )
    return subprocess.run(
        argv, env=env(), capture_output=True, text=True, timeout=timeout, cwd=runs.parent
    )


@pytest.fixture(scope="module")
def recorded(services, tmp_path_factory) -> Recorded:
    """A finished run of STEPS steps whose topics stay on the session's broker."""
    tmp = tmp_path_factory.mktemp("replay")
    run_id = f"recorded-{os.getpid()}-{int(time.time())}"
    runs = tmp / "runs"
    run_ok(run_argv(EXAMPLE, run_id, STEPS, runs, services, *SMALL), tmp)
    ledger, _ = _trainer_metrics(services, run_id)
    assert sorted(ledger) == list(range(1, STEPS + 1))
    return Recorded(run_id, runs, _read(services, run_id, "experiences"), ledger)


def test_a_replay_of_a_finished_run_consumes_exactly_what_it_recorded(services, recorded):
    new = f"{recorded.run_id}-replay"
    proc = _train(services, recorded.runs, new, "--from-run", recorded.run_id)
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups, exps = _consumed_as_the_trainer_does(recorded.groups)
    assert groups >= STEPS * 8  # the run recorded at least what it trained
    ledger, events = _trainer_metrics(services, new)
    final = next(m.values for m in reversed(events) if "trainer/final_step" in m.values)
    # consumed: exactly the recorded groups, once each
    assert final["trainer/groups_consumed"] == groups
    assert final["trainer/experiences_consumed"] == exps
    assert final["trainer/duplicates_dropped"] == len(recorded.groups) - groups
    assert final["trainer/stale_dropped"] == 0 and final.get("trainer/dead_letters", 0) == 0
    # trained: every whole batch of 8 it consumed (the run's explorer sampled up to two
    # batches past the run's last step, with the last version published: the replay trains
    # those too), and the run's own steps on the same groups, batch by batch
    steps = int(final["trainer/final_step"])
    assert steps == groups // 8, Counter(g.batch for g in recorded.groups)
    assert sorted(ledger) == list(range(1, steps + 1))
    for step, ids in recorded.ledger.items():
        assert sorted(ledger[step]) == sorted(ids), f"step {step} trained other groups"
    assert final["trainer/groups_trained"] == steps * 8
    losses = [m.values["train/loss"] for m in events if "train/loss" in m.values]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    # it stopped on reaching the end it found (not on the idle timeout), said what it did,
    # and the run's own books are untouched by it
    assert f"replay read to its end offsets; {groups - steps * 8} groups left" in proc.stderr
    assert "no experiences for" not in proc.stderr
    assert f"replay done: read streamrft.{recorded.run_id}.experiences" in proc.stderr
    assert f"consumed {groups} groups ({exps} experiences)" in proc.stderr
    assert _trainer_metrics(services, recorded.run_id)[0] == recorded.ledger
    # the same command again resumes from the replay's checkpoint, at the end of the
    # stream: nothing more to consume or train
    again = _train(services, recorded.runs, new, "--from-run", recorded.run_id)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {recorded.runs / new / 'checkpoints'}" in again.stderr
    assert f"consumed {groups} groups ({exps} experiences); trained {steps} steps" in again.stderr
    assert sorted(_trainer_metrics(services, new)[0]) == list(range(1, steps + 1))


def test_train_only_from_the_beginning_of_a_run_that_never_trained(services, recorded, tmp_path):
    """An application published experience groups to a run of its own; the trainer trains
    them from the beginning with no explorers, and stops at their end."""
    run_id = f"{recorded.run_id}-app"
    topics = TopicNames("streamrft", run_id)
    published = [g for g in recorded.groups if g.batch in (0, 1)]

    async def publish() -> None:
        await admin.ensure_topics(_kafka(services), topics)
        producer = kafka.data_producer(_kafka(services), "t-app")
        await kafka.start_client(producer, "app producer")
        try:
            for g in published:
                await producer.send_and_wait(
                    topics.experiences,
                    EXPERIENCE_GROUP.encode_json(g),
                    key=g.task_id.encode(),
                    headers=EXPERIENCE_GROUP.json_headers(),
                )
        finally:
            await producer.stop()

    asyncio.run(publish())
    proc = _train(services, tmp_path / "runs", run_id, "--from-beginning")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ledger, events = _trainer_metrics(services, run_id)
    final = next(m.values for m in reversed(events) if "trainer/final_step" in m.values)
    assert final["trainer/groups_consumed"] == len(published) == 16
    assert sorted(ledger) == [1, 2]
    assert sorted(ledger[1]) == sorted(recorded.ledger[1])


def test_replay_refusals_are_clear_errors(services, recorded, tmp_path):
    runs = recorded.runs
    # an offsets file with a negative offset, and one naming a partition the topic lacks
    bad = tmp_path / "negative.json"
    bad.write_text(json.dumps({"0": -1, "1": 0, "2": 0, "3": 0}))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({str(p): 0 for p in range(5)}))
    cases = [
        (["--from-run", recorded.run_id, "--from-offsets", str(bad)], "offset -1 is negative"),
        (["--from-run", recorded.run_id, "--from-offsets", str(unknown)], "no partition 4"),
        # the run trained: a replay from the beginning into its own namespace is refused
        (["--from-beginning"], f"--run-id NEW --from-run {recorded.run_id}"),
        (["--from-run", recorded.run_id], "the same as --run-id"),
    ]
    for flags, message in cases:
        target = recorded.run_id if "--from-offsets" not in flags else f"{recorded.run_id}-x"
        proc = _train(services, runs, target, *flags, timeout=120)
        assert proc.returncode != 0, flags
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_replay_whose_broker_is_gone_says_what_to_do(tmp_path):
    """A run that recorded on its own embedded broker: its config.yaml names a broker that
    stopped with it."""
    runs = tmp_path / "runs"
    gone = runs / "gone-run"
    gone.mkdir(parents=True)
    gone.joinpath("config.yaml").write_text("kafka:\n  bootstrap_servers: 127.0.0.1:9\n")
    argv = streamrft_cmd(
        "train", str(EXAMPLE), "--run-id", "new-run", "--from-run", "gone-run"
    ) + overrides(f"run.dir={runs}")
    proc = subprocess.run(
        argv, env=env(), capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "127.0.0.1:9 (from run gone-run" in proc.stderr, proc.stderr[-2000:]
    assert "streamrft infra up" in proc.stderr and "Traceback" not in proc.stderr
