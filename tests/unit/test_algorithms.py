"""Algorithm registries and the policy step built from them.

The step must give the numbers the 91-line ``grpo_step`` gave before it was split into
parts: a frozen copy of that function and of the math it called (as of commit a9afc63,
verbatim but for docstrings and ``float(kl.detach())`` for ``float(kl)``, the same value
without a warning) is kept below, and every scenario compares metrics and updated weights
for exact equality. The frozen step reads the fields that have since moved from
``trainer`` to ``algorithm`` through a view (:func:`old_trainer_config`); the one metric
whose definition changed since (``train/advantage_abs_mean``, now over trained tokens) is
checked against its new definition computed from the frozen math.
"""

from __future__ import annotations

import math
import re
import types
import typing

import msgspec
import pytest
import torch

from streamrft.consumers.algorithms import (
    ADVANTAGES,
    ALGORITHMS,
    CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_AGG,
    POLICY_LOSSES,
    AlgorithmSpec,
    Preset,
    policy_step,
    resolve_algorithm,
)
from streamrft.consumers.algorithms.advantages import grpo_advantages
from streamrft.consumers.algorithms.aggregation import token_mean
from streamrft.consumers.algorithms.kl import kl_k1, kl_k3
from streamrft.consumers.algorithms.policy_losses import ppo_clip
from streamrft.consumers.batching import collate, response_logprobs
from streamrft.infra.config import (
    MOVED_FIELDS,
    AlgorithmConfig,
    Config,
    ExplorerConfig,
    ModelConfig,
    TrainerConfig,
    from_dict,
)
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas.arrays import unpack_u8
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup, Task

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
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


def config(algorithm: AlgorithmConfig | None = None, **trainer) -> Config:
    """A config of these trainer fields and this algorithm section."""
    return Config(trainer=TrainerConfig(**trainer), algorithm=algorithm or AlgorithmConfig())


def old_trainer_config(cfg: Config) -> types.SimpleNamespace:
    """The ``trainer`` section the frozen step reads: today's trainer fields plus the ones
    that moved to ``algorithm.*`` (``kl_coef`` is today's ``kl_loss_coef``), as the
    resolved algorithm settles them."""
    spec = resolve_algorithm(cfg).spec
    return types.SimpleNamespace(
        **msgspec.structs.asdict(cfg.trainer),
        kl_coef=spec.kl_loss_coef,
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        loss_agg_mode=spec.loss_agg_mode,
        std_normalize=spec.std_normalize,
    )


def old_step(model, optimizer, groups, cfg: Config, pad_id, temperature, ref_model):
    return _old_grpo_step(
        model, optimizer, groups, old_trainer_config(cfg), pad_id, temperature, ref_model
    )


def new_step(model, optimizer, groups, cfg: Config, pad_id, temperature, ref_model):
    algo = resolve_algorithm(cfg)
    return policy_step(model, optimizer, groups, cfg.trainer, algo, pad_id, temperature, ref_model)


def token_weighted_abs_advantage(groups: list[ExperienceGroup], cfg: Config) -> float:
    """The old step's per-rollout advantages (its own math), their absolute values averaged
    over the trained tokens: ``train/advantage_abs_mean`` as the step reports it now."""
    batch = collate([e for g in groups for e in g.experiences], 0)
    std = old_trainer_config(cfg).std_normalize
    adv = torch.cat(
        [
            _old_group_advantages(r.view(1, -1), std_normalize=std).view(-1)
            for r in torch.split(batch.rewards, [len(g.experiences) for g in groups])
        ]
    )
    tokens = batch.response_mask.sum(1)
    return float((adv.abs() * tokens).sum() / tokens.sum())


