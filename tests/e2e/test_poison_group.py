"""A group that kills the trainer from outside Python (SIGKILL, as the kernel's OOM killer
does) is set aside by the trainer that starts after it was in ``trainer.max_step_crashes``
(3) crashed batches, whatever groups came with it each time: the killer ``X`` comes back
with other companions after every restart (unstamped groups go first), under the
``available`` and ``priority_replay`` strategies, and on a trainer that starts on another
host's folder each time (the poison record lives beside the checkpoints in the store).

The test is the trainer's supervisor: it starts ``streamrft train``, waits until the poison
record in the store shows ``X`` in flight for this trainer, SIGKILLs it, sends one more
companion and starts the next. The fourth trainer dead-letters ``X`` as it reads it and
trains the rest (``trainer.max_steps`` 2), never ``X``."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from streamrft.consumers.checkpoint_store import CheckpointStore
from streamrft.consumers.poison import RECORD
from streamrft.infra import admin
from streamrft.infra.config import load_config, with_run_id
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import DEAD_LETTER, EXPERIENCE_GROUP
from tests.harness.fuzz import FuzzMessage, inject
from tests.helpers.cli import overrides, service_overrides, start_logged, streamrft_cmd
from tests.helpers.groups import make_group
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import wait_for
from tests.helpers.topics import groups_and_trainer_metrics

pytestmark = pytest.mark.e2e

CRASHES = 3
SETTINGS = (
    "kafka.partitions=1",  # one arrival order: the batches each trainer makes are known
    "trainer.batch_size=2",
    f"trainer.max_step_crashes={CRASHES}",
    "trainer.max_steps=2",
    "trainer.save_interval=1",
    "trainer.max_staleness=100",
    "trainer.batch_wait_s=3",
    "trainer.warmup_sft_steps=0",
    "trainer.micro_batch_size=1",  # a row at a time: the killer's step lasts seconds
    "eval.in_trainer=false",
    "synchronizer.method=filesystem",  # the store holds the checkpoints and the record
)
WIDTH = 30
"""Tokens of each of the killer's experiences (the default model has 32 positions)."""


def _killer(run_id: str):
    """256 rows (``trainer.max_group_rows``) of 30 tokens, batch 0: a long step."""
    tokens = [[1, 5, 6, 7] + [5 + (i + j) % 10 for j in range(WIDTH - 5)] + [2] for i in range(256)]
    response = WIDTH - 4
    return make_group(
        run_id, "killer", 0, n=256, tokens=tokens, logprobs=[[-0.5] * response] * 256,
        masks=[[1] * response] * 256, batch=0,
    )  # fmt: skip


def _send(cfg, groups) -> None:
    msgs = [FuzzMessage(EXPERIENCE_GROUP.encode(g), EXPERIENCE_GROUP.headers()) for g in groups]
    asyncio.run(inject(cfg, cfg.topics().experiences, msgs))


def _record(store: CheckpointStore) -> dict:
    """The store's poison record. Read while the trainer replaces it, it may not decode:
    the embedded S3 server (the JuiceFS gateway) can answer a GET during a PUT of the same
    key with part of the new object (968 of 9,009 reads during back-to-back overwrites);
    S3 and MinIO replace an object whole. Trainers read it only while none writes it."""
    data = store.read_record(RECORD)
    return json.loads(data) if data is not None else {"seq": -1, "batch": []}


@pytest.mark.parametrize(
    ("strategy", "moved"),
    [("available", False), ("priority_replay", False), ("available", True)],
    ids=["available", "priority_replay", "available-moved-hosts"],
)
def test_a_group_that_kills_the_trainer_is_set_aside_after_three_crashes(
    strategy, moved, services, tmp_path
):
    run_id = f"poison-{strategy[:5]}-{tmp_path.name[-8:]}"
    settings = (*SETTINGS, f"algorithm.sample_strategy={strategy}")
    cfg = with_run_id(
        load_config(
            EXAMPLE,
            [*settings, f"run.dir={tmp_path / 'runs'}", *service_overrides(services)[1::2]],
        ),
        run_id,
    )
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    store = CheckpointStore(cfg)
    killer = _killer(run_id)
    _send(cfg, [killer, make_group(run_id, "c1", 0, batch=0)])

    def trainer(n: int):
        runs = tmp_path / (f"host-{n}" if moved else "host") / "runs"
        argv = streamrft_cmd(
            "train",
            str(EXAMPLE),
            "--run-id",
            run_id,
            *overrides(*settings, f"run.dir={runs}"),
            *service_overrides(services),
        )
        return start_logged(argv, tmp_path / f"trainer-{n}.log", tmp_path)

    seen = -1  # the record's writes so far: a later one is the next trainer's
    for n in range(1, CRASHES + 1):
        proc = trainer(n)
        try:

            def killer_in_flight(after: int = seen) -> bool:
                try:
                    record = _record(store)
                except ValueError:  # read while the trainer replaced it: read it again
                    return False
                return record["seq"] > after and killer.id in record["batch"]

            wait_for(killer_in_flight, proc, 240, f"trainer {n} training the killer")
            os.kill(proc.pid, signal.SIGKILL)  # what the kernel's OOM killer does
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
        seen = _record(store)["seq"]
        # one more companion, ahead of the killer's batch in the next trainer's order
        _send(cfg, [make_group(run_id, f"u{n}", 0)])

    last = trainer(CRASHES + 1)
    try:
        assert last.wait(timeout=240) == 0, (tmp_path / "trainer-4.log").read_text()[-3000:]
    finally:
        if last.poll() is None:
            last.kill()

    _, metrics = groups_and_trainer_metrics(cfg)
    trained = {row.group_id for m in metrics for row in m.trained}
    expected = {make_group(run_id, t, 0).id for t in ("c1", "u1", "u2", "u3")}
    assert trained == expected  # every companion trained; the killer never
    letters = asyncio.run(
        read_history(cfg.kafka, cfg.topics().dead_letters, DEAD_LETTER, "t-poison-dl", 3)
    )
    aside = [EXPERIENCE_GROUP.decode(d.value).id for d in letters if d.value is not None]
    assert aside == [killer.id], [d.reason for d in letters]
    assert f"trainers died training {CRASHES} batches that held it" in letters[0].reason
    assert f"were in {CRASHES} or more batches" in (tmp_path / "trainer-4.log").read_text()
    assert _record(store)["crashes"] == {killer.id: CRASHES}  # the rest cleared as trained
