"""Algorithms as presets of registered parts, and the one place config names become parts.

``algorithm.type`` picks a preset of :data:`ALGORITHMS`; every other ``algorithm.*`` field
that is set replaces the preset's value. Config validation cannot see these registries
(the config is a lower layer), so the trainer calls :func:`resolve_algorithm` when it
starts: an unknown name is a :class:`ConfigError` naming the field and the known names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from streamrft.consumers.algorithms.advantages import ADVANTAGES, AdvantageFn
from streamrft.consumers.algorithms.aggregation import LOSS_AGG, AggregateFn, aggregation_of
from streamrft.consumers.algorithms.kl import KL_ESTIMATORS, KlFn
from streamrft.consumers.algorithms.policy_losses import POLICY_LOSSES, PolicyLossFn
from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.infra.config import AlgorithmConfig, Config
from streamrft.schemas.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Preset:
    """A named algorithm: the values it sets (the rest are :class:`AlgorithmSpec`'s
    defaults) and where it comes from."""

    source: str
    """The paper or reference implementation it follows."""
    parts: dict[str, Any] = field(default_factory=dict)
    """``AlgorithmSpec`` field -> value."""


ALGORITHMS: dict[str, Preset] = {
    "grpo": Preset(
        "Shao et al., DeepSeekMath (arXiv 2402.03300): group-normalised advantages, PPO clip",
        {"advantage_fn": "grpo", "policy_loss_fn": "ppo_clip"},
    ),
    "dr_grpo": Preset(
        "Liu et al., Understanding R1-Zero-Like Training (arXiv 2503.20783): no std "
        "division, a constant length normaliser",
        {"std_normalize": False, "loss_agg_mode": "seq-mean-token-sum-norm"},
    ),
    "dapo": Preset(
        "Yu et al., DAPO (arXiv 2503.14476): clip-higher, token-mean, dynamic sampling",
        {
            "clip_low": 0.2,
            "clip_high": 0.28,
            "loss_agg_mode": "token-mean",
            "dynamic_sampling": True,
        },
    ),
    "gspo": Preset(
        "Zheng et al., GSPO (arXiv 2507.18071): sequence-level ratio and clipping",
        {
            "policy_loss_fn": "gspo",
            "clip_low": 3e-4,
            "clip_high": 4e-4,
            "loss_agg_mode": "seq-mean-token-mean",
        },
    ),
    "cispo": Preset(
        "MiniMax-M1 (arXiv 2506.13585): clipped importance weights, every token's gradient kept",
        {"policy_loss_fn": "cispo", "clip_low": 1.0, "clip_high": 0.28},
    ),
    "rloo": Preset(
        "Ahmadian et al., Back to Basics (arXiv 2402.14740): leave-one-out baseline",
        {"advantage_fn": "rloo"},
    ),
    "reinforce_plus_plus": Preset(
        "Hu, REINFORCE++ (arXiv 2501.03262): batch-whitened returns, KL in the reward",
        {"advantage_fn": "reinforce_plus_plus", "kl_penalty_fn": "k1", "kl_penalty_coef": 0.01},
    ),
    "reinforce_plus_plus_baseline": Preset(
        "Hu, REINFORCE++ (arXiv 2501.03262), its group-baseline variant, KL in the loss",
        {"advantage_fn": "reinforce_plus_plus_baseline", "kl_loss_fn": "k2", "kl_loss_coef": 0.001},
    ),
    "opmd": Preset(
        "online policy mirror descent as in Trinity-RFT (arXiv 2505.17826), the loss in Kimi "
        "k1.5's form (arXiv 2501.12599)",
        {"advantage_fn": "opmd", "policy_loss_fn": "opmd", "opmd_tau": 1.0},
    ),
    "sft": Preset(
        "supervised fine-tuning: the negative log-likelihood of the trained tokens",
        {"advantage_fn": "none", "policy_loss_fn": "sft"},
    ),
    "on_policy_distill": Preset(
        "Thinking Machines, On-Policy Distillation (2025); Agarwal et al., GKD (arXiv "
        "2306.13649); Gu et al., MiniLLM (arXiv 2306.08543): per-token reverse KL to a "
        "teacher's log-probs of the student's samples, PPO clip; needs "
        "algorithm.teacher_path",
        {"advantage_fn": "distill", "policy_loss_fn": "ppo_clip", "distill_reward_coef": 0.0},
    ),
    "chord": Preset(
        "Zhang et al., CHORD: On-Policy RL and Supervised Fine-Tuning as a Dynamic "
        "Weighting (arXiv 2508.11408), its global mu: expert answers mixed into RL "
        "batches with a supervised weight decaying over the run; needs algorithm.expert_data",
        {
            "sample_strategy": "mix",
            "expert_per_step": 8,
            "sft_weight": 0.5,
            "sft_weight_end": 0.05,
            "sft_weight_steps": 100,
        },
    ),
    "ppo": Preset(
        "Schulman et al., PPO (arXiv 1707.06347) with GAE (Schulman et al., arXiv "
        "1506.02438): a critic (a copy of the policy's backbone with a value head) trained "
        "beside the policy with verl's clipped value loss (core_algos.compute_value_loss)",
        {"advantage_fn": "gae", "policy_loss_fn": "ppo_clip"},
    ),
    "dpo": Preset(
        "Rafailov et al., Direct Preference Optimization (arXiv 2305.18290): "
        "-log sigmoid(beta x the chosen-minus-rejected log-ratio to the reference) of "
        "preference pairs (workflow preference), beta 0.1",
        {"advantage_fn": "none", "policy_loss_fn": "dpo", "dpo_beta": 0.1},
    ),
}
"""``algorithm.type`` -> preset."""


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """The settings and functions one training run uses, looked up once from config."""

    spec: AlgorithmSpec
    advantage: AdvantageFn
    policy_loss: PolicyLossFn
    kl_penalty: KlFn
    kl_loss: KlFn
    aggregate: AggregateFn
    """The ``loss_agg_mode`` aggregation (its length bound)."""

    @property
    def name(self) -> str:
        return self.spec.name


def algorithm_spec(acfg: AlgorithmConfig, max_new_tokens: int) -> AlgorithmSpec:
    """The preset's values with every field ``acfg`` sets in their place."""
    preset = _lookup(ALGORITHMS, acfg.type, "algorithm.type", "")
    values: dict[str, Any] = {
        "name": acfg.type,
        "norm_length": max_new_tokens,
        "max_new_tokens": max_new_tokens,
        **preset.parts,
    }
    for name, value in msgspec.structs.asdict(acfg).items():
        if name != "type" and value is not None:
            values[name] = value
    return AlgorithmSpec(**values)