def run_step(step, tokenizer, groups, cfg: Config, with_ref):
    model = tiny_model(tokenizer, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = tiny_model(tokenizer, 2).eval() if with_ref else None
    stats = step(model, optimizer, groups, cfg, tokenizer.pad_token_id, 1.0, ref)
    return stats, model


SCENARIOS = {
    "defaults": (False, config(), False),
    "kl_micro_epochs": (
        False,
        config(
            AlgorithmConfig(
                kl_loss_coef=0.1,
                loss_agg_mode="seq-mean-token-mean",
                std_normalize=False,
                clip_low=0.1,
                clip_high=0.3,
            ),
            ppo_epochs=2,
            micro_batch_size=5,
        ),
        True,
    ),
    "unequal_groups_no_grad_clip": (
        True,
        config(
            AlgorithmConfig(loss_agg_mode="seq-mean-token-sum"),
            grad_clip=0.0,
            ppo_epochs=3,
            micro_batch_size=3,
        ),
        False,
    ),
}


# -- the step --------------------------------------------------------------------------------

SAME_STEP_REL = 1e-5
"""How close the step's numbers (relative) and parameters (absolute, after one AdamW step
at lr 1e-2) are to the frozen old step's. Both compute the same float32 math, bit for bit
on AMD EPYC's default kernels, but their micro-batches are padded to other widths, and
on MKL's portable code path (``MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default``, as on
other CPUs) the matmuls of other shapes round differently: 2.0e-7 relative, 1.8e-7 on a
parameter. Changing ``kl_loss_coef`` by 1% (0.1 to 0.099) moves them by 3.3e-4 and
1.8e-4, 33 and 17 times this tolerance."""


@pytest.mark.parametrize("name", SCENARIOS)
def test_policy_step_gives_the_old_grpo_step_numbers(tokenizer, groups, name):
    uneven, cfg, with_ref = SCENARIOS[name]
    batch = unequal(groups) if uneven else groups
    old_stats, old_model = run_step(old_step, tokenizer, batch, cfg, with_ref)
    new_stats, new_model = run_step(new_step, tokenizer, batch, cfg, with_ref)
    rows = sum(len(g.experiences) for g in batch)
    micro = cfg.trainer.micro_batch_size or rows
    assert new_stats.pop("train/micro_batches") == -(-rows // micro)
    # what the step reports beside the old step's metrics
    truncated = [e.info.get("truncated", 0.0) for g in batch for e in g.experiences]
    assert new_stats.pop("train/truncated_share") == pytest.approx(sum(truncated) / rows)
    lengths = sorted(sum(unpack_u8(e.action_mask)) for g in batch for e in g.experiences)
    assert new_stats.pop("train/response_length_max") == lengths[-1]
    p50, p90 = (
        new_stats.pop("train/response_length_p50"),
        new_stats.pop("train/response_length_p90"),
    )
    assert lengths[0] <= p50 <= p90 <= lengths[-1]
    assert 0 < new_stats.pop("train/entropy") < math.log(len(tokenizer))
    assert list(new_stats) == list(old_stats)
    # the one metric whose definition changed: the mean |advantage| over trained tokens
    # (each rollout weighed by its trained tokens), where the old step took it per rollout
    old_adv = old_stats.pop("train/advantage_abs_mean")
    new_adv = new_stats.pop("train/advantage_abs_mean")
    assert new_adv == pytest.approx(token_weighted_abs_advantage(batch, cfg), rel=1e-6)
    assert new_stats == pytest.approx(old_stats, rel=SAME_STEP_REL, abs=1e-12)
    old_params = dict(old_model.named_parameters())
    for pname, p in new_model.named_parameters():
        torch.testing.assert_close(p, old_params[pname], rtol=0, atol=SAME_STEP_REL, msg=pname)
    # the scenario exercises what it is meant to: a signal, a KL term, clipping
    assert new_adv > 0 and old_adv > 0
    assert ("train/kl_ref" in new_stats) == with_ref
    if cfg.trainer.ppo_epochs > 1:
        assert new_stats["train/clip_frac"] > 0


@pytest.mark.parametrize(
    ("epochs", "mode", "uneven"),
    [(1, "token-mean", False), (2, "seq-mean-token-sum", True), (2, "token-mean", True)],
)
def test_two_mini_batches_are_two_optimizer_steps_by_hand(tokenizer, groups, epochs, mode, uneven):
    """``trainer.mini_batch_size`` 2 on 4 groups: each pass makes two updates, each on
    two groups with its loss normalised over them alone, accumulated over micro-batches of
    3 rows. The frozen step of the old code (an independent transcription of the GRPO
    math) taken on the first two groups whole, then on the last two, pass after pass,
    ends with the same weights; and with
    ``mini_batch_size`` equal to the batch the step is bit for bit today's."""
    batch = unequal(groups) if uneven else groups
    algo = AlgorithmConfig(loss_agg_mode=mode)
    split = config(algo, ppo_epochs=epochs, mini_batch_size=2, micro_batch_size=3)
    by_hand = config(algo, ppo_epochs=1)  # each mini-batch in one pass
    # plain SGD: each update is the gradient itself (Adam's g / sqrt(v) would turn the
    # float32 noise of near-zero gradients, summed in another order, into whole steps)
    model = tiny_model(tokenizer, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = new_step(model, optimizer, batch, split, tokenizer.pad_token_id, 1.0, None)
    hand = tiny_model(tokenizer, 1)
    hand_optimizer = torch.optim.SGD(hand.parameters(), lr=0.5)
    for _ in range(epochs):
        for part in (batch[:2], batch[2:]):
            old_step(hand, hand_optimizer, part, by_hand, tokenizer.pad_token_id, 1.0, None)
    hand_params = dict(hand.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, hand_params[name], rtol=0, atol=SAME_STEP_REL, msg=name)
    assert stats["train/clip_frac"] > 0 or epochs == 1  # later updates moved off the rollout
    # a single update on the whole batch (today's step): the same as mini_batch_size 0
    whole, today = (config(algo, mini_batch_size=n, ppo_epochs=epochs) for n in (4, 0))
    a, b = (run_step(new_step, tokenizer, batch, c, False)[1] for c in (whole, today))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    # and the split step is not the whole-batch one: the test can tell them apart
    whole_sgd = tiny_model(tokenizer, 1)
    one = config(algo, ppo_epochs=epochs, micro_batch_size=3)
    pad = tokenizer.pad_token_id
    new_step(whole_sgd, torch.optim.SGD(whole_sgd.parameters(), lr=0.5), batch, one, pad, 1.0, None)
    far = max(
        float((p - q).abs().max())
        for p, q in zip(model.parameters(), whole_sgd.parameters(), strict=True)
    )
    assert far > 100 * SAME_STEP_REL


def test_mini_batches_are_refused_where_the_loss_needs_the_whole_batch():
    for algorithm, what in (
        (AlgorithmConfig(type="dpo"), "DPO"),
        (AlgorithmConfig(type="chord", expert_data="x.jsonl"), "mix"),
    ):
        with pytest.raises(ConfigError, match=f"trainer.mini_batch_size: .*{what}"):
            resolve_algorithm(config(algorithm, mini_batch_size=2, batch_size=8))


def test_registering_an_advantage_is_one_line_and_the_step_uses_it(tokenizer, groups):
    def constant(inp, spec):
        return torch.full_like(inp.mask, 0.25, dtype=inp.rewards.dtype)

    cfg = config(AlgorithmConfig(advantage_fn="constant"))
    ADVANTAGES["constant"] = constant
    try:
        stats, _ = run_step(new_step, tokenizer, groups, cfg, False)
    finally:
        del ADVANTAGES["constant"]
    assert stats["train/advantage_abs_mean"] == 0.25
    # on-policy (ratio 1 up to numerics), token-mean: the loss is minus the advantage
    assert stats["train/loss"] == pytest.approx(-0.25, abs=1e-5)
    grpo_stats, _ = run_step(new_step, tokenizer, groups, config(), False)
    assert grpo_stats["train/advantage_abs_mean"] != 0.25
    with pytest.raises(ConfigError, match=r"^algorithm\.advantage_fn: unknown name 'constant'"):
        resolve_algorithm(cfg)


def test_registering_an_algorithm_preset():
    ALGORITHMS["plain_pg"] = Preset("a test", {"advantage_fn": "rloo", "clip_high": 0.3})
    try:
        algo = resolve_algorithm(config(AlgorithmConfig(type="plain_pg")))
    finally:
        del ALGORITHMS["plain_pg"]
    assert algo.name == "plain_pg"
    assert algo.advantage is ADVANTAGES["rloo"]
    assert algo.spec.clip_high == 0.3
    assert algo.spec.clip_low == AlgorithmSpec().clip_low  # left unsaid: the default


# -- resolving config names ------------------------------------------------------------------


def test_grpo_preset_resolves_to_todays_parts():
    algo = resolve_algorithm(config())
    assert algo.name == "grpo"
    assert algo.advantage is grpo_advantages
    assert algo.policy_loss is ppo_clip
    assert algo.kl_penalty is kl_k1
    assert algo.kl_loss is kl_k3
    assert algo.aggregate is token_mean
    assert ALGORITHMS["grpo"].parts == {"advantage_fn": "grpo", "policy_loss_fn": "ppo_clip"}
    # every other setting is the spec's default; the length bound is the explorer's
    longest = Config().explorer.max_new_tokens
    assert algo.spec == AlgorithmSpec(name="grpo", norm_length=longest, max_new_tokens=longest)
    assert not algo.spec.needs_reference and not algo.spec.needs_proximal


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_preset_resolves_to_its_parts(name):
    preset = ALGORITHMS[name]
    assert preset.source
    # a distillation preset needs its teacher's folder (checked, not loaded, here)
    teacher = {"teacher_path": "teacher"} if preset.parts.get("advantage_fn") == "distill" else {}
    algo = resolve_algorithm(config(AlgorithmConfig(type=name, **teacher)))
    assert algo.name == name
    for key, value in preset.parts.items():
        assert getattr(algo.spec, key) == value, key
    assert algo.advantage is ADVANTAGES[algo.spec.advantage_fn]
    assert algo.policy_loss is POLICY_LOSSES[algo.spec.policy_loss_fn]
    assert algo.kl_penalty is KL_ESTIMATORS[algo.spec.kl_penalty_fn]
    assert algo.kl_loss is KL_ESTIMATORS[algo.spec.kl_loss_fn]
    values = torch.tensor([[1.0, 2.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    expected = LOSS_AGG[algo.spec.loss_agg_mode](values, mask)
    if algo.spec.loss_agg_mode == "seq-mean-token-sum-norm":
        expected = expected / algo.spec.norm_length
    assert float(algo.aggregate(values, mask)) == pytest.approx(float(expected))


def test_presets_set_what_their_papers_say():
    def spec_of(name: str) -> AlgorithmSpec:
        return resolve_algorithm(config(AlgorithmConfig(type=name))).spec

    spec = {name: spec_of(name) for name in ALGORITHMS if name != "on_policy_distill"}
    assert not spec["dr_grpo"].std_normalize
    assert spec["dr_grpo"].loss_agg_mode == "seq-mean-token-sum-norm"
    assert (spec["dapo"].clip_low, spec["dapo"].clip_high) == (0.2, 0.28)
    assert spec["dapo"].dynamic_sampling
    assert spec["gspo"].policy_loss_fn == "gspo"
    assert spec["cispo"].policy_loss_fn == "cispo"
    assert spec["rloo"].advantage_fn == "rloo"
    assert spec["reinforce_plus_plus"].kl_penalty_coef > 0  # KL in the reward
    assert spec["reinforce_plus_plus"].needs_reference
    assert spec["reinforce_plus_plus_baseline"].kl_loss_coef > 0  # KL in the loss
    assert spec["opmd"].policy_loss_fn == spec["opmd"].advantage_fn == "opmd"
    assert (spec["sft"].advantage_fn, spec["sft"].policy_loss_fn) == ("none", "sft")


def test_overrides_pick_registered_parts():
    explicit = AlgorithmConfig(advantage_fn="grpo", policy_loss_fn="ppo_clip", kl_loss_fn="k3")
    assert resolve_algorithm(config(explicit)) == resolve_algorithm(config())


def test_overrides_replace_the_presets_parts_and_values():
    cfg = config(
        AlgorithmConfig(
            type="gspo",
            advantage_fn="rloo",
            policy_loss_fn="cispo",
            kl_penalty_fn="abs",
            kl_loss_fn="low_var_kl",
            kl_loss_coef=0.01,
            loss_agg_mode="seq-mean-token-sum-norm",
            norm_length=64,
            clip_high=0.5,
            std_normalize=False,
            off_policy_correction="masked_is_token",
        )
    )
    algo = resolve_algorithm(cfg)
    assert algo.name == "gspo"
    assert algo.advantage is ADVANTAGES["rloo"]
    assert algo.policy_loss is POLICY_LOSSES["cispo"]
    assert algo.kl_penalty is KL_ESTIMATORS["abs"]
    assert algo.kl_loss is KL_ESTIMATORS["low_var_kl"]
    spec = algo.spec
    assert (spec.clip_low, spec.clip_high) == (ALGORITHMS["gspo"].parts["clip_low"], 0.5)
    assert (spec.kl_loss_coef, spec.std_normalize, spec.norm_length) == (0.01, False, 64)
    assert spec.needs_reference and spec.needs_proximal
    # the aggregation is bound to the given length, not explorer.max_new_tokens
    values, mask = torch.tensor([[2.0, 6.0]]), torch.ones(1, 2)
    assert float(algo.aggregate(values, mask)) == pytest.approx(8.0 / 64)


def test_the_norm_length_defaults_to_the_explorers_max_new_tokens():
    cfg = Config(
        explorer=ExplorerConfig(max_new_tokens=40), algorithm=AlgorithmConfig(type="dr_grpo")
    )
    algo = resolve_algorithm(cfg)
    assert algo.spec.norm_length == 40
    values, mask = torch.tensor([[2.0, 6.0]]), torch.ones(1, 2)
    assert float(algo.aggregate(values, mask)) == pytest.approx(8.0 / 40)


def _known(registry) -> str:
    return ", ".join(registry)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"type": "trpo"}, rf"^algorithm\.type: unknown name 'trpo'; known: {_known(ALGORITHMS)}$"),
        (
            {"advantage_fn": "vtrace"},
            rf"^algorithm\.advantage_fn: unknown name 'vtrace'; known: {_known(ADVANTAGES)}$",
        ),
        (
            {"policy_loss_fn": "kto"},
            rf"^algorithm\.policy_loss_fn: unknown name 'kto'; known: {_known(POLICY_LOSSES)}$",
        ),
        (
            {"kl_loss_fn": "k4"},
            rf"^algorithm\.kl_loss_fn: unknown name 'k4'; known: {_known(KL_ESTIMATORS)}$",
        ),
        (
            {"kl_penalty_fn": "mse"},
            rf"^algorithm\.kl_penalty_fn: unknown name 'mse'; known: {_known(KL_ESTIMATORS)}$",
        ),
        (
            {"loss_agg_mode": "seq-sum"},
            r"^algorithm\.loss_agg_mode: unknown name 'seq-sum'; known: token-mean, "
            r"seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm$",
        ),
    ],
)
def test_unknown_names_are_config_errors_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_algorithm(config(AlgorithmConfig(**overrides)))


@pytest.mark.parametrize(
    ("part", "field"),
    [
        ({"advantage_fn": "nope"}, "advantage_fn"),
        ({"policy_loss_fn": "nope"}, "policy_loss_fn"),
        ({"kl_penalty_fn": "nope"}, "kl_penalty_fn"),
        ({"kl_loss_fn": "nope"}, "kl_loss_fn"),
    ],
)
def test_a_preset_naming_an_unregistered_part_says_which_algorithm(monkeypatch, part, field):
    monkeypatch.setitem(ALGORITHMS, "broken", Preset("a test", part))
    with pytest.raises(
        ConfigError,
        match=rf"^algorithm\.{field}: unknown name 'nope' \(algorithm\.type 'broken'\); known: ",
    ):
        resolve_algorithm(config(AlgorithmConfig(type="broken")))
    # a name given in the config is the config's: no preset named in the message
    with pytest.raises(ConfigError, match=rf"^algorithm\.{field}: unknown name 'nope'; known: "):
        resolve_algorithm(config(AlgorithmConfig(**part)))


def test_config_takes_any_algorithm_name_and_leaves_the_check_to_the_trainer():
    cfg = from_dict(
        {
            "taskset": {"path": "tasks.jsonl"},
            "algorithm": {"type": "trpo", "advantage_fn": "grpo", "kl_loss_fn": None},
        }
    )
    assert cfg.algorithm.type == "trpo"
    assert cfg.algorithm.advantage_fn == "grpo"
    assert cfg.algorithm.policy_loss_fn is None
    with pytest.raises(ConfigError, match=r"^algorithm\.type: unknown name 'trpo'"):
        resolve_algorithm(cfg)


@pytest.mark.parametrize(("old", "new"), list(MOVED_FIELDS.items()))
def test_a_moved_trainer_field_is_an_error_naming_its_new_place(old, new):
    section, name = old.split(".")
    value = {"algorithm": "grpo", "kl_coef": 0.1, "clip_low": 0.2, "clip_high": 0.2}.get(name)
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)}: moved to {re.escape(new)}$"):
        from_dict({"taskset": {"path": "tasks.jsonl"}, section: {name: value}})
    assert new.startswith("algorithm.")
    assert new.split(".")[1] in AlgorithmConfig.__struct_fields__


