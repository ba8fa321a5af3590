"""A batch is applied once, whatever fails: a step that fails after one of its optimizer
updates (``ppo_epochs`` passes, mini-batches, PPO's critic) leaves the model, optimizer,
critic, learning-rate schedule and step counts as they were before it, so its row-by-row
retry trains the batch once, and a batch that cannot be trained is set aside only when no
update of it stayed applied (``consumers/step_undo.py``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrft.consumers.train_engine import TorchTrainEngine
from tests.helpers.groups import make_group
from tests.helpers.learning import learning_config
from tests.helpers.step_path import step_path

pytestmark = [pytest.mark.unit, pytest.mark.numeric]

PARAM_ABS = 3e-5
"""Row by row against the whole batch at once: float32 sums in another order (the bound
tests/unit/test_precision.py uses). Training the batch's first update twice moves the
weights by about 5e-4."""


def _engine(algorithm: str, **trainer) -> TorchTrainEngine:
    # a warm-up schedule: the learning rate depends on the steps the engine counts
    settings = {"lr_warmup_steps": 4, "max_steps": 10, **trainer}
    engine = TorchTrainEngine(learning_config({"type": algorithm}, trainer=settings))
    engine.prepare()
    return engine


def _batch(tag: str) -> list:
    return [make_group("run", f"{tag}{i}", 0, 4, rewards=[0, 1, 0, 1]) for i in range(3)]


class OutOfMemoryAt:
    """Wraps a :class:`~streamrft.consumers.precision.Precision`'s ``step`` (one optimizer
    update): the calls numbered in ``calls`` raise as a CUDA out-of-memory error does,
    before the update or, ``after``, once it is applied."""

    def __init__(self, precision, calls: set[int], after: bool = False) -> None:
        self.real, self.calls, self.after, self.n = precision.step, calls, after, 0
        precision.step = self

    def __call__(self, *args, **kwargs):
        self.n += 1
        if self.n in self.calls and not self.after:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        out = self.real(*args, **kwargs)
        if self.n in self.calls:
            raise torch.OutOfMemoryError("CUDA out of memory (injected, after the update)")
        return out


def _state(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    """Every trained tensor: parameters, AdamW moments and step counts, the critic's."""
    out = {}
    pairs = [("policy", engine.model, engine.optimizer)]
    if engine.critic is not None:
        pairs.append(("critic", engine.critic.model, engine.critic.optimizer))
    for who, model, opt in pairs:
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            out[f"{who}.{name}"] = p.detach().clone()
            for key, value in opt.state.get(p, {}).items():
                out[f"{who}.{name}.{key}"] = torch.as_tensor(value).detach().clone()
    return out


def _assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith(".step"):
            assert torch.equal(a[k], b[k]), (k, a[k], b[k])  # AdamW's count: exactly
        else:
            assert torch.allclose(a[k], b[k], rtol=0, atol=atol), (k, (a[k] - b[k]).abs().max())


