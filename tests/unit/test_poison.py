"""The trainer's guards against groups it cannot train: the intake limits, which step
failures count as the batch's, and the poison record (crashes per group) that survives a
kill and goes with the trainer to another host."""

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


def _killed(path, max_crashes: int, batch: list[str], shared=None) -> set[str]:
    """A trainer starts (what it sets aside), then dies training ``batch``; with
    ``shared``, each record is copied there as the trainer copies it to the store (and
    waited for: the store keeps up)."""
    import asyncio

    from streamrft.consumers.shared_copy import SharedCopy

    async def go() -> set[str]:
        record = InFlight(path, max_crashes, shared)
        copy = SharedCopy(shared, "poison_record") if shared else None
        poisoned = record.recover()
        for written in (record.last, record.begin(batch)):  # ... killed after the 2nd
            if copy is not None and written is not None:
                copy.submit(*written)
                assert await copy.stored(written.seq)
        if copy is not None:
            copy.close()
        return poisoned

    return asyncio.run(go())


def test_a_group_in_n_crashed_batches_is_set_aside_whatever_its_companions(tmp_path):
    path = tmp_path / "checkpoints" / "poison.json"
    # the killer X comes back with other groups after each restart (the available
    # strategy, replays, serve traffic): the crashes are counted per group
    assert _killed(path, 3, ["X", "a1", "a2"]) == set()
    assert _killed(path, 3, ["a3", "X", "a4"]) == set()
    assert _killed(path, 3, ["X", "a1"]) == set()
    fourth = InFlight(path, 3)
    assert fourth.recover() == {"X"}  # only X: no companion was in 3 crashed batches
    assert fourth.crashes == {"X": 3, "a1": 2, "a2": 1, "a3": 1, "a4": 1}
    saved = json.loads(path.read_text())
    assert saved["batch"] == [] and saved["crashes"] == fourth.crashes  # counted once only
    assert InFlight(path, 3).recover() == {"X"}  # a fifth trainer: still set aside


def test_groups_trained_since_a_crash_are_cleared(tmp_path):
    path = tmp_path / "poison.json"
    _killed(path, 2, ["X", "a"])
    record = InFlight(path, 2)
    record.recover()
    record.begin(["a", "b"])
    record.done(["a", "b"])  # trained this time: its count is gone
    assert record.crashes == {"X": 1}
    _killed(path, 2, ["X", "a"])  # a second crash with X: a's first
    assert InFlight(path, 2).recover() == {"X"}


def test_a_finished_step_counts_nothing_and_a_bad_record_is_ignored(tmp_path):
    path = tmp_path / "poison.json"
    record = InFlight(path, max_crashes=1)
    assert record.recover() == set() and not path.exists()  # a new run: no record
    record.begin(["a"])
    assert json.loads(path.read_text())["batch"] == ["a"]
    record.done(["a"])
    assert InFlight(path, 1).recover() == set()
    path.write_text("{not json")
    assert InFlight(path, 1).recover() == set()  # unreadable: ignored, with a warning
    _killed(path, 0, ["b"])
    assert InFlight(path, 0).recover() == set()  # 0: never set aside


def test_the_shared_copy_goes_with_the_trainer_to_another_host(tmp_path):
    from streamrft.consumers.poison import LocalRecord

    shared = LocalRecord(tmp_path / "shared" / "poison.json")  # what the store holds
    host_a, host_b = tmp_path / "a" / "poison.json", tmp_path / "b" / "poison.json"
    _killed(host_a, 2, ["X", "a"], shared)
    assert _killed(host_b, 2, ["X", "b"], shared) == set()  # B reads A's count
    assert InFlight(host_b, 2, shared).recover() == {"X"}
    # back on host A: its own copy is older than the shared one, which wins
    assert InFlight(host_a, 2, shared).recover() == {"X"}


def test_a_shared_copy_that_cannot_be_written_does_not_stop_training(tmp_path, caplog):
    """Each write to a place that refuses it fails (counted, said once); the first wait
    for one is in vain, the next ones do not wait; this host's copy has every record."""
    import asyncio

    from streamrft.consumers.poison import LocalRecord
    from streamrft.consumers.shared_copy import SharedCopy
    from streamrft.infra.bus import Counters

    (tmp_path / "file").write_text("")
    broken = LocalRecord(tmp_path / "file" / "poison.json")  # under a file: OSError
    record = InFlight(tmp_path / "poison.json", 2, broken)
    counters = Counters()

    async def steps() -> list[bool]:
        copy = SharedCopy(broken, "poison_record", counters)
        stored = []
        for ids in (["a"], ["b"]):
            written = record.begin(ids)
            copy.submit(*written)
            stored.append(await copy.stored(written.seq))
            copy.submit(*record.done(ids))
        assert copy.slow and not await copy.drain(1.0)
        return stored

    with caplog.at_level("WARNING"):
        assert asyncio.run(steps()) == [False, False]
    assert caplog.text.count("is not written to") == 1  # said once, not at every write
    assert counters["poison_record_late"] == 2
    assert counters["poison_record_store_failures"] >= 1
    assert json.loads((tmp_path / "poison.json").read_text()) == {
        "seq": 4, "step": 0, "checkpoint": 0, "batch": [], "crashes": {}
    }  # fmt: skip


