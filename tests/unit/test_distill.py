"""On-policy distillation (``algorithm.type: on_policy_distill``): the ``distill`` advantage
on hand tensors, the config rules of ``algorithm.teacher_path``, and the teacher in the
train engine (loaded frozen, checked against the policy's vocabulary, its reverse KL
reported each step)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamrft.consumers.algorithms import ADVANTAGES, POLICY_LOSSES, resolve_algorithm
from streamrft.consumers.algorithms.advantages import (
    AdvantageInputs,
    distill_advantages,
    grpo_advantages,
)
from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.consumers.train_engine import TorchTrainEngine
from streamrft.infra.config import AlgorithmConfig, Config, ModelConfig, RunSection, load_config
from streamrft.infra.modeling import load_policy, save_policy
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas import unpack_f32, unpack_i32
from streamrft.schemas.arrays import unpack_u8
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup, Task

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)

TINY = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_positions=32
)
DISTILL = AlgorithmSpec(name="on_policy_distill", advantage_fn="distill", teacher_path="/t")


# -- the advantage ---------------------------------------------------------------------------


def hand_inputs() -> AdvantageInputs:
    """Two groups (2 and 3 rollouts) with padded responses; the padding holds values that
    must not leak into the advantages."""
    mask = torch.tensor(
        [
            [1.0, 1.0, 0.0],
            [1.0, 0.0, 0.0],
            [1.0, 1.0, 1.0],
            [0.0, 1.0, 0.0],  # a masked-out first token (e.g. a tool's output)
            [1.0, 1.0, 0.0],
        ]
    )
    old = torch.tensor(
        [
            [-1.0, -2.0, 0.0],
            [-0.5, 0.0, 0.0],
            [-0.1, -0.2, -0.3],
            [-4.0, -1.0, 0.0],
            [-2.0, -2.0, 0.0],
        ]
    )
    teacher = torch.tensor(
        [
            [-0.5, -3.0, -9.0],
            [-0.5, -7.0, -7.0],
            [-0.1, -1.2, -0.1],
            [-1.0, -3.5, -5.0],
            [-4.0, -1.0, -6.0],
        ]
    )
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    return AdvantageInputs(rewards, [2, 3], mask, None, old, teacher)


def test_the_distill_advantage_is_the_teacher_minus_the_rollout_log_prob_per_token():
    adv = distill_advantages(hand_inputs(), DISTILL)
    expected = torch.tensor(
        [
            [0.5, -1.0, 0.0],
            [0.0, 0.0, 0.0],
            [0.0, -1.0, 0.2],
            [0.0, -2.5, 0.0],
            [-2.0, 1.0, 0.0],
        ]
    )
    assert torch.allclose(adv, expected, atol=1e-6), adv
    assert ADVANTAGES["distill"] is distill_advantages


def test_the_reward_term_adds_the_weighed_group_normalised_reward_advantage():
    inp = hand_inputs()
    coef = 0.5
    adv = distill_advantages(inp, AlgorithmSpec(advantage_fn="distill", distill_reward_coef=coef))
    pure = distill_advantages(inp, DISTILL)
    # by hand: group [1, 0] -> +-1/sqrt(0.5); group [1, 0, 0] -> (2/3, -1/3, -1/3) / std
    std2, std3 = 0.5**0.5, (1 / 3) ** 0.5
    per_rollout = torch.tensor(
        [1 / 2 / std2, -1 / 2 / std2, 2 / 3 / std3, -1 / 3 / std3, -1 / 3 / std3]
    )
    expected = pure + coef * per_rollout[:, None] * inp.mask
    assert torch.allclose(adv, expected, atol=1e-5), adv
    assert torch.allclose(adv - pure, coef * grpo_advantages(inp, AlgorithmSpec()), atol=1e-6)
    assert torch.all(adv[inp.mask == 0] == 0)


def test_the_distill_advantage_needs_the_teachers_log_probs():
    inp = hand_inputs()
    inp.teacher_logprobs = None
    with pytest.raises(ValueError, match="teacher"):
        distill_advantages(inp, DISTILL)


# -- config ----------------------------------------------------------------------------------


def test_the_preset_resolves_to_the_distill_advantage_and_ppo_clip():
    algo = resolve_algorithm(
        Config(algorithm=AlgorithmConfig(type="on_policy_distill", teacher_path="/teacher"))
    )
    assert algo.advantage is ADVANTAGES["distill"]
    assert algo.policy_loss is POLICY_LOSSES["ppo_clip"]
    spec = algo.spec
    assert spec.needs_teacher and spec.teacher_path == "/teacher"
    assert spec.distill_reward_coef == 0.0 and not spec.needs_reference
    with_reward = AlgorithmConfig(
        type="on_policy_distill", teacher_path="/teacher", distill_reward_coef=0.3
    )
    assert resolve_algorithm(Config(algorithm=with_reward)).spec.distill_reward_coef == 0.3
    assert not resolve_algorithm(Config()).spec.needs_teacher


@pytest.mark.parametrize(
    ("algorithm", "origin"),
    [
        (AlgorithmConfig(type="on_policy_distill"), r" \(algorithm\.type 'on_policy_distill'\)"),
        (AlgorithmConfig(advantage_fn="distill"), ""),
    ],
)
def test_distill_without_a_teacher_path_is_a_config_error(algorithm, origin):
    with pytest.raises(
        ConfigError,
        match=rf"^algorithm\.teacher_path: required by algorithm\.advantage_fn 'distill'{origin}:",
    ):
        resolve_algorithm(Config(algorithm=algorithm))


def test_a_teacher_path_without_distill_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^algorithm\.teacher_path: set, but .* 'grpo'"):
        resolve_algorithm(Config(algorithm=AlgorithmConfig(teacher_path="/teacher")))


def test_a_relative_teacher_path_is_resolved_against_the_config_file(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "run.yaml").write_text(
        "taskset: {path: tasks.jsonl}\n"
        "algorithm: {type: on_policy_distill, teacher_path: models/teacher}\n"
    )
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.algorithm.teacher_path == str(tmp_path / "models" / "teacher")


# -- the teacher in the train engine ---------------------------------------------------------


def save_tiny(folder, seed: int = 0, sharpen: float = 1.0, **model):
    """The tiny model of ``seed`` (and these ``model.*`` fields) as a Hugging Face folder;
    ``sharpen`` scales its (tied) embedding, so its logits: a random model's next-token
    distribution is near uniform, a sharpened one's is not."""
    policy, tokenizer = load_policy(msgspec.structs.replace(TINY, seed=seed, **model))
    with torch.no_grad():
        policy.get_input_embeddings().weight.mul_(sharpen)
    return save_policy(policy, tokenizer, folder)


