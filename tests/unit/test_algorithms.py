"""Algorithm registries and the policy step built from them.

The step must give the numbers the 91-line ``grpo_step`` gave before it was split into
parts: a frozen copy of that function and of the math it called (as of commit a9afc63,
verbatim but for docstrings and ``float(kl.detach())`` for ``float(kl)``, the same value
without a warning) is kept below, and every scenario compares metrics and updated weights
for exact equality.
"""

from __future__ import annotations

import typing

import msgspec
import pytest
import torch

from streamrft.consumers.algorithms import (
    ADVANTAGES,
    ALGORITHMS,
    KL_LOSSES,
    LOSS_AGG,
    POLICY_LOSSES,
    Algorithm,
    policy_step,
    resolve_algorithm,
)
from streamrft.consumers.algorithms.advantages import grpo_advantages
from streamrft.consumers.algorithms.aggregation import token_mean
from streamrft.consumers.algorithms.kl_losses import kl_k3
from streamrft.consumers.algorithms.policy_losses import ppo_clip
from streamrft.consumers.batching import collate, response_logprobs
from streamrft.infra.config import ModelConfig, TrainerConfig, from_dict
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup, Task

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

TINY = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_positions=32
)


# -- the step as it was (frozen; do not edit) ------------------------------------------------


def _old_group_advantages(rewards, eps=1e-6, std_normalize=True):
    mean = rewards.mean(dim=1, keepdim=True)
    centred = rewards - mean
    if not std_normalize or rewards.shape[1] < 2:
        return centred
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return centred / (std + eps)


def _old_aggregate(values, mask, mode):
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    per_seq = (values * mask).sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=1).clamp_min(1.0)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    has_tokens = (mask.sum(dim=1) > 0).to(values.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)


def _old_clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg):
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = _old_aggregate(per_token, mask, agg)
    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        n = m.sum().clamp_min(1.0)
        clip_frac = (((unclipped > clipped).to(m.dtype)) * m).sum() / n
        approx_kl = ((0.5 * log_ratio**2) * m).sum() / n
    return loss, {"clip_frac": float(clip_frac), "approx_kl_old": float(approx_kl)}


def _old_kl_k3(logprobs, ref_logprobs):
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1.0


