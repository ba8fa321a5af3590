"""PPO with a critic: GAE against hand values and verl's definition, the clipped value loss,
the critic's value shift, its checkpoint round trip, and the config rules of ``ppo``."""

from __future__ import annotations

import logging

import msgspec
import pytest
import torch

from streamrft.consumers.algorithms import ADVANTAGES, ALGORITHMS, resolve_algorithm
from streamrft.consumers.algorithms.advantages import (
    AdvantageInputs,
    gae,
    gae_advantages,
    gae_returns,
    masked_whiten,
)
from streamrft.consumers.algorithms.policy_losses import ppo_clip
from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.consumers.algorithms.value_loss import clipped_value_loss, explained_variance
from streamrft.consumers.batching import collate
from streamrft.consumers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from streamrft.consumers.critic import Critic, ValueModel
from streamrft.consumers.precision import FP32
from streamrft.consumers.state import TrainerState
from streamrft.consumers.train_engine import TorchTrainEngine
from streamrft.infra.config import (
    AlgorithmConfig,
    Config,
    ModelConfig,
    TrainerConfig,
    from_dict,
)
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas.errors import ConfigError
from tests.helpers.groups import make_group
from tests.helpers.learning import learning_config

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)
F64 = torch.float64


def spec(**changes) -> AlgorithmSpec:
    return AlgorithmSpec(name="ppo", advantage_fn="gae", **changes)


# -- GAE by hand ------------------------------------------------------------------------------
# row 0: three trained tokens, reward 1 on the last; row 1: a token off the mask inside the
# response (a tool's output) and a padding token, reward 0.5 on its last trained token. The
# values off the mask are garbage: they must not count.
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]], dtype=F64)
REWARDS = torch.tensor([1.0, 0.5], dtype=F64)
VALUES = torch.tensor([[0.5, 0.6, 0.8, 3.0], [0.2, 9.0, 0.4, 7.0]], dtype=F64)


def token_rewards() -> torch.Tensor:
    return AdvantageInputs(REWARDS, [2], MASK).token_rewards


@pytest.mark.parametrize(
    ("gamma", "lam", "expected"),
    [
        # gamma = lam = 1: the return minus the value of each token
        (1.0, 1.0, [[0.5, 0.4, 0.2, 0.0], [0.3, 0.0, 0.1, 0.0]]),
        # A2 = 1 - .8 = .2; A1 = (.9 * .8 - .6) + .45 * .2 = .21; A0 = (.9 * .6 - .5) + .45 * .21
        # row 1: A2 = .5 - .4 = .1; the masked token is skipped: A0 = (.9 * .4 - .2) + .45 * .1
        (0.9, 0.5, [[0.1345, 0.21, 0.2, 0.0], [0.205, 0.0, 0.1, 0.0]]),
        # lam < 1 alone: A1 = .2 + .5 * .2 = .3, A0 = .1 + .5 * .3 = .25
        (1.0, 0.5, [[0.25, 0.3, 0.2, 0.0], [0.25, 0.0, 0.1, 0.0]]),
        # gamma < 1 alone: the discounted return minus the value
        (0.9, 1.0, [[0.81 - 0.5, 0.9 - 0.6, 0.2, 0.0], [0.45 - 0.2, 0.0, 0.1, 0.0]]),
    ],
)
def test_gae_by_hand_with_an_interior_mask_and_padding(gamma, lam, expected):
    result = gae(token_rewards(), VALUES, MASK, gamma, lam)
    assert torch.allclose(result, torch.tensor(expected, dtype=F64), atol=1e-12)


def test_returns_are_advantages_plus_values_and_the_estimator_whitens():
    inp = AdvantageInputs(REWARDS, [2], MASK, values=VALUES)
    s = spec(gamma=0.9, lam=0.5)
    raw = gae(token_rewards(), VALUES, MASK, 0.9, 0.5)
    assert torch.allclose(gae_returns(inp, s), (raw + VALUES) * MASK)
    assert torch.allclose(gae_advantages(inp, s), masked_whiten(raw, MASK))
    assert ADVANTAGES["gae"] is gae_advantages
    with pytest.raises(ValueError, match="values"):
        gae_advantages(AdvantageInputs(REWARDS, [2], MASK), s)


def test_the_kl_penalty_is_a_per_token_reward():
    penalty = torch.full_like(MASK, 0.1)
    inp = AdvantageInputs(REWARDS, [2], MASK, penalty, values=torch.zeros_like(MASK))
    # gamma = lam = 1, values 0: each token's return is what is left of the rewards
    expected = torch.tensor([[0.7, 0.8, 0.9, 0.0], [0.3, 0.0, 0.4, 0.0]], dtype=F64)
    assert torch.allclose(gae_returns(inp, spec(lam=1.0)), expected)