def check_mini_batches(spec: AlgorithmSpec, cfg: Config) -> None:
    """``trainer.mini_batch_size`` splits a batch of policy-gradient groups; DPO's pairs
    and the ``mix`` strategy's expert share are weighed over the whole batch."""
    t = cfg.trainer
    if not t.mini_batch_size or t.mini_batch_size >= t.batch_size:
        return
    if spec.pairs:
        raise ConfigError(
            "trainer.mini_batch_size: DPO (algorithm.policy_loss_fn dpo) "
            "trains a batch of pairs in one update; leave it 0"
        )
    if spec.sample_strategy == "mix":
        raise ConfigError(
            "trainer.mini_batch_size: the mix strategy (chord) weighs its "
            "expert groups over the whole batch; leave it 0"
        )


def resolve_algorithm(cfg: Config) -> ResolvedAlgorithm:
    """The settings and parts ``cfg.algorithm`` names; a :class:`ConfigError` naming the
    field for any unknown name."""
    spec = algorithm_spec(cfg.algorithm, cfg.explorer.max_new_tokens)
    unset = cfg.algorithm.sample_strategy is None and spec.sample_strategy == "default"
    if cfg.synchronizer.style == "fully_async" and unset:
        spec = dataclasses.replace(spec, sample_strategy="available")  # a step waits for no batch
    check_critic(spec, cfg)
    check_pairs(spec, cfg)
    check_mini_batches(spec, cfg)
    return resolve_spec(spec, explicit=cfg.algorithm)