def _old_grpo_step(model, optimizer, groups, cfg, pad_id, temperature, ref_model=None):
    sizes = {len(g.experiences) for g in groups}
    experiences = [e for g in groups for e in g.experiences]
    batch = collate(experiences, pad_id)
    if len(sizes) == 1:
        adv = _old_group_advantages(
            batch.rewards.view(len(groups), -1), std_normalize=cfg.std_normalize
        ).view(-1)
    else:
        parts, start = [], 0
        for g in groups:
            n = len(g.experiences)
            parts.append(
                _old_group_advantages(
                    batch.rewards[start : start + n].view(1, -1), std_normalize=cfg.std_normalize
                ).view(-1)
            )
            start += n
        adv = torch.cat(parts)
    token_adv = adv[:, None].expand_as(batch.old_logprobs)
    ref_logp = None
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref_logp = response_logprobs(
                ref_model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature
            )
    n = len(experiences)
    micro = cfg.micro_batch_size or n
    model.train()
    stats: dict[str, float] = {}
    first_logp_diff = 0.0
    for epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for lo in range(0, n, micro):
            sl = slice(lo, lo + micro)
            logp = response_logprobs(
                model,
                batch.input_ids[sl],
                batch.attention_mask[sl],
                batch.prompt_width,
                temperature,
            )
            mask = batch.response_mask[sl]
            loss, info = _old_clipped_surrogate(
                logp,
                batch.old_logprobs[sl],
                token_adv[sl],
                mask,
                cfg.clip_low,
                cfg.clip_high,
                cfg.loss_agg_mode,
            )
            if ref_logp is not None:
                kl = _old_aggregate(_old_kl_k3(logp, ref_logp[sl]), mask, cfg.loss_agg_mode)
                loss = loss + cfg.kl_coef * kl
                info["kl_ref"] = float(kl.detach())
            (loss * (min(lo + micro, n) - lo) / n).backward()
            if epoch == 0:
                with torch.no_grad():
                    diff = ((logp - batch.old_logprobs[sl]).abs() * mask).max()
                first_logp_diff = max(first_logp_diff, float(diff))
            for k, v in {"loss": float(loss.detach()), **info}.items():
                stats[k] = stats.get(k, 0.0) + v * (min(lo + micro, n) - lo) / n / cfg.ppo_epochs
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if cfg.grad_clip > 0
            else torch.sqrt(
                sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None)
            )
        )
        optimizer.step()
    model.eval()
    mask = batch.response_mask
    return {
        **{f"train/{k}": v for k, v in stats.items()},
        "train/grad_norm": float(grad_norm),
        "train/reward_mean": float(batch.rewards.mean()),
        "train/advantage_abs_mean": float(adv.abs().mean()),
        "train/response_length": float(mask.sum(1).mean()),
        "train/logprob_max_abs_diff": first_logp_diff,
        "train/groups": float(len(groups)),
    }


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny_model(tokenizer, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_tiny_model(TINY, tokenizer)


def length_reward(text: str, task: Task) -> tuple[float, dict[str, float]]:
    """Rewards that differ within a group on an untrained model (exact match would be all 0)."""
    return float(len(text) % 3), {}


@pytest.fixture(scope="module")
def groups(tokenizer) -> list[ExperienceGroup]:
    tasks = [Task(id=f"t{i}", prompt=f"{i}+{i + 3}=", answer=str(2 * i + 3)) for i in range(4)]
    engine = TransformersEngine(tiny_model(tokenizer, 0).eval(), tokenizer)
    spec = RolloutSpec(
        repeat_times=4,
        temperature=1.0,
        max_new_tokens=6,
        seed=7,
        run="r",
        explorer="e",
        model_version=0,
    )
    return get_workflow("math")(engine, tasks, length_reward, spec)


def unequal(groups: list[ExperienceGroup]) -> list[ExperienceGroup]:
    """Groups of 2, 3, 4 and 2 rollouts (some were dropped on the way)."""
    return [
        msgspec.structs.replace(g, experiences=g.experiences[: 2 + i % 3])
        for i, g in enumerate(groups)
    ]


def run_step(step, tokenizer, groups, cfg, with_ref):
    model = tiny_model(tokenizer, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = tiny_model(tokenizer, 2).eval() if with_ref else None
    stats = step(model, optimizer, groups, cfg, tokenizer.pad_token_id, 1.0, ref)
    return stats, model


SCENARIOS = {
    "defaults": (False, TrainerConfig(), False),
    "kl_micro_epochs": (
        False,
        TrainerConfig(
            ppo_epochs=2,
            micro_batch_size=5,
            kl_coef=0.1,
            loss_agg_mode="seq-mean-token-mean",
            std_normalize=False,
            clip_low=0.1,
            clip_high=0.3,
        ),
        True,
    ),
    "unequal_groups_no_grad_clip": (
        True,
        TrainerConfig(
            grad_clip=0.0, loss_agg_mode="seq-mean-token-sum", ppo_epochs=3, micro_batch_size=3
        ),
        False,
    ),
}


# -- the step --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_policy_step_gives_exactly_the_old_grpo_step_numbers(tokenizer, groups, name):
    uneven, cfg, with_ref = SCENARIOS[name]
    batch = unequal(groups) if uneven else groups
    old_stats, old_model = run_step(_old_grpo_step, tokenizer, batch, cfg, with_ref)
    new_stats, new_model = run_step(policy_step, tokenizer, batch, cfg, with_ref)
    rows = sum(len(g.experiences) for g in batch)
    micro = cfg.micro_batch_size or rows
    assert new_stats.pop("train/micro_batches") == -(-rows // micro)
    assert list(new_stats) == list(old_stats)
    assert new_stats == old_stats  # exact, not approximate
    old_params = dict(old_model.named_parameters())
    for pname, p in new_model.named_parameters():
        assert torch.equal(p, old_params[pname]), pname
    # the scenario exercises what it is meant to: a signal, a KL term, clipping
    assert new_stats["train/advantage_abs_mean"] > 0
    assert ("train/kl_ref" in new_stats) == with_ref
    if cfg.ppo_epochs > 1:
        assert new_stats["train/clip_frac"] > 0


def test_registering_an_advantage_is_one_line_and_the_step_uses_it(tokenizer, groups):
    def constant(rewards, group_sizes, cfg):
        return torch.full_like(rewards, 0.25)

    cfg = TrainerConfig(advantage_fn="constant")
    ADVANTAGES["constant"] = constant
    try:
        stats, _ = run_step(policy_step, tokenizer, groups, cfg, False)
    finally:
        del ADVANTAGES["constant"]
    assert stats["train/advantage_abs_mean"] == 0.25
    # on-policy (ratio 1 up to numerics), token-mean: the loss is minus the advantage
    assert stats["train/loss"] == pytest.approx(-0.25, abs=1e-5)
    grpo_stats, _ = run_step(policy_step, tokenizer, groups, TrainerConfig(), False)
    assert grpo_stats["train/advantage_abs_mean"] != 0.25
    with pytest.raises(ConfigError, match=r"^trainer\.advantage_fn: unknown name 'constant'"):
        resolve_algorithm(cfg)


def test_registering_an_algorithm_preset():
    ALGORITHMS["plain_pg"] = Algorithm(advantage="grpo", policy_loss="ppo_clip", kl_loss="k3")
    try:
        assert resolve_algorithm(TrainerConfig(algorithm="plain_pg")).name == "plain_pg"
    finally:
        del ALGORITHMS["plain_pg"]


# -- resolving config names ------------------------------------------------------------------


def test_grpo_preset_resolves_to_todays_parts():
    algo = resolve_algorithm(TrainerConfig())
    assert algo.name == "grpo"
    assert algo.advantage is grpo_advantages
    assert algo.policy_loss is ppo_clip
    assert algo.kl_loss is kl_k3
    assert algo.aggregate is token_mean
    assert ALGORITHMS["grpo"] == Algorithm(advantage="grpo", policy_loss="ppo_clip", kl_loss="k3")


def test_overrides_pick_registered_parts():
    explicit = TrainerConfig(advantage_fn="grpo", policy_loss_fn="ppo_clip", kl_loss_fn="k3")
    assert resolve_algorithm(explicit) == resolve_algorithm(TrainerConfig())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"algorithm": "ppo"}, r"^trainer\.algorithm: unknown name 'ppo'; known: grpo$"),
        ({"advantage_fn": "gae"}, r"^trainer\.advantage_fn: unknown name 'gae'; known: grpo$"),
        (
            {"policy_loss_fn": "gspo"},
            r"^trainer\.policy_loss_fn: unknown name 'gspo'; known: ppo_clip$",
        ),
        ({"kl_loss_fn": "k2"}, r"^trainer\.kl_loss_fn: unknown name 'k2'; known: k3$"),
        (
            {"loss_agg_mode": "seq-sum"},
            r"^trainer\.loss_agg_mode: unknown name 'seq-sum'; known: token-mean, "
            r"seq-mean-token-mean, seq-mean-token-sum$",
        ),
    ],
)
def test_unknown_names_are_config_errors_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_algorithm(TrainerConfig(**overrides))


