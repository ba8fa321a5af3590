"""The feeder on the real broker: several task sets mixed by weight land on the tasks
topic in the stated proportions, each read its own way; prompts over
``taskset.max_prompt_tokens`` are left out and counted."""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict

import pytest

from streamrft.infra import admin
from streamrft.infra.consume import read_topic
from streamrft.producers.feeder import Feeder, progress_path
from streamrft.schemas.codec import TASK
from tests.helpers.paths import ADDITION

pytestmark = pytest.mark.integration


def _published(cfg) -> list:
    records = asyncio.run(read_topic(cfg.kafka, cfg.topics().tasks, TASK, "mix-test"))
    return [r.obj for r in records]


def _feed(feeder: Feeder) -> int:
    async def go():
        await admin.ensure_topics(feeder.cfg.kafka, feeder.cfg.topics())
        return await feeder.run()

    return asyncio.run(go())


def _gsm8k_rows(tmp_path):
    """10 GSM8K-shaped rows in Parquet: ``uid``, ``question``, a rationale ending ``#### N``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "uid": f"g{i}",
            "question": f"{i} plus {i}",
            "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
        }
        for i in range(10)
    ]
    path = tmp_path / "word.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_sources_are_mixed_by_weight_each_read_its_own_way(make_config, tmp_path):
    arith = tmp_path / "arith.jsonl"
    arith.write_text("".join(ADDITION.read_text().splitlines(keepends=True)[:30]))
    sources = [
        {"path": str(arith), "weight": 1.0},
        {
            "path": str(_gsm8k_rows(tmp_path)),
            "weight": 3.0,
            "name": "gsm",
            "id_key": "uid",
            "prompt_template": "What is {question}?",
            "answer_extract": "gsm8k",
        },
    ]
    epochs, per_epoch, batch = 3, 40, 8
    cfg = make_config(
        taskset={"path": "", "sources": sources, "epoch_tasks": per_epoch, "total_epochs": epochs},
        trainer={"batch_size": batch},
        kafka={"partitions": 2},
    )
    assert _feed(Feeder(cfg)) == epochs * per_epoch
    tasks = _published(cfg)
    assert len(tasks) == epochs * per_epoch
    assert len({(t.id, t.epoch) for t in tasks}) == len(tasks)  # the trainer keeps them all
    by_epoch = defaultdict(list)
    for t in tasks:
        by_epoch[t.epoch].append(t)
    arith_lines = [json.loads(line) for line in arith.read_text().splitlines()]
    arith_seen = []
    for epoch in range(epochs):
        got = by_epoch[epoch]
        gsm = [t for t in got if t.id.startswith("gsm/")]
        ari = [t for t in got if t.id.startswith("arith/")]
        assert (len(ari), len(gsm)) == (10, 30)  # weights 1 : 3 of 40
        # 10 rows taken 3 times: ids g<i>, g<i>#1, g<i>#2, each with its template and answer
        base = Counter(t.id.split("#")[0] for t in gsm)
        assert base == Counter({f"gsm/g{i}": 3 for i in range(10)})
        for t in gsm:
            i = int(t.id.split("#")[0].removeprefix("gsm/g"))
            assert (t.prompt, t.answer) == (f"What is {i} plus {i}?", str(2 * i))
        arith_seen += [t.id for t in ari]
        assert sorted(t.batch for t in got) == sorted(
            (epoch * per_epoch + k) // batch for k in range(per_epoch)
        )
    # 30 arithmetic tasks at 10 an epoch: every one exactly once over the 3 epochs
    assert sorted(arith_seen) == sorted(f"arith/{line['id']}" for line in arith_lines)
    assert json.loads(progress_path(cfg).read_text()) == {
        "epoch": 3,
        "sent": 0,
        "tasks": 40,
        "rows": [30, 10],
    }


def test_prompts_over_the_token_limit_are_left_out_and_counted(make_config, tmp_path):
    rows = [{"id": f"p{n}", "prompt": "1" * n + "=", "answer": "1"} for n in range(1, 13)]
    path = tmp_path / "lengths.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(taskset={"path": str(path), "max_prompt_tokens": 8})
    feeder = Feeder(cfg)
    # the tiny model's tokenizer: one token a character, after its BOS
    fitting = {r["id"] for r in rows if len(r["prompt"]) + 1 <= 8}
    assert len(fitting) == 6
    assert feeder.book.too_long == 6 and feeder.epoch_size == 6
    assert "6 tasks left out with prompts over 8 tokens" in feeder.describe()
    assert _feed(feeder) == 6
    assert {t.id for t in _published(cfg)} == fitting
    assert feeder.counters.snapshot()["prompts_too_long"] == 6


def test_a_taskset_of_a_whole_number_of_screening_batches_is_screened(make_config, tmp_path):
    from streamrft.producers.task_book import SCREEN_BATCH

    rows = [{"id": f"q{i}", "prompt": "1+1=" if i % 2 else "1+1+1+1+1=", "answer": "2"}
            for i in range(2 * SCREEN_BATCH)]  # fmt: skip
    path = tmp_path / "even.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    feeder = Feeder(make_config(taskset={"path": str(path), "max_prompt_tokens": 6}))
    assert (feeder.book.too_long, feeder.epoch_size) == (SCREEN_BATCH, SCREEN_BATCH)
    feeder.book.close()