def engine_config(tmp_path, teacher_path: str, **algorithm) -> Config:
    return Config(
        model=TINY,
        algorithm=AlgorithmConfig(type="on_policy_distill", teacher_path=teacher_path, **algorithm),
        run=RunSection(dir=str(tmp_path)),
    )


def test_a_missing_teacher_folder_is_a_config_error(tmp_path):
    missing = str(tmp_path / "no-such-teacher")
    with pytest.raises(
        ConfigError, match=rf"^algorithm\.teacher_path: folder '{missing}' does not exist$"
    ):
        TorchTrainEngine(engine_config(tmp_path, missing))


def test_a_folder_without_a_model_is_a_config_error_naming_the_teacher(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^algorithm\.teacher_path: '.*empty' has no config"):
        TorchTrainEngine(engine_config(tmp_path, str(tmp_path / "empty")))
    folder = save_tiny(tmp_path / "teacher")
    (folder / "model.safetensors").unlink()  # a config but no weights
    with pytest.raises(ConfigError, match=r"^algorithm\.teacher_path: cannot load '.*teacher'"):
        TorchTrainEngine(engine_config(tmp_path, str(folder)))


def test_a_teacher_with_another_vocabulary_is_a_config_error_naming_both_sizes(tmp_path):
    folder = save_tiny(tmp_path / "digits", charset="0123456789+=")
    policy_size = len(load_policy(TINY)[1])
    with pytest.raises(
        ConfigError,
        match=rf"^algorithm\.teacher_path: the teacher's vocabulary \(16 tokens\) differs from "
        rf"the policy's \({policy_size} tokens\)",
    ):
        TorchTrainEngine(engine_config(tmp_path, str(folder)))


def sample(engine: TorchTrainEngine) -> list[ExperienceGroup]:
    tasks = [Task(id=f"t{i}", prompt=f"{i}+{i + 3}=", answer=str(2 * i + 3)) for i in range(4)]
    rollout = TransformersEngine(engine.model, engine.tokenizer)
    spec = RolloutSpec(
        repeat_times=4,
        temperature=1.0,
        max_new_tokens=5,
        seed=3,
        run="r",
        explorer="e",
        model_version=0,
    )
    return get_workflow("math")(rollout, tasks, lambda text, task: (0.0, {}), spec)


@torch.no_grad()
def reverse_kl_by_hand(teacher: torch.nn.Module, groups: list[ExperienceGroup]) -> float:
    """Mean over trained tokens of rollout log-prob minus the teacher's, each rollout run
    through the teacher alone (no padding)."""
    total, count = 0.0, 0.0
    for e in (e for g in groups for e in g.experiences):
        ids = torch.tensor(unpack_i32(e.tokens))
        logp = torch.log_softmax(teacher(input_ids=ids[None]).logits[0, :-1].float(), -1)
        chosen = logp.gather(-1, ids[1:, None]).squeeze(-1)[e.prompt_length - 1 :]
        mask = torch.tensor(unpack_u8(e.action_mask), dtype=torch.float32)
        old = torch.tensor(unpack_f32(e.logprobs))
        total += float(((old - chosen) * mask).sum())
        count += float(mask.sum())
    return total / count


def test_the_engine_loads_the_teacher_frozen_and_reports_its_reverse_kl(tmp_path):
    folder = save_tiny(tmp_path / "teacher", seed=1, sharpen=20.0)  # same vocabulary
    engine = TorchTrainEngine(engine_config(tmp_path, str(folder)))
    teacher = engine.teacher
    assert teacher is not None and not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    assert all(p.dtype == engine.precision.dtype for p in teacher.parameters())
    engine.prepare()
    assert engine.ref_model is None  # no KL term: no reference model
    groups = sample(engine)
    expected = reverse_kl_by_hand(teacher, groups)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    metrics = engine.train_step(groups, version=0)
    assert metrics["train/teacher_reverse_kl"] == pytest.approx(expected, abs=1e-4)
    assert expected > 1.0  # a near-uniform student, a sharp teacher: far apart
    assert metrics["train/advantage_abs_mean"] > 0.1
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())


def test_a_teacher_equal_to_the_policy_gives_no_advantage(tmp_path):
    folder = save_tiny(tmp_path / "teacher", seed=0)  # the policy's own initial weights
    engine = TorchTrainEngine(engine_config(tmp_path, str(folder)))
    engine.prepare()
    metrics = engine.train_step(sample(engine), version=0)
    assert abs(metrics["train/teacher_reverse_kl"]) < 1e-4
    assert metrics["train/advantage_abs_mean"] < 1e-4
    assert metrics["train/grad_norm"] < 1e-3
