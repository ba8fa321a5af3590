"""The learning-rate schedule (``trainer.lr_schedule``): each step's factor equals the
formula, the engine trains each step at it (policy and critic), and a resumed engine
continues the curve where its checkpoint left it."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest
import torch

from streamrft.consumers.lr_schedule import lr_factor, warmup_steps
from streamrft.consumers.state import TrainerState
from streamrft.consumers.train_engine import TorchTrainEngine
from streamrft.infra.config import TrainerConfig, from_dict
from streamrft.schemas.errors import ConfigError
from tests.helpers.groups import make_group
from tests.helpers.learning import learning_config

pytestmark = pytest.mark.unit


def trainer(**fields) -> TrainerConfig:
    return msgspec.structs.replace(TrainerConfig(), **fields)


def test_constant_without_warmup_is_one_at_every_step():
    t = trainer(max_steps=5)
    assert [lr_factor(i, t) for i in range(5)] == [1.0] * 5


def test_warmup_climbs_linearly_and_the_first_step_already_learns():
    t = trainer(max_steps=10, lr_warmup_steps=4)
    assert [lr_factor(i, t) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_to_the_floor_by_hand():
    # 2 warm-up steps, then 8 of decay: p = 0, 1/8, ..., 7/8; floor 0.2
    t = trainer(max_steps=10, lr_schedule="linear", lr_warmup_steps=2, min_lr_ratio=0.2)
    got = [lr_factor(i, t) for i in range(10)]
    want = [0.5, 1.0] + [0.2 + 0.8 * (1 - k / 8) for k in range(8)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[2] == 1.0 and got[-1] == pytest.approx(0.3)


def test_cosine_decay_by_hand():
    t = trainer(max_steps=6, lr_schedule="cosine", min_lr_ratio=0.1)
    got = [lr_factor(i, t) for i in range(6)]
    want = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == 1.0 and got[3] == pytest.approx(0.55)  # halfway: the mean of peak and floor
    assert all(a > b for a, b in itertools.pairwise(got))  # falls at every step


def test_a_warmup_ratio_is_rounded_up():
    assert warmup_steps(trainer(max_steps=10, lr_warmup_ratio=0.25)) == 3
    assert warmup_steps(trainer(max_steps=10, lr_warmup_steps=2)) == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lr_warmup_steps": 2, "lr_warmup_ratio": 0.1}, "not both"),
        ({"lr_schedule": "cosine", "max_steps": 0}, "decays over trainer.max_steps"),
        ({"lr_warmup_ratio": 0.1, "max_steps": 0}, "a share of trainer.max_steps"),
        ({"lr_warmup_steps": 5, "max_steps": 5}, "no step of the run's 5"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"taskset": {"path": "t.jsonl"}, "trainer": fields})
    with pytest.raises(ConfigError, match=r"trainer\.lr_schedule: Invalid enum value 'step'"):
        from_dict({"taskset": {"path": "t.jsonl"}, "trainer": {"lr_schedule": "step"}})


def _engine(tmp_path, algorithm: str = "grpo") -> TorchTrainEngine:
    schedule = {"lr_schedule": "cosine", "lr_warmup_steps": 2, "max_steps": 8, "min_lr_ratio": 0.1}
    cfg = learning_config({"type": algorithm}, trainer=schedule)
    engine = TorchTrainEngine(cfg)
    engine.ckpt_root = tmp_path / "checkpoints"
    engine.prepare()
    return engine


def _step(engine: TorchTrainEngine, i: int) -> float:
    group = make_group("run", f"t{i}", 0, 2, rewards=[0.0, 1.0])
    return engine.train_step([group], version=i)["train/lr"]


def test_the_engine_trains_each_step_at_the_schedule_and_a_resume_continues_it(tmp_path):
    engine = _engine(tmp_path)
    peak, t = engine.tcfg.lr, engine.tcfg
    first = [_step(engine, i) for i in range(4)]
    assert first == pytest.approx([peak * lr_factor(i, t) for i in range(4)], rel=1e-12)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(first[-1])
    engine.save(TrainerState(step=4))

    resumed = _engine(tmp_path / "other")
    resumed.load(engine.latest())
    assert resumed.steps_trained == 4
    rest = [_step(resumed, i) for i in range(4, 8)]
    assert rest == pytest.approx([peak * lr_factor(i, t) for i in range(4, 8)], rel=1e-12)
    # the resumed model took the same steps as one that never stopped: same lr per step
    straight = _engine(tmp_path / "straight")
    assert [_step(straight, i) for i in range(8)] == pytest.approx(first + rest, rel=1e-12)


def test_the_critic_follows_the_same_factor(tmp_path):
    engine = _engine(tmp_path, "ppo")
    assert engine.critic is not None
    base = engine.algo.spec.critic_lr
    for i in range(3):
        _step(engine, i)
        got = engine.critic.optimizer.param_groups[0]["lr"]
        assert got == pytest.approx(base * lr_factor(i, engine.tcfg), rel=1e-12)
    assert torch.isfinite(torch.tensor(got))