def test_a_copy_from_before_the_checkpoint_resumed_from_never_wins(tmp_path, caplog):
    """Host A trained on while the store was down (its record on its own disk only; it set
    batches aside too), then died training [X, a] at step 5. The run went on on host B
    from the store's checkpoint of step 1 (the last one uploaded): B trained X and a, and
    more, up to a checkpoint at step 7. A trainer back on host A resumes from that
    checkpoint: A's record counts more writes than the store's, yet it was written before
    that checkpoint, so it is ignored: X and a, trained on B since, count no crash."""
    from streamrft.consumers.poison import LocalRecord

    store = LocalRecord(tmp_path / "store" / "poison.json")  # what the store holds
    on_a, on_b = tmp_path / "a" / "poison.json", tmp_path / "b" / "poison.json"
    a = InFlight(on_a, 2, store)
    assert a.recover(0) == set()
    for written in (a.begin(["g0"], 0), a.done(["g0"], 1)):  # the store takes them
        store.write(written.data)
    for step in range(1, 5):  # the store is down: on A's disk only
        a.begin([f"g{step}"], step)
        a.done([f"g{step}"], step + 1)
        a.begin([f"bad{step}"], step + 1)
        a.done([f"bad{step}"], step + 1)  # set aside: no step
    a.begin(["X", "a"], 5)  # ... killed
    b = InFlight(on_b, 2, store)
    assert b.recover(1) == set() and b.crashes == {}  # the store's copy: nothing in flight
    for step, ids in enumerate((["X", "a"], ["h1"], ["h2"], ["h3"], ["h4"], ["h5"]), start=1):
        for written in (b.begin(ids, step), b.done(ids, step + 1)):
            store.write(written.data)
    on_disk, stored = json.loads(on_a.read_text()), json.loads(store.path.read_text())
    assert on_disk["seq"] > stored["seq"] and on_disk["batch"] == ["X", "a"]  # more writes
    back = InFlight(on_a, 2, store)
    with caplog.at_level("WARNING"):
        assert back.recover(7) == set()
    assert back.crashes == {}
    assert f"{on_a} was written at step 5, before the checkpoint of step 7" in caplog.text
    assert "the last trainer died" not in caplog.text
    assert json.loads(on_a.read_text())["seq"] > on_disk["seq"]  # the count goes on from it
    # alone, as old as that: ignored too (the run went on from a checkpoint it cannot know)
    store.path.unlink()
    again = InFlight(tmp_path / "c" / "poison.json", 2, LocalRecord(tmp_path / "a-copy"))
    (tmp_path / "a-copy").write_text(json.dumps(on_disk))
    assert again.recover(6) == set() and again.crashes == {}


def test_a_store_copy_unreadable_at_start_is_merged_once_read_never_written_over(
    tmp_path, monkeypatch, caplog
):
    """Host A's trainers died twice training X (max 3). A trainer on host B starts while
    the store's copy cannot be read (a symlink loop stands in its place): tried, said, and
    never written over while B trains. Once it can be read, the next write merges it (X's
    count and its batch in flight; the groups B trained since are cleared), so when B dies
    training X the next trainer sets X aside: the third crash with it."""
    import asyncio
    import os

    from streamrft.consumers import poison
    from streamrft.consumers.poison import LocalRecord
    from streamrft.consumers.shared_copy import SharedCopy
    from tests.helpers.waits import until

    monkeypatch.setattr(poison, "READ_RETRY_S", 0.0)
    path = tmp_path / "store" / "poison.json"
    store = LocalRecord(path)
    on_a = tmp_path / "a" / "poison.json"
    _killed(on_a, 3, ["X", "a"], store)
    _killed(on_a, 3, ["X", "b"], store)
    held = path.read_bytes()  # X counted once, in flight again
    path.unlink()
    os.symlink(path.name, path)  # reading it fails (too many levels of symbolic links)
    b = InFlight(tmp_path / "b" / "poison.json", 3, store)

    async def go():
        copy = SharedCopy(store, "poison_record", before=b.catch_up)
        assert b.recover(0) == set() and b.shared_unread
        for ids in (["a"], ["c"]):  # trained on B
            written = b.begin(ids)
            copy.submit(*written)
            assert not await copy.stored(written.seq)
            copy.submit(*b.done(ids))
        assert path.is_symlink()  # not written over
        path.unlink()
        path.write_bytes(held)  # readable again
        killer = b.begin(["X", "d"])
        copy.submit(*killer)
        await until(lambda: copy.stored_seq >= killer.seq, 30, "the merged record stored")
        copy.close()

    with caplog.at_level("INFO"):
        asyncio.run(go())
    assert "cannot be read" in caplog.text and "not written over before" in caplog.text
    assert "read now, is newer than the one this trainer started from" in caplog.text
    merged = json.loads(path.read_text())
    assert merged["crashes"] == {"X": 2, "b": 1}  # a, trained on B since: cleared
    assert merged["batch"] == ["X", "d"] and merged["seq"] > json.loads(held)["seq"]
    assert json.loads((tmp_path / "b" / "poison.json").read_text()) == merged
    assert InFlight(tmp_path / "c" / "poison.json", 3, store).recover(0) == {"X"}


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


def _trainer(engine, fail_unless_row_by_row: bool, fail_always: bool = False):
    """A trainer's step path around a real engine whose passes fail as an OOM would."""
    import asyncio

    import torch

    from tests.helpers.step_path import step_path

    real = engine.train_step

    def step(groups, version):
        if fail_always or (fail_unless_row_by_row and engine.tcfg.micro_batch_size != 1):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(groups, version)

    engine.train_step = step
    return step_path(engine, _groups()), asyncio.run


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
