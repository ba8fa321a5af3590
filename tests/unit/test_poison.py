"""The trainer's guards against groups it cannot train: the intake limits, which step
failures count as the batch's, and the batch-in-flight record that survives a kill."""

from __future__ import annotations

import json

import pytest

from streamrft.consumers.poison import GroupLimits, InFlight, step_failure
from streamrft.schemas import SchemaError
from tests.helpers.groups import make_group

pytestmark = pytest.mark.unit


def _long(n_tokens: int):
    tokens = [[1] + [5] * (n_tokens - 2) + [2]]
    return make_group(
        "r", "long", 0, n=1, tokens=tokens, logprobs=[[-0.5] * (n_tokens - 4)],
        masks=[[1] * (n_tokens - 4)],
    )  # fmt: skip


def test_limits_refuse_too_many_rows_too_long_and_past_the_budget():
    limits = GroupLimits(max_rows=8, max_tokens=64, micro_budget=50)
    limits.check(make_group("r", "ok", 0, n=8))
    limits.check(_long(50))  # exactly the budget: fits
    with pytest.raises(
        SchemaError, match=r"9 experiences, more than trainer\.max_group_rows \(8\)"
    ):
        limits.check(make_group("r", "rows", 0, n=9))
    with pytest.raises(SchemaError, match=r"51 tokens, more than one micro-batch holds"):
        limits.check(_long(51))
    with pytest.raises(SchemaError, match=r"65 tokens, longer than the model's context \(64"):
        limits.check(_long(65))
    GroupLimits(max_rows=0).check(make_group("r", "any", 0, n=300))  # 0: no bound


def test_what_counts_as_the_batchs_failure():
    assert step_failure(RuntimeError("CUDA out of memory"))
    assert step_failure(MemoryError())
    assert step_failure(IndexError("index out of range in self"))
    assert not step_failure(KeyboardInterrupt())
    assert not step_failure(OSError("disk"))


def test_a_batch_that_killed_two_trainers_is_set_aside_by_the_third(tmp_path):
    path = tmp_path / "trainer" / "inflight.json"
    ids = ["g1", "g2"]

    first = InFlight(path, max_crashes=2)
    assert first.recover() == set() and first.crashes == 0
    first.begin(ids)  # ... and the process is killed here
    second = InFlight(path, max_crashes=2)
    assert second.recover() == set() and second.crashes == 1  # tried once more
    second.begin(["older"])  # a batch before it, trained again after the restart
    second.done()
    second.begin(ids)  # killed again on the same batch
    assert json.loads(path.read_text()) == {"groups": ids, "attempts": 2}
    third = InFlight(path, max_crashes=2)
    assert third.recover() == {"g1", "g2"} and third.crashes == 2
    assert not path.exists()  # the record is consumed: the ids are in memory


def test_a_finished_step_or_another_batch_starts_the_count_again(tmp_path):
    path = tmp_path / "inflight.json"
    record = InFlight(path, max_crashes=2)
    record.begin(["a"])
    record.done()
    assert not path.exists() and InFlight(path, 2).recover() == set()
    record.begin(["a"])  # killed
    again = InFlight(path, 2)
    again.recover()
    again.begin(["a"])
    again.done()  # it trained this time: no longer suspect
    again.begin(["a"])
    assert json.loads(path.read_text())["attempts"] == 1
    path.write_text("{not json")
    assert InFlight(path, 2).recover() == set()  # unreadable: ignored, with a warning
    assert InFlight(path, 0).recover() == set()  # 0: never set aside


# -- a step that fails in the process ------------------------------------------------------------
def _engine():
    from streamrft.consumers.train_engine import TorchTrainEngine
    from tests.helpers.learning import learning_config

    engine = TorchTrainEngine(learning_config({"type": "grpo"}, trainer={"ppo_epochs": 1}))
    engine.prepare()
    return engine


def _groups():
    return [make_group("run", f"t{i}", 0, 4, rewards=[0, 1, 0, 1]) for i in range(3)]


@pytest.mark.numeric
def test_the_row_by_row_retry_makes_the_same_update_and_restores_the_budget():
    import torch

    whole, rows = _engine(), _engine()
    budget = rows.tcfg
    for p in rows.model.parameters():  # what a failed pass leaves behind
        p.grad = torch.full_like(p, 7.0)
    whole.train_step(_groups(), 0)
    metrics = rows.retry_row_by_row(_groups(), 0)
    assert metrics["train/micro_batches"] == 12  # one row each
    assert rows.tcfg is budget
    for (name, a), b in zip(whole.model.named_parameters(), rows.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=3e-5), name  # test_precision's PARAM_ABS


class _Letters:
    def __init__(self) -> None:
        self.records = []

    async def dead_letter(self, record) -> None:
        self.records.append(record)


