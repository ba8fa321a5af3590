"""The simulated engine: random ordinary tokens, grouped like a real engine, a cost per token."""

from __future__ import annotations

import math

import pytest
import torch

from streamrft.infra.config import ExplorerConfig, from_dict
from streamrft.infra.modeling import build_char_tokenizer
from streamrft.producers.engines import SimulatedEngine, check_engine, make_engine
from streamrft.producers.engines.simulated import make_simulated_engine
from streamrft.producers.rewards import exact_match
from streamrft.producers.workflows import RolloutSpec, math_workflow
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task

pytestmark = pytest.mark.unit

PROMPTS = ["3+5=", "12+30=", "7+0="]


class Sleeps:
    """An injected sleep that records what it was asked to sleep."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)

    @property
    def total(self) -> float:
        return sum(self.calls)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    """The prompts as the math workflow hands them to an engine: raw text, BOS added."""
    return [tokenizer(p, add_special_tokens=True).input_ids for p in PROMPTS]


@pytest.fixture
def sleeps():
    return Sleeps()


@pytest.fixture
def engine(tokenizer, sleeps):
    return SimulatedEngine(torch.nn.Linear(1, 1), tokenizer, 0.002, sleep=sleeps)


def test_registered_and_built_with_the_explorer_cost(tokenizer):
    assert check_engine("simulated") is make_simulated_engine
    cfg = ExplorerConfig(engine="simulated", simulated_seconds_per_token=0.125)
    model = torch.nn.Linear(1, 1)
    engine = make_engine("simulated", model, tokenizer, cfg)
    assert isinstance(engine, SimulatedEngine)
    assert engine.model is model and engine.tokenizer is tokenizer
    assert engine.seconds_per_token == 0.125


def test_rollouts_are_ordinary_tokens_grouped_per_prompt(engine, tokenizer, prompt_ids):
    groups = engine.rollout(prompt_ids, n=5, temperature=1.0, max_new_tokens=6, seed=3)
    special = set(tokenizer.all_special_ids)
    ordinary = len(tokenizer) - len(special)
    assert len(groups) == len(PROMPTS)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        assert len(group) == 5
        for r in group:
            assert r.prompt_ids == tokenizer(prompt, add_special_tokens=True).input_ids
            assert 1 <= len(r.response_ids) <= 6
            assert all(0 <= t < len(tokenizer) and t not in special for t in r.response_ids)
            assert r.logprobs == pytest.approx([-math.log(ordinary)] * len(r.response_ids))
            assert all(lp <= 0 for lp in r.logprobs)
            assert r.text == tokenizer.decode(r.response_ids, skip_special_tokens=True)
    # random, not one response repeated
    assert len({tuple(r.response_ids) for g in groups for r in g}) > 1


def test_the_sleep_scales_with_the_tokens_generated(engine, sleeps, prompt_ids):
    engine.rollout(prompt_ids, n=4, temperature=1.0, max_new_tokens=5, seed=0)
    tokens = sum(len(r.response_ids) for g in engine.rollout(prompt_ids, 4, 1.0, 5, 0) for r in g)
    assert tokens == 3 * 4 * 5  # fixed length: every response is max_new_tokens long
    assert sleeps.total == pytest.approx(2 * tokens * 0.002)
    sleeps.calls.clear()
    engine.rollout(prompt_ids, n=8, temperature=1.0, max_new_tokens=5, seed=0)
    assert sleeps.total == pytest.approx(3 * 8 * 5 * 0.002)  # twice the rollouts, twice the cost
    sleeps.calls.clear()
    texts = engine.greedy(prompt_ids, max_new_tokens=4)
    assert sleeps.total > 0
    assert sleeps.total <= 3 * 4 * 0.002 + 1e-12
    assert all(isinstance(t, str) for t in texts) and len(texts) == 3


def test_no_cost_no_sleep(tokenizer, sleeps, prompt_ids):
    engine = SimulatedEngine(torch.nn.Linear(1, 1), tokenizer, 0.0, sleep=sleeps)
    engine.rollout(prompt_ids, 2, 1.0, 4, 0)
    assert sleeps.calls == []


def test_the_same_seed_gives_the_same_rollouts(engine, prompt_ids):
    def ids(seed):
        groups = engine.rollout(prompt_ids, 3, 1.0, 4, seed)
        return [[(r.response_ids, r.text) for r in g] for g in groups]

    assert ids(7) == ids(7)
    assert ids(7) != ids(8)
    assert engine.greedy(prompt_ids, 4) == engine.greedy(prompt_ids, 4)


def test_math_workflow_runs_on_it(engine):
    tasks = [Task(id=str(i), prompt=p, answer="8") for i, p in enumerate(PROMPTS)]
    spec = RolloutSpec(
        repeat_times=4,
        temperature=1.0,
        max_new_tokens=4,
        seed=1,
        run="r",
        explorer="explorer-0",
        model_version=0,
        explorer_step=0,
    )
    groups = math_workflow(engine, tasks, exact_match, spec)
    assert [g.task_id for g in groups] == ["0", "1", "2"]
    assert all(len(g.experiences) == 4 for g in groups)
    assert all(e.response_length == 4 for g in groups for e in g.experiences)


def test_a_negative_cost_is_a_config_error_naming_the_field():
    data = {"taskset": {"path": "t.jsonl"}, "explorer": {"simulated_seconds_per_token": -0.001}}
    with pytest.raises(ConfigError, match=r"^explorer\.simulated_seconds_per_token: "):
        from_dict(data)
    cfg = from_dict({**data, "explorer": {"engine": "simulated", "simulated_seconds_per_token": 0}})
    assert cfg.explorer.simulated_seconds_per_token == 0.0