def test_moved_fields_name_every_field_that_left_the_trainer():
    assert set(MOVED_FIELDS) == {
        "trainer.algorithm",
        "trainer.advantage_fn",
        "trainer.policy_loss_fn",
        "trainer.kl_loss_fn",
        "trainer.kl_coef",
        "trainer.clip_low",
        "trainer.clip_high",
        "trainer.loss_agg_mode",
        "trainer.std_normalize",
    }
    trainer_fields = {f"trainer.{n}" for n in TrainerConfig.__struct_fields__}
    assert not set(MOVED_FIELDS) & trainer_fields


def _literal_choices(annotation) -> set[str]:
    """The strings of a ``Literal[...]`` (or ``Literal[...] | None``) annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    return set().union(
        *(_literal_choices(a) for a in typing.get_args(annotation) if a is not type(None))
    )


def test_loss_agg_registry_matches_the_config_choices():
    hints = typing.get_type_hints(AlgorithmConfig)
    assert _literal_choices(hints["loss_agg_mode"]) == set(LOSS_AGG)


def test_correction_registry_matches_the_config_choices():
    hints = typing.get_type_hints(AlgorithmConfig)
    assert _literal_choices(hints["off_policy_correction"]) == {*CORRECTIONS, "none"}


def test_registries_hold_todays_parts():
    assert list(ADVANTAGES) == [
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opmd",
        "none",
        "distill",
        "gae",
    ]
    assert list(POLICY_LOSSES) == ["ppo_clip", "gspo", "cispo", "opmd", "sft", "dpo"]
    assert list(KL_ESTIMATORS) == ["k1", "k2", "k3", "low_var_kl", "abs"]
    assert list(LOSS_AGG) == [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ]
    assert list(CORRECTIONS) == [
        "decoupled_ppo",
        "truncated_is_token",
        "truncated_is_sequence",
        "masked_is_token",
        "masked_is_sequence",
    ]
    assert list(ALGORITHMS) == [
        "grpo",
        "dr_grpo",
        "dapo",
        "gspo",
        "cispo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opmd",
        "sft",
        "on_policy_distill",
        "chord",
        "ppo",
        "dpo",
    ]
