"""DPO: the loss on hand values, the preference pair on the wire (schema, codec), the
``preference`` workflow, the config, and one step on a tiny model."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import msgspec
import pytest
import torch

from streamrft.consumers.algorithms import POLICY_LOSSES, LossInputs
from streamrft.consumers.algorithms.dpo import (
    check_group_kind,
    dpo_loss,
    dpo_step,
    pair_slices,
    sequence_logprobs,
)
from streamrft.consumers.algorithms.presets import resolve_algorithm
from streamrft.infra.config import ModelConfig, TrainerConfig, from_dict
from streamrft.infra.expert import PREFERENCE_WORKFLOW, expert_group, preference_group
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.rewards import exact_match
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas.arrays import pack_i32, unpack_i32
from streamrft.schemas.codec import EXPERIENCE_GROUP
from streamrft.schemas.errors import ConfigError, SchemaError
from streamrft.schemas.experience import PREFERENCE, ExperienceGroup, Task, validate_group

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)

ADDITION = Path(__file__).resolve().parents[2] / "examples" / "data" / "addition.jsonl"
TASK = Task(id="t1", prompt="3+4=", answer="7", metadata={"rejected": "9"})


@pytest.fixture(scope="module")
def render() -> PromptRenderer:
    return PromptRenderer(build_char_tokenizer())


def config(algorithm: dict | None = None, trainer: dict | None = None):
    return from_dict(
        {"taskset": {"path": str(ADDITION)}, "algorithm": algorithm or {}, "trainer": trainer or {}}
    )


def pair(render: PromptRenderer, task: Task = TASK, version: int = 0) -> ExperienceGroup:
    return preference_group(task, render, run="r", source="s", version=version)


# -- the loss ----------------------------------------------------------------------------------


def test_the_loss_and_margin_by_hand():
    # pairs: (chosen -1, rejected -3) against a reference of -2 each; (-2, -2) against (-2, -2)
    policy = torch.tensor([-1.0, -3.0, -2.0, -2.0])
    reference = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    loss, margin = dpo_loss(policy, reference, beta=0.5)
    assert margin.tolist() == pytest.approx([0.5 * ((-1 + 2) - (-3 + 2)), 0.0])
    expected = (math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2  # -log sigmoid(x), mean
    assert float(loss) == pytest.approx(expected)


def test_the_gradient_raises_the_chosen_and_lowers_the_rejected():
    policy = torch.tensor([-2.0, -2.0], requires_grad=True)
    loss, _ = dpo_loss(policy, torch.tensor([-2.0, -2.0]), beta=0.1)
    loss.backward()
    assert policy.grad is not None
    assert policy.grad[0] < 0 < policy.grad[1]  # descent: chosen up, rejected down
    assert policy.grad[0] == pytest.approx(-0.05)  # -beta sigmoid(-0) at a zero margin


def test_sequence_log_probs_sum_the_trained_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # padding and untrained tokens
    assert sequence_logprobs(logp, mask).tolist() == [-3.0, -0.5]
    # through the loss: the masked -7 and -9 change nothing
    ref = torch.tensor([-3.0, -0.5])
    loss, margin = dpo_loss(sequence_logprobs(logp, mask), ref, beta=1.0)
    assert float(margin) == 0.0 and float(loss) == pytest.approx(math.log(2.0))


def test_pair_slices_never_split_a_pair():
    prompts, responses = [4] * 6, [2, 5, 3, 3, 1, 1]
    assert pair_slices(prompts, responses, rows=3, tokens=0) == [(0, 2), (2, 4), (4, 6)]
    assert pair_slices(prompts, responses, rows=4, tokens=0) == [(0, 4), (4, 6)]
    assert pair_slices(prompts, responses, rows=0, tokens=0) == [(0, 6)]
    # 2 rows x (4 + 5) = 18 tokens for the first pair; a budget of 20 keeps pairs alone
    assert pair_slices(prompts, responses, rows=0, tokens=20) == [(0, 2), (2, 4), (4, 6)]


def test_dpo_is_no_per_token_loss():
    t = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match=re.escape("algorithm.policy_loss_fn: 'dpo'")):
        POLICY_LOSSES["dpo"](LossInputs(t, t, t, t), resolve_algorithm(config()).spec)


# -- the wire ----------------------------------------------------------------------------------


def test_a_pair_is_valid_and_round_trips(render):
    group = validate_group(pair(render))
    assert group.kind == PREFERENCE and group.workflow == PREFERENCE_WORKFLOW
    decoded = EXPERIENCE_GROUP.decode(EXPERIENCE_GROUP.encode(group))
    assert decoded == group and decoded.kind == PREFERENCE


def test_an_old_reader_ignores_the_kind_and_an_old_writer_means_rollouts(render):
    class OldGroup(msgspec.Struct, kw_only=True):  # ExperienceGroup before ``kind``
        id: str
        task_id: str
        experiences: list[dict]
        batch: int = -1

    data = EXPERIENCE_GROUP.encode(pair(render))
    old = msgspec.msgpack.decode(data, type=OldGroup)
    assert old.id == "r/t1@0" and len(old.experiences) == 2
    # written without the field: decoded as the default
    without = msgspec.msgpack.encode(
        {k: v for k, v in msgspec.structs.asdict(pair(render)).items() if k != "kind"}
    )
    assert msgspec.msgpack.decode(without, type=ExperienceGroup).kind == "rollouts"


def test_a_pair_must_be_two_experiences_with_the_same_prompt(render):
    good = pair(render)
    three = msgspec.structs.replace(good, experiences=[*good.experiences, good.experiences[0]])
    with pytest.raises(SchemaError, match="exactly 2 experiences"):
        validate_group(three)
    chosen, rejected = good.experiences
    other_prompt = pair(render, Task(id="t1", prompt="3+5=", answer="8", metadata=TASK.metadata))
    mixed = msgspec.structs.replace(good, experiences=[chosen, other_prompt.experiences[1]])
    with pytest.raises(SchemaError, match="same prompt tokens"):
        validate_group(mixed)
    ids = unpack_i32(rejected.tokens)  # one token moved from the prompt to the response
    shifted = msgspec.structs.replace(
        rejected,
        tokens=pack_i32(ids),
        prompt_length=rejected.prompt_length - 1,
        logprobs=rejected.logprobs + bytes(4),
        action_mask=rejected.action_mask + b"\x01",
    )
    with pytest.raises(SchemaError, match="same prompt tokens"):
        validate_group(msgspec.structs.replace(good, experiences=[chosen, shifted]))
    with pytest.raises(SchemaError, match="kind 'pairs' is not one of"):
        validate_group(msgspec.structs.replace(good, kind="pairs"))


def test_the_trainer_takes_pairs_exactly_under_dpo(render):
    rollouts = expert_group(TASK, render, run="r", source="s", version=0)
    assert check_group_kind(pair(render), pairs=True).kind == PREFERENCE
    assert check_group_kind(rollouts, pairs=False) is rollouts
    with pytest.raises(SchemaError, match="trains only groups of kind 'preference'"):
        check_group_kind(rollouts, pairs=True)
    with pytest.raises(
        SchemaError, match=re.escape("trained only by algorithm.policy_loss_fn 'dpo'")
    ):
        check_group_kind(pair(render), pairs=False)


# -- the workflow ------------------------------------------------------------------------------


def test_the_preference_workflow_builds_a_valid_pair(render):
    spec = RolloutSpec(1, 1.0, 4, 0, "r", "explorer-0", model_version=3, prompts=render)
    tasks = [TASK, Task(id="t2", prompt="9+9=", answer="18", metadata={"rejected": "17"})]
    groups = get_workflow("preference")(None, tasks, exact_match, spec)  # nothing sampled
    for task, group in zip(tasks, groups, strict=True):
        validate_group(group)
        chosen, rejected = group.experiences
        assert [chosen.reward, rejected.reward] == [1.0, 0.0]
        assert [chosen.response_text, rejected.response_text] == [
            task.answer,
            task.metadata["rejected"],
        ]
        prompt = render.ids(task)
        eos = render.tokenizer.eos_token_id
        for exp, text in ((chosen, task.answer), (rejected, task.metadata["rejected"])):
            ids = unpack_i32(exp.tokens)
            assert ids[: exp.prompt_length] == prompt
            assert ids[exp.prompt_length :] == [
                *render.tokenizer(text, add_special_tokens=False).input_ids,
                eos,
            ]
            assert set(exp.action_mask) == {1} and set(exp.logprobs) == {0}
        assert group.model_version == 3 and group.kind == PREFERENCE
    with pytest.raises(ConfigError, match="metadata\\['rejected'\\]"):
        get_workflow("preference")(None, [Task(id="t3", prompt="1+1=", answer="2")], None, spec)


# -- config ------------------------------------------------------------------------------------


def test_the_dpo_preset_and_its_checks():
    spec = resolve_algorithm(config({"type": "dpo"})).spec
    assert spec.pairs and spec.needs_reference and spec.dpo_beta == 0.1
    assert spec.advantage_fn == "none"
    assert resolve_algorithm(config({"type": "dpo", "dpo_beta": 0.5})).spec.dpo_beta == 0.5
    with pytest.raises(ConfigError, match=re.escape("trainer.nproc")):
        resolve_algorithm(config({"type": "dpo"}, {"nproc": 2}))
    with pytest.raises(ConfigError, match=re.escape("algorithm.sample_strategy")):
        resolve_algorithm(config({"type": "dpo", "sample_strategy": "mix"}))
    assert not resolve_algorithm(config()).spec.pairs


# -- one step on a tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(render):
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_positions=32
    )
    return build_tiny_model(cfg, render.tokenizer)


def _pairs(render):
    tasks = [
        Task(
            id=f"t{a}{b}",
            prompt=f"{a}+{b}=",
            answer=str(a + b),
            metadata={"rejected": str(a + b + 1 + a % 3)},
        )
        for a in range(3)
        for b in range(2)
    ]
    return [pair(render, t) for t in tasks]


def _step(model, render, groups, **trainer):
    model = copy.deepcopy(model)
    ref = copy.deepcopy(model).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # plain: the gradient's scale shows
    algo = resolve_algorithm(config({"type": "dpo"}))
    cfg = TrainerConfig(grad_clip=0.0, **trainer)
    pad = render.tokenizer.pad_token_id
    return model, [dpo_step(model, opt, groups, cfg, algo, pad, ref) for _ in range(3)]


def test_a_step_separates_the_pairs_however_the_batch_is_cut(tiny, render):
    groups = _pairs(render)
    whole, metrics = _step(tiny, render, groups)
    assert metrics[0]["train/dpo_margin"] == 0.0  # the policy is its reference
    assert metrics[0]["train/loss"] == pytest.approx(math.log(2.0))
    assert metrics[2]["train/dpo_margin"] > metrics[1]["train/dpo_margin"] > 0
    assert metrics[2]["train/dpo_accuracy"] > 0.5 and metrics[2]["train/groups"] == 6
    cut, cut_metrics = _step(
        tiny, render, groups, micro_batch_size=2, max_tokens_per_micro_batch=30
    )
    for a, b in zip(whole.parameters(), cut.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert cut_metrics[2]["train/dpo_margin"] == pytest.approx(
        metrics[2]["train/dpo_margin"], rel=1e-4
    )


def test_a_step_refuses_a_group_that_is_not_a_pair(tiny, render):
    groups = [*_pairs(render)[:2], expert_group(TASK, render, run="r", source="s", version=0)]
    with pytest.raises(SchemaError, match="trains only groups of kind 'preference'"):
        _step(tiny, render, groups)