def _trainer(engine, fail_unless_row_by_row: bool, fail_always: bool = False):
    """A trainer's step path around a real engine whose passes fail as an OOM would."""
    import asyncio

    import torch

    from streamrft.consumers.buffer import ExperienceBuffer
    from streamrft.consumers.trainer import Trainer
    from streamrft.infra.bus import Counters

    real = engine.train_step

    def step(groups, version):
        if fail_always or (fail_unless_row_by_row and engine.tcfg.micro_batch_size != 1):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(groups, version)

    engine.train_step = step
    trainer = object.__new__(Trainer)
    trainer.engine, trainer.counters, trainer.events = engine, Counters(), _Letters()
    trainer.buffer = ExperienceBuffer(max_staleness=8)
    for i, g in enumerate(_groups()):
        trainer.buffer.offer(g, ("run.experiences", 0), i)
    trainer.buffer.take(3, force=True)
    trainer.publisher, trainer._failed_in_a_row = None, 0
    return trainer, asyncio.run


def test_an_out_of_memory_step_is_retried_row_by_row():
    engine = _engine()
    trainer, run = _trainer(engine, fail_unless_row_by_row=True)
    values = run(trainer._step(_groups()))
    assert values is not None and values["train/micro_batches"] == 12
    assert trainer.counters["steps_retried"] == 1 and not trainer.events.records


def test_a_step_that_fails_again_sets_its_groups_aside_with_the_reason():
    engine = _engine()
    trainer, run = _trainer(engine, fail_unless_row_by_row=False, fail_always=True)
    assert run(trainer._step(_groups())) is None
    letters = trainer.events.records
    assert [(r.partition, r.offset) for r in letters] == [(0, 0), (0, 1), (0, 2)]
    assert all("the training step failed on its batch" in str(r.error) for r in letters)
    assert all("out of memory" in str(r.error) for r in letters)
    assert trainer.counters["groups_set_aside"] == 3
    run(trainer._step(_groups()))
    with pytest.raises(RuntimeError, match="injected"):  # a third in a row: the trainer's fault
        run(trainer._step(_groups()))


# -- the explorer's side -------------------------------------------------------------------------
def test_groups_too_large_for_a_record_are_found_before_they_are_sent():
    from streamrft.infra.produce import fitting_records

    small = make_group("r", "small", 0, n=2)
    n = 300_000  # 1.2 MB of token ids alone
    big = make_group(
        "r", "big", 0, n=1, tokens=[[1] * n], logprobs=[[-0.5] * (n - 4)], masks=[[1] * (n - 4)]
    )
    records, found = fitting_records("t", [small, big], 1 << 20)
    assert list(found) == [big.id] and found[big.id] > 1 << 20
    assert [r.key for r in records] == [small.task_id.encode()]
    records, found = fitting_records("t", [small, big], 16 << 20)
    assert found == {} and len(records) == 2


def test_the_broker_limit_cannot_exceed_what_a_trainer_decodes():
    from streamrft.infra.config import from_dict
    from streamrft.schemas import ConfigError
    from tests.helpers.configs import cfg_of

    assert from_dict(cfg_of(kafka={"max_request_bytes": 16 << 20})).kafka.max_request_bytes
    with pytest.raises(ConfigError, match="max_request_bytes"):
        from_dict(cfg_of(kafka={"max_request_bytes": 64 << 20}))


def test_a_task_whose_prompt_fills_the_context_is_given_up_before_the_engine():
    from streamrft.infra.config import ModelConfig
    from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
    from streamrft.infra.prompts import PromptRenderer
    from streamrft.producers.explorer import Explorer
    from streamrft.schemas import Task

    tok = build_char_tokenizer()
    explorer = object.__new__(Explorer)
    explorer.engine = type("E", (), {"model": build_tiny_model(ModelConfig(max_positions=16), tok)})
    explorer.prompts = PromptRenderer(tok)
    short, long = Task(id="s", prompt="1+2="), Task(id="l", prompt="1+2=" * 10)
    fit, given_up = explorer._fit_context([short, long])
    assert fit == [short]
    assert [(t.id, reason) for t, reason in given_up] == [
        ("l", "its prompt is 41 tokens, the model's context 16: no room")
    ]


def test_a_step_still_running_long_after_the_shutdown_is_stopped(monkeypatch):
    import asyncio
    import types

    from streamrft.producers import explorer as explorer_module
    from streamrft.producers.explorer import Explorer

    monkeypatch.setattr(explorer_module, "SHUTDOWN_GRACE_S", 0.05)

    async def main():
        ex = object.__new__(Explorer)
        ex.name, ex.stop = "explorer-0", asyncio.Event()
        ex.view = types.SimpleNamespace(shutdown=asyncio.Event())
        watch = asyncio.create_task(ex._stop_after_shutdown())
        await asyncio.sleep(0.1)
        assert not ex.stop.is_set()  # no Shutdown yet: the step goes on
        ex.view.shutdown.set()
        await asyncio.sleep(0.02)
        assert not ex.stop.is_set()  # within the grace
        await asyncio.wait_for(watch, 1)
        return ex.stop.is_set()

    assert asyncio.run(main())