# -- against verl's compute_gae_advantage_return (core_algos.py), transcribed ------------------
def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl's loop: the running advantage and next value pass unchanged over masked tokens;
    returns = advantages + values; advantages whitened over the mask (unbiased variance)."""
    next_values = torch.zeros(values.shape[0], dtype=values.dtype)
    last = torch.zeros(values.shape[0], dtype=values.dtype)
    backwards = []
    for t in range(values.shape[1] - 1, -1, -1):
        m = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        candidate = delta + gamma * lam * last
        next_values = values[:, t] * m + (1 - m) * next_values
        last = candidate * m + (1 - m) * last
        backwards.append(last)
    advantages = torch.stack(backwards[::-1], dim=1)
    returns = advantages + values
    n = response_mask.sum()
    mean = (advantages * response_mask).sum() / n
    var = (((advantages - mean) ** 2) * response_mask).sum() / (n - 1)
    return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.7)])
def test_gae_matches_verls_definition_on_random_batches(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    b, r = 6, 9
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = (torch.arange(r)[None, :] < lengths[:, None]).to(F64)
    mask = mask * (torch.rand(b, r, generator=g) > 0.2)  # some interior tokens off the mask
    mask[:, 0] = 1.0
    rewards = torch.rand(b, generator=g, dtype=F64)
    values = torch.randn(b, r, generator=g, dtype=F64)
    penalty = 0.05 * torch.randn(b, r, generator=g, dtype=F64)
    inp = AdvantageInputs(rewards, [b], mask, penalty, values=values)
    ours_adv = gae_advantages(inp, spec(gamma=gamma, lam=lam))
    ours_ret = gae_returns(inp, spec(gamma=gamma, lam=lam))
    theirs_adv, theirs_ret = verl_gae(inp.token_rewards, values, mask, gamma, lam)
    on = mask > 0
    assert torch.allclose(ours_adv[on], theirs_adv[on], atol=1e-9)
    assert torch.allclose(ours_ret[on], theirs_ret[on], atol=1e-12)
    assert torch.equal(ours_adv[~on], torch.zeros_like(ours_adv[~on]))  # verl: left, masked


# -- the value loss ------------------------------------------------------------------------------
def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 0.5]])
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[0.9, 1.0, 0.6]])
    per_token, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # t0: V went past the return; clip(V) = .7 is farther from it: .5 * .2^2 (clipped wins)
    # t1: V = 0 is farther than clip(V) = .3: .5 * 1^2; t2: V = V_old: .5 * .1^2
    assert torch.allclose(per_token, torch.tensor([[0.02, 0.5, 0.005]]))
    assert clipped.tolist() == [[True, False, False]]


def test_explained_variance():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    # residuals 0, 0, 1 (mean 1/3, var 2/9) over returns of var 2/3
    values = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(1 - (2 / 9) / (2 / 3))
    assert explained_variance(values, torch.ones_like(returns), mask) == 0.0


# -- the critic ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny_policy(tokenizer, seed: int = 0) -> torch.nn.Module:
    cfg = ModelConfig(
        hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_positions=16, seed=seed
    )
    return build_tiny_model(cfg, tokenizer)


def batch_of_two():
    """A left-padded prompt and a right-padded response (row 1 is shorter in both)."""
    group = make_group(
        "run",
        "t",
        0,
        2,
        rewards=[1.0, 0.0],
        tokens=[[1, 5, 6, 7, 8, 9, 2], [5, 6, 7, 9]],
        prompt_length=4,
        logprobs=[[-0.5, -0.25, -0.1], [-0.5]],
        masks=[[1, 1, 1], [1]],
    )
    return group, collate(group.experiences, pad_id=0)


def test_the_value_of_a_token_is_the_value_of_the_prefix_before_it(tokenizer):
    torch.manual_seed(0)
    model = ValueModel.from_policy(tiny_policy(tokenizer))
    _, batch = batch_of_two()
    values = model(batch.input_ids, batch.attention_mask, batch.prompt_width)
    assert values.shape == batch.response_mask.shape == (2, 3)
    for row, length in ((0, 3), (1, 1)):
        ids = batch.input_ids[row][batch.attention_mask[row] > 0]
        for t in range(length):  # the state before response token t: prompt + t tokens
            prefix = ids[None, : 4 + t]
            hidden = model.backbone(input_ids=prefix).last_hidden_state[:, -1]
            expected = model.head(hidden).squeeze()
            assert torch.allclose(values[row, t], expected, atol=1e-5), (row, t)


def test_the_backbone_is_a_copy_and_the_head_starts_small(tokenizer):
    policy = tiny_policy(tokenizer)
    model = ValueModel.from_policy(policy)
    assert model.head.weight.detach().abs().max() < 0.1 and float(model.head.bias.detach()) == 0.0
    with torch.no_grad():
        next(model.backbone.parameters()).add_(1.0)
    assert not torch.equal(next(model.backbone.parameters()), next(policy.base_model.parameters()))


def critic_of(tokenizer, seed: int = 0) -> Critic:
    torch.manual_seed(seed)
    return Critic(
        ValueModel.from_policy(tiny_policy(tokenizer, seed)),
        TrainerConfig(ppo_epochs=2, grad_clip=1.0),
        lr=1e-2,
        value_clip=0.2,
        precision=FP32,
    )


def test_the_critic_learns_the_returns(tokenizer):
    critic = critic_of(tokenizer)
    _, batch = batch_of_two()
    returns = torch.tensor([[0.9, 0.95, 1.0], [0.3, 0.0, 0.0]]) * batch.response_mask
    losses = []
    for _ in range(15):
        old = critic.values(batch, [(0, 1), (1, 2)])
        assert torch.equal(old[1, 1:], torch.zeros(2))  # 0 off the mask
        metrics = critic.update(batch, [(0, 1), (1, 2)], old, returns, batch.response_mask)
        losses.append(metrics["train/value_loss"])
    assert losses[-1] < 0.1 * losses[0], losses
    error = (critic.values(batch, [(0, 2)]) - returns).abs() * batch.response_mask
    assert float(error.max()) < 0.2, error
    assert {"train/value_mean", "train/value_clipfrac", "train/value_grad_norm"} <= set(metrics)


def test_the_value_loss_is_the_same_however_the_batch_is_cut(tokenizer):
    _, batch = batch_of_two()
    returns = torch.tensor([[0.9, 0.95, 1.0], [0.3, 0.0, 0.0]])
    out = []
    for slices in ([(0, 2)], [(0, 1), (1, 2)]):
        critic = critic_of(tokenizer)
        old = critic.values(batch, slices)
        out.append(critic.update(batch, slices, old, returns, batch.response_mask))
    assert out[0]["train/value_loss"] == pytest.approx(out[1]["train/value_loss"], rel=1e-5)


def trained_critic(tokenizer, seed: int) -> Critic:
    critic = critic_of(tokenizer, seed)
    _, batch = batch_of_two()
    old = critic.values(batch, [(0, 2)])
    critic.update(batch, [(0, 2)], old, torch.ones_like(old), batch.response_mask)
    return critic


def opt_state(opt: torch.optim.Optimizer) -> dict:
    return opt.state_dict()


def test_checkpoint_round_trip_of_the_critic(tokenizer, tmp_path):
    policy = tiny_policy(tokenizer)
    policy_opt = torch.optim.AdamW(policy.parameters())
    critic = trained_critic(tokenizer, seed=0)
    path = save_checkpoint(
        tmp_path, TrainerState(step=3), policy, policy_opt, 2, {"critic": critic.model_pair()}
    )
    assert {"critic.safetensors", "critic_optimizer.safetensors", "critic_optimizer.json"} <= {
        p.name for p in path.iterdir()
    }
    other = critic_of(tokenizer, seed=1)  # different weights, empty optimizer state
    load_checkpoint(path, policy, policy_opt, {"critic": other.model_pair()})
    for (name, a), (_, b) in zip(
        critic.model.state_dict().items(), other.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    saved, loaded = opt_state(critic.optimizer), opt_state(other.optimizer)
    for group in (*saved["param_groups"], *loaded["param_groups"]):
        group["betas"] = tuple(group["betas"])  # a list after JSON
    assert saved["param_groups"] == loaded["param_groups"]
    assert saved["state"].keys() == loaded["state"].keys() and saved["state"]
    for pid, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][pid][key]))


def test_a_checkpoint_without_a_critic_leaves_the_fresh_one(tokenizer, tmp_path, caplog):
    policy = tiny_policy(tokenizer)
    policy_opt = torch.optim.AdamW(policy.parameters())
    path = save_checkpoint(tmp_path, TrainerState(step=1), policy, policy_opt, 2)
    critic = critic_of(tokenizer)
    before = {k: v.clone() for k, v in critic.model.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        load_checkpoint(path, policy, policy_opt, {"critic": critic.model_pair()})
    assert "holds no critic" in caplog.text
    assert all(torch.equal(before[k], v) for k, v in critic.model.state_dict().items())


def test_a_damaged_critic_file_is_a_checkpoint_error_and_nothing_changes(tokenizer, tmp_path):
    policy = tiny_policy(tokenizer)
    policy_opt = torch.optim.AdamW(policy.parameters())
    critic = trained_critic(tokenizer, seed=0)
    pair = {"critic": critic.model_pair()}
    path = save_checkpoint(tmp_path, TrainerState(step=1), policy, policy_opt, 2, pair)
    (path / "critic_optimizer.safetensors").write_bytes(b"\xff" * 64)
    fresh = tiny_policy(tokenizer, seed=5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError):
        load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()), pair)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


# -- the engine ----------------------------------------------------------------------------------
def ppo_engine(tmp_path, **algorithm) -> TorchTrainEngine:
    engine = TorchTrainEngine(learning_config({"type": "ppo", **algorithm}))
    engine.ckpt_root = tmp_path / "checkpoints"
    engine.prepare()
    return engine


def test_the_engine_trains_and_checkpoints_its_critic(tmp_path):
    engine = ppo_engine(tmp_path, critic_lr=1e-3)
    assert engine.critic is not None
    group, _ = batch_of_two()
    metrics = engine.train_step([group, make_group("run", "u", 0, 2)], version=0)
    for key in ("train/value_loss", "train/value_explained_var", "train/value_mean"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["train/advantage_abs_mean"] > 0
    engine.save(TrainerState(step=1))
    again = ppo_engine(tmp_path / "other", critic_lr=1e-3)
    assert again.critic is not None
    first = next(iter(engine.critic.model.state_dict().values()))
    assert not torch.equal(first, next(iter(again.critic.model.state_dict().values())))
    again.load(engine.latest())
    for a, b in zip(
        engine.critic.model.state_dict().values(),
        again.critic.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_with_lora_the_critic_is_a_full_copy_of_the_base(tmp_path):
    cfg = learning_config({"type": "ppo"})
    lora = msgspec.structs.replace(cfg.model.lora, enabled=True, rank=2)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, lora=lora))
    engine = TorchTrainEngine(cfg)
    base = sum(p.numel() for p in engine.model.base_model.parameters())
    engine.prepare()
    assert engine.critic is not None
    critic_params = list(engine.critic.model.backbone.parameters())
    assert sum(p.numel() for p in critic_params) == base
    assert all(p.requires_grad for p in critic_params)
    before = [p.detach().clone() for p in critic_params]
    metrics = engine.train_step([make_group("run", "u", 0, 2)], version=0)
    assert "train/value_loss" in metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, critic_params, strict=True))


def test_no_critic_without_gae(tmp_path):
    engine = TorchTrainEngine(learning_config({"type": "grpo"}))
    engine.prepare()
    assert engine.critic is None and engine._extras() == {}


# -- config ---------------------------------------------------------------------------------------
def test_the_ppo_preset():
    algo = resolve_algorithm(Config(algorithm=AlgorithmConfig(type="ppo")))
    assert algo.advantage is gae_advantages and algo.policy_loss is ppo_clip
    assert algo.spec.needs_critic and not algo.spec.needs_reference
    assert (algo.spec.gamma, algo.spec.lam, algo.spec.value_clip) == (1.0, 0.95, 0.2)
    assert "1707.06347" in ALGORITHMS["ppo"].source
    assert not resolve_algorithm(Config()).spec.needs_critic
    custom = AlgorithmConfig(type="ppo", gamma=0.99, lam=1.0, critic_lr=3e-5, value_clip=0.5)
    s = resolve_algorithm(Config(algorithm=custom)).spec
    assert (s.gamma, s.lam, s.critic_lr, s.value_clip) == (0.99, 1.0, 3e-5, 0.5)
    # any preset with the gae advantage trains a critic
    assert AlgorithmSpec(advantage_fn="gae").needs_critic


@pytest.mark.parametrize("trainer", [{"engine": "fsdp2"}, {"nproc": 2}])
def test_ppo_is_refused_by_the_sharded_engine(trainer):
    cfg = Config(trainer=TrainerConfig(**trainer), algorithm=AlgorithmConfig(type="ppo"))
    with pytest.raises(ConfigError, match=r"trainer\.engine.*gae.*not support"):
        resolve_algorithm(cfg)
    resolve_algorithm(Config(trainer=TrainerConfig(**trainer)))  # grpo is fine


@pytest.mark.parametrize(
    ("field", "value"),
    [("gamma", 1.5), ("lam", -0.1), ("critic_lr", 0.0), ("value_clip", -1.0)],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        from_dict({"taskset": {"path": "x.jsonl"}, "algorithm": {"type": "ppo", field: value}})