CASES = {
    # (algorithm, trainer settings, which precision fails, at which update)
    "ppo_epochs 2, the 2nd update": ("grpo", {"ppo_epochs": 2}, "policy", 2),
    "mini-batches, the 2nd of 3": ("grpo", {"ppo_epochs": 1, "mini_batch_size": 1}, "policy", 2),
    "PPO's critic, after the policy's updates": ("ppo", {"ppo_epochs": 2}, "critic", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_failing_after_an_update_is_undone_and_its_retry_trains_the_batch_once(case):
    algorithm, settings, where, at = CASES[case]
    clean, bad = _engine(algorithm, **settings), _engine(algorithm, **settings)
    for engine in (clean, bad):  # a step before: the optimizer has moments to restore
        engine.train_step(_batch("a"), 0)
    expected = clean.train_step(_batch("b"), 1)
    before, lr_steps = _state(bad), bad.steps_trained

    injected = OutOfMemoryAt(bad.precision if where == "policy" else bad.critic.precision, {at})
    with pytest.raises(torch.OutOfMemoryError):
        bad.train_step(_batch("b"), 1)
    _assert_close(_state(bad), before, atol=0.0)  # the state is as before, exactly...
    assert bad.updates_applied >= 1  # ... though the failure came after an update
    assert bad.steps_trained == lr_steps
    assert all(p.grad is None for p in bad.model.parameters())

    got = bad.retry_row_by_row(_batch("b"), 1)  # what the trainer does next
    assert injected.n > at
    assert got["train/lr"] == expected["train/lr"]  # the schedule's step is not skipped
    assert bad.steps_trained == clean.steps_trained == 2
    _assert_close(_state(bad), _state(clean), atol=PARAM_ABS)  # one clean step, no more


# -- through the trainer's step path --------------------------------------------------------------
def test_a_retry_that_fails_again_sets_aside_a_batch_the_model_did_not_learn_from():
    engine = _engine("grpo", ppo_epochs=2)
    engine.train_step(_batch("a"), 0)
    before = _state(engine)
    injected = OutOfMemoryAt(engine.precision, {2, 4})  # the 2nd update of each try
    trainer = step_path(engine, _batch("b"))
    assert asyncio.run(trainer._step(_batch("b"))) is None
    assert injected.n == 4 and trainer.counters["steps_retried"] == 1
    assert [r.offset for r in trainer.events.records] == [0, 1, 2]  # the batch set aside...
    _assert_close(_state(engine), before, atol=0.0)  # ... which the model never learned from
    assert engine.steps_trained == 1


def test_a_step_of_one_update_that_fails_once_it_is_applied_ends_the_trainer():
    engine = _engine("grpo", ppo_epochs=1)
    engine.train_step(_batch("a"), 0)
    OutOfMemoryAt(engine.precision, {1, 2}, after=True)  # applied, then out of memory
    trainer = step_path(engine, _batch("b"))
    with pytest.raises(Exception) as raised:
        asyncio.run(trainer._step(_batch("b")))
    assert not trainer.events.records  # learned from: never dead-lettered, never retried
    assert trainer.counters.get("steps_retried", 0) == 0
    from streamrft.schemas.errors import StepNotUndone

    assert raised.type is StepNotUndone, raised.value  # nothing was copied: the trainer exits
    assert "after its optimizer update was applied" in str(raised.value)


def test_float16_a_failure_inside_the_optimizers_step_is_undone_with_its_loss_scale():
    """Under float16 the loss scaler has unscaled the gradients before the update: undone,
    it must take the next step's unscale again (and keep its scale)."""
    clean, bad = _float16_pair(ppo_epochs=2)
    before, scale = _state(bad), bad.precision.scaler.get_scale()
    calls = []

    def inside_the_step(*_):  # after unscale_, before the parameters change
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    hook = bad.optimizer.register_step_pre_hook(inside_the_step)
    with pytest.raises(torch.OutOfMemoryError):
        bad.train_step(_batch("b"), 1)
    hook.remove()
    _assert_close(_state(bad), before, atol=0.0)
    assert bad.precision.scaler.get_scale() == scale
    bad.retry_row_by_row(_batch("b"), 1)  # a second unscale_ is accepted
    _assert_close(_state(bad), _state(clean), atol=FP16_ABS)


def _float16_pair(ppo_epochs: int) -> tuple[TorchTrainEngine, TorchTrainEngine]:
    """Two float16 engines after one step each: the first has trained batch b cleanly."""
    settings = {"lr_warmup_steps": 4, "max_steps": 10, "ppo_epochs": ppo_epochs}
    engines = [
        TorchTrainEngine(learning_config({"type": "grpo"}, trainer=settings, model=FP16))
        for _ in range(2)
    ]
    for engine in engines:
        engine.prepare()
        engine.train_step(_batch("a"), 0)
    clean, bad = engines
    clean.train_step(_batch("b"), 1)
    return clean, bad


FP16 = {"dtype": "float16"}
FP16_ABS = 1e-4
"""float16 compute, row by row against the whole batch (5e-6 seen); the first update
applied twice moves the weights by about 5e-4."""


def test_float16_a_one_update_step_failing_after_the_unscale_is_retried_and_trains_once():
    """A step of one update is not copied; one that fails after the loss scaler unscaled
    its gradients but before the update (an out-of-memory error in the gradient clipping)
    changed no weight: its retry must be able to unscale again, and train the batch once."""
    clean, bad = _float16_pair(ppo_epochs=1)
    before = _state(bad)
    scaler = bad.precision.scaler
    real_unscale = scaler.unscale_

    def unscale_then_fail(optimizer):  # what an out-of-memory clip_grad_norm_ leaves
        scaler.unscale_ = real_unscale
        real_unscale(optimizer)
        raise torch.OutOfMemoryError("CUDA out of memory (injected, after the unscale)")

    scaler.unscale_ = unscale_then_fail
    trainer = step_path(bad, _batch("b"))
    values = asyncio.run(trainer._step(_batch("b")))
    assert values is not None, [str(r.error) for r in trainer.events.records]
    assert trainer.counters["steps_retried"] == 1 and not trainer.events.records
    assert before.keys() == _state(bad).keys()
    _assert_close(_state(bad), _state(clean), atol=FP16_ABS)  # one clean step, no more


def test_a_step_whose_copy_host_memory_refuses_goes_on_uncopied(monkeypatch, caplog):
    """The copy before a step of several updates needs host memory (about 3 times the
    trainable weights); when it cannot be made, the step goes on without it: trained as
    usual when nothing fails, and a failure after one of its updates ends the trainer
    (StepNotUndone) instead of being taken for the batch's (retried, then set aside)."""
    from streamrft.consumers import step_undo
    from streamrft.schemas.errors import StepNotUndone

    clean, engine = _engine("grpo", ppo_epochs=2), _engine("grpo", ppo_epochs=2)
    for e in (clean, engine):
        e.train_step(_batch("a"), 0)
    clean.train_step(_batch("b"), 1)
    copies = []

    def refused(tensor):  # what the allocator says when host memory is short
        copies.append(tensor.numel())
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")

    monkeypatch.setattr(step_undo, "to_host", refused)
    trainer = step_path(engine, _batch("b"))
    with caplog.at_level("WARNING", "streamrft.consumers.train_engine"):
        values = asyncio.run(trainer._step(_batch("b")))
    assert copies and values is not None and values["train/lr"] > 0
    _assert_close(_state(engine), _state(clean), atol=0.0)  # the same step, copied or not
    assert trainer.counters["steps_not_copied"] == 1 and not trainer.events.records

    OutOfMemoryAt(engine.precision, {2})  # the next step: its 2nd update fails
    trainer = step_path(engine, _batch("c"))
    with (
        caplog.at_level("WARNING", "streamrft.consumers.train_engine"),
        pytest.raises(StepNotUndone, match="after its optimizer update was applied"),
    ):
        asyncio.run(trainer._step(_batch("c")))
    assert not trainer.events.records  # learned from in part: never set aside
    assert trainer.counters.get("steps_retried", 0) == 0
    assert trainer.counters["steps_not_copied"] == 1
    assert engine.steps_not_copied == 2
    assert caplog.text.count("no host memory for the copy") == 1  # said once
