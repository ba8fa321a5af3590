"""Expert data: the shared builder, the trainer's expert source, and the ``mix`` strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrft.consumers.algorithms.aggregation import aggregate, normaliser
from streamrft.consumers.algorithms.presets import algorithm_spec
from streamrft.consumers.algorithms.step import mix_scales
from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.expert_data import SOURCE, ExpertSource
from streamrft.consumers.strategies import Mix, make_strategy
from streamrft.infra.config import AlgorithmConfig, TasksetConfig, TrainerConfig
from streamrft.infra.expert import EXPERT_WORKFLOW, answer_ids, expert_group
from streamrft.infra.modeling import build_char_tokenizer
from streamrft.infra.prompts import PromptRenderer
from streamrft.infra.taskset import read_taskset
from streamrft.schemas.arrays import unpack_f32, unpack_i32
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task, validate_group
from tests.helpers.groups import make_group

pytestmark = [pytest.mark.unit, pytest.mark.numeric]

ADDITION = Path(__file__).resolve().parents[2] / "examples" / "data" / "addition.jsonl"
P0 = ("run.experiences", 0)


@pytest.fixture(scope="module")
def render() -> PromptRenderer:
    return PromptRenderer(build_char_tokenizer())


def test_an_expert_group_is_the_prompt_then_the_answer_and_eos_all_trained(render):
    task = Task(id="t1", prompt="3+4=", answer="7", epoch=2)
    group = validate_group(expert_group(task, render, run="r", source="s", version=5))
    (exp,) = group.experiences
    tokens = unpack_i32(exp.tokens)
    assert tokens[: exp.prompt_length] == render.ids(task)
    assert tokens[exp.prompt_length :] == answer_ids(render.tokenizer, "7")
    assert tokens[-1] == render.tokenizer.eos_token_id
    assert exp.action_mask == b"\x01" * exp.response_length
    assert unpack_f32(exp.logprobs) == [0.0] * exp.response_length
    assert (group.workflow, group.model_version, group.id) == (EXPERT_WORKFLOW, 5, "r/t1@2")
    with pytest.raises(ConfigError, match="needs the task's answer"):
        expert_group(Task(id="t2", prompt="x"), render, run="r", source="s", version=0)


def test_the_expert_source_draws_each_task_once_per_pass_and_again_after_a_restart(render):
    tasks = read_taskset(ADDITION, TasksetConfig())
    source = ExpertSource(tasks, render, "r/expert", seed=3, per_step=7)
    drawn = [g for step in range(15) for g in source.take(step, version=step)]
    first_pass = [g.task_id for g in drawn[: len(tasks)]]
    assert sorted(first_pass) == sorted(t.id for t in tasks)  # without replacement
    assert first_pass != [t.id for t in tasks]  # shuffled
    assert {g.epoch for g in drawn[len(tasks) :]} == {1}
    assert len({g.id for g in drawn}) == len(drawn)  # ids differ across passes
    assert all(g.explorer == SOURCE and g.id.startswith("r/expert/") for g in drawn)
    again = ExpertSource(tasks, render, "r/expert", seed=3, per_step=7)
    assert [g.id for g in again.take(9, 9)] == [g.id for g in drawn[63:70]]


def test_the_expert_source_refuses_tasks_without_answers(render):
    with pytest.raises(ConfigError, match=r"^algorithm\.expert_data: 1 task\(s\) without"):
        ExpertSource([Task(id="a", prompt="p")], render, "r", 0, 1)


def test_mix_adds_the_steps_expert_groups_to_the_batch_order_choice(render):
    tasks = read_taskset(ADDITION, TasksetConfig())
    source = ExpertSource(tasks, render, "r/expert", seed=0, per_step=2)
    spec = algorithm_spec(AlgorithmConfig(sample_strategy="mix", expert_data=str(ADDITION)), 4)
    strategy = make_strategy(spec, TrainerConfig(batch_size=2), experts=source.take)
    assert isinstance(strategy, Mix)
    buf = ExperienceBuffer(max_staleness=1, strategy=strategy)
    buf.offer(make_group("r", "a", 0, batch=0), P0, 0)
    assert buf.take(2) is None  # waits like batch order: no expert groups alone
    buf.offer(make_group("r", "b", 0, batch=0), P0, 1)
    taken = buf.take(2)
    assert [g.task_id for g in taken[:2]] == ["a", "b"]
    assert [g.workflow for g in taken[2:]] == [EXPERT_WORKFLOW] * 2
    assert [g.id for g in taken[2:]] == [g.id for g in source.take(0, 0)]
    assert buf.last_replayed == 0  # expert groups are not replays
    buf.offer(make_group("r", "c", 1, batch=1), P0, 2)
    buf.offer(make_group("r", "d", 1, batch=1), P0, 3)
    assert [g.id for g in buf.take(2)[2:]] == [g.id for g in source.take(1, 0)]


def test_mix_without_expert_data_is_a_config_error():
    spec = algorithm_spec(AlgorithmConfig(sample_strategy="mix"), 4)
    with pytest.raises(
        ConfigError, match=r"^algorithm\.expert_data: required by sample_strategy 'mix'"
    ):
        make_strategy(spec, TrainerConfig())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_mix_weighs_rl_and_sft_each_over_their_own_rows(mode):
    """CHORD's loss: (1 - mu) x the RL loss over the RL rows + mu x the supervised loss over
    the expert rows, whatever their token counts; and a batch cut into micro-batches
    weighed by their normaliser's share gives the same."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    expert = torch.tensor([False, False, True, True])
    rl = torch.tensor([[0.5, -1.0, 9.0], [2.0, 0.25, 1.0], [7.0, 7.0, 7.0], [7.0, 7.0, 7.0]])
    nll = torch.tensor([[9.0, 9.0, 9.0], [9.0, 9.0, 9.0], [3.0, 9.0, 9.0], [1.0, 2.0, 0.5]])
    mu = 0.3
    rl_scale, sft_scale = mix_scales(mask, expert, mode, mu)
    per_token = torch.where(expert[:, None], sft_scale * nll, rl_scale * rl)
    got = aggregate(per_token, mask, mode)
    want = (1 - mu) * aggregate(rl[:2], mask[:2], mode) + mu * aggregate(nll[2:], mask[2:], mode)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    whole = normaliser(mask, mode)
    parts = sum(
        aggregate(per_token[lo:hi], mask[lo:hi], mode) * normaliser(mask[lo:hi], mode) / whole
        for lo, hi in ((0, 1), (1, 3), (3, 4))
    )
    assert float(parts) == pytest.approx(float(want), rel=1e-6)
    # mu 0: the expert rows weigh nothing and the RL loss is its own rows' mean
    rl_only, nothing = mix_scales(mask, expert, mode, 0.0)
    assert nothing == 0.0
    per_token = torch.where(expert[:, None], nothing * nll, rl_only * rl)
    assert float(aggregate(per_token, mask, mode)) == pytest.approx(
        float(aggregate(rl[:2], mask[:2], mode)), rel=1e-6
    )