def test_a_preset_naming_an_unregistered_part_says_which_algorithm(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "broken", Algorithm("grpo", "nope", "k3"))
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.policy_loss_fn: unknown name 'nope' \(trainer\.algorithm 'broken'\)",
    ):
        resolve_algorithm(TrainerConfig(algorithm="broken"))


def test_config_takes_any_algorithm_name_and_leaves_the_check_to_the_trainer():
    cfg = from_dict(
        {
            "taskset": {"path": "tasks.jsonl"},
            "trainer": {"algorithm": "dapo", "advantage_fn": "grpo", "kl_loss_fn": None},
        }
    )
    assert cfg.trainer.algorithm == "dapo"
    assert cfg.trainer.advantage_fn == "grpo"
    assert cfg.trainer.policy_loss_fn is None
    with pytest.raises(ConfigError, match=r"^trainer\.algorithm: unknown name 'dapo'"):
        resolve_algorithm(cfg.trainer)


def test_loss_agg_registry_matches_the_config_choices():
    hints = typing.get_type_hints(TrainerConfig)
    assert set(typing.get_args(hints["loss_agg_mode"])) == set(LOSS_AGG)


def test_registries_hold_todays_parts():
    assert list(ADVANTAGES) == ["grpo"]
    assert list(POLICY_LOSSES) == ["ppo_clip"]
    assert list(KL_LOSSES) == ["k3"]
    assert list(LOSS_AGG) == ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