def resolve_spec(spec: AlgorithmSpec, explicit: AlgorithmConfig | None = None) -> ResolvedAlgorithm:
    """The parts of ``spec``; ``explicit`` (the config) says which names came from it, for
    the error message."""

    def part(registry: dict[str, T], name: str) -> T:
        value = getattr(spec, name)
        given = explicit is not None and getattr(explicit, name) is not None
        origin = "" if given else f" (algorithm.type {spec.name!r})"
        return _lookup(registry, value, f"algorithm.{name}", origin)

    _lookup(LOSS_AGG, spec.loss_agg_mode, "algorithm.loss_agg_mode", "")
    check_teacher(spec, explicit)
    return ResolvedAlgorithm(
        spec=spec,
        advantage=part(ADVANTAGES, "advantage_fn"),
        policy_loss=part(POLICY_LOSSES, "policy_loss_fn"),
        kl_penalty=part(KL_ESTIMATORS, "kl_penalty_fn"),
        kl_loss=part(KL_ESTIMATORS, "kl_loss_fn"),
        aggregate=aggregation_of(spec.loss_agg_mode, spec.norm_length),
    )


def with_spec(algo: ResolvedAlgorithm, **changes: Any) -> ResolvedAlgorithm:
    """``algo`` with some settings changed (tests, benches)."""
    return resolve_spec(dataclasses.replace(algo.spec, **changes))


def check_teacher(spec: AlgorithmSpec, explicit: AlgorithmConfig | None = None) -> None:
    """A teacher folder is named exactly when the advantage (``distill``) uses one."""
    given = explicit is not None and explicit.advantage_fn is not None
    origin = "" if given else f" (algorithm.type {spec.name!r})"
    if spec.needs_teacher and not spec.teacher_path:
        raise ConfigError(
            f"algorithm.teacher_path: required by algorithm.advantage_fn "
            f"{spec.advantage_fn!r}{origin}: the teacher's Hugging Face model folder"
        )
    if spec.teacher_path and not spec.needs_teacher:
        raise ConfigError(
            f"algorithm.teacher_path: set, but algorithm.advantage_fn {spec.advantage_fn!r}"
            f"{origin} uses no teacher (use 'distill' or the on_policy_distill preset)"
        )


def check_critic(spec: AlgorithmSpec, cfg: Config) -> None:
    """A critic (``gae``) is trained in the ``torch`` engine's one process only."""
    if not spec.needs_critic:
        return
    if cfg.trainer.engine != "torch" or cfg.trainer.world > 1:
        raise ConfigError(
            f"trainer.engine: algorithm.advantage_fn 'gae' (algorithm.type {spec.name!r}) "
            f"trains a critic, which the sharded engine does not support yet; use "
            f"trainer.engine 'torch' with trainer.nproc and trainer.nnodes 1 (got "
            f"{cfg.trainer.engine!r}, nproc {cfg.trainer.nproc}, nnodes {cfg.trainer.nnodes})"
        )


def check_pairs(spec: AlgorithmSpec, cfg: Config) -> None:
    """DPO (``policy_loss_fn: dpo``) trains whole pairs in one process, on nothing else."""
    if not spec.pairs:
        return
    if cfg.trainer.world > 1:
        raise ConfigError(
            f"trainer.nproc: algorithm.policy_loss_fn 'dpo' (algorithm.type {spec.name!r}) "
            f"trains in one process; the sharded engine does not support it (got nproc "
            f"{cfg.trainer.nproc})"
        )
    if spec.sample_strategy == "mix":
        raise ConfigError(
            "algorithm.sample_strategy: 'mix' adds expert groups, which "
            "algorithm.policy_loss_fn 'dpo' cannot train (it trains preference pairs only)"
        )


def _lookup(registry: dict[str, T], name: str, field_name: str, origin: str) -> T:
    try:
        return registry[name]
    except KeyError:
        raise ConfigError(
            f"{field_name}: unknown name {name!r}{origin}; known: {', '.join(registry)}"
        ) from None
