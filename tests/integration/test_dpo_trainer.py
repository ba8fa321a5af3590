"""A DPO trainer on the real experiences topic: preference pairs are trained, any other
group is dead-lettered with the reason, and a trainer that does not run DPO dead-letters
the pairs."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.infra import admin
from streamrft.infra.consume import read_history
from streamrft.infra.expert import preference_group
from streamrft.infra.prompts import PromptRenderer
from streamrft.schemas import DEAD_LETTER, EXPERIENCE_GROUP, Task
from tests.harness.fuzz import FuzzMessage, inject
from tests.helpers.groups import make_group

pytestmark = pytest.mark.integration


async def _nothing() -> None:
    pass


def _message(group) -> FuzzMessage:
    return FuzzMessage(EXPERIENCE_GROUP.encode(group), EXPERIENCE_GROUP.headers(), b"k")


def _run(cfg, groups, batches: int):
    """Publish ``groups``, train ``batches`` batches of 2 from the topic; the metrics of
    each step and the run's dead letters."""
    from streamrft.consumers.trainer import Trainer
    from streamrft.producers.evaluation import GreedyEvaluator

    trainer = Trainer(cfg, GreedyEvaluator(cfg))
    trainer.engine.prepare()
    topics = cfg.topics()

    async def scenario():
        await admin.ensure_topics(cfg.kafka, topics)
        await trainer.events.start()
        await trainer.intake.start({})
        steps = []
        try:
            await inject(cfg, topics.experiences, [_message(g) for g in groups])
            for _ in range(batches):
                collect = trainer.intake.collect(2, lambda: 0, trainer.stop, _nothing)
                batch = await asyncio.wait_for(collect, 60)
                assert batch is not None
                steps.append(await asyncio.to_thread(trainer.engine.train_step, batch, 0))
        finally:
            await trainer.intake.stop()
            await trainer.events.stop()
        letters = await read_history(cfg.kafka, topics.dead_letters, DEAD_LETTER, "dl-reader")
        return steps, letters

    return asyncio.run(scenario())


def _pairs(cfg, n: int):
    from streamrft.infra.modeling import build_char_tokenizer

    render = PromptRenderer(build_char_tokenizer())
    tasks = [
        Task(id=f"p{i}", prompt=f"{i}+1=", answer=str(i + 1), metadata={"rejected": str(i + 3)})
        for i in range(n)
    ]
    run = cfg.topics().run
    return [preference_group(t, render, run=run, source="app", version=0) for t in tasks]


def test_a_dpo_trainer_trains_pairs_and_dead_letters_the_rest(make_config):
    cfg = make_config(algorithm={"type": "dpo"}, trainer={"batch_size": 2, "idle_timeout_s": 30.0})
    rollouts = make_group(cfg.topics().run, "rollouts", 0)
    pairs = _pairs(cfg, 4)
    steps, letters = _run(cfg, [pairs[0], rollouts, *pairs[1:]], batches=2)
    assert [dl.error_type for dl in letters] == ["SchemaError"]
    assert "trains only groups of kind 'preference'" in letters[0].reason
    assert EXPERIENCE_GROUP.decode(letters[0].value).task_id == "rollouts"
    assert steps[0]["train/dpo_margin"] == 0.0 and steps[0]["train/groups"] == 2
    assert steps[1]["train/dpo_margin"] != 0.0  # trained: the policy left its reference


def test_a_grpo_trainer_dead_letters_pairs(make_config):
    cfg = make_config(trainer={"batch_size": 2, "idle_timeout_s": 30.0})
    run = cfg.topics().run
    groups = [make_group(run, "a", 0), *_pairs(cfg, 1), make_group(run, "b", 0)]
    steps, letters = _run(cfg, groups, batches=1)
    assert len(letters) == 1 and "trained only by algorithm.policy_loss_fn 'dpo'" in (
        letters[0].reason
    )
    assert "train/dpo_margin" not in steps[0] and steps[0]["train/groups"] == 2
