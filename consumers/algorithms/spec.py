"""What one run's algorithm is, every value settled: a preset with the config's overrides.

:class:`AlgorithmSpec` is built once by :func:`~.presets.resolve_algorithm` and read by
every part; its defaults are the values a preset leaves unsaid.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmSpec:
    """Every setting of the algorithm (``algorithm.*`` in the config, where documented)."""

    name: str = "grpo"
    advantage_fn: str = "grpo"
    policy_loss_fn: str = "ppo_clip"
    kl_penalty_fn: str = "k1"
    kl_penalty_coef: float = 0.0
    kl_loss_fn: str = "k3"
    kl_loss_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    norm_length: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    std_normalize: bool = True
    opmd_tau: float = 1.0
    sample_strategy: str = "default"
    dynamic_sampling: bool = False
    replay_reuse_limit: int = 2
    replay_pool_size: int = 0
    """0: 4 x ``trainer.batch_size``."""
    off_policy_correction: str = "none"
    is_cap: float = 2.0
    is_mask_low: float = 0.5
    is_mask_high: float = 2.0
    expert_data: str = ""
    """A task set whose answers the ``mix`` strategy adds to each batch; "": none."""
    expert_per_step: int = 8
    sft_weight: float = 0.0
    sft_weight_end: float | None = None
    """None: ``sft_weight`` throughout."""
    sft_weight_steps: int = 0
    teacher_path: str = ""
    """The teacher's Hugging Face folder (``distill``); "": none."""
    distill_reward_coef: float = 0.0
    gamma: float = 1.0
    """``gae``: discount of the TD residuals."""
    lam: float = 0.95
    """``gae``: lambda, the bias-variance trade-off of the estimate."""
    critic_lr: float = 1e-4
    """The critic's AdamW learning rate (``gae``)."""
    value_clip: float = 0.2
    """The critic's clip range around its values before the step (``gae``)."""
    dpo_beta: float = 0.1
    """``dpo``: beta, the weight of the log-ratios to the reference in the implicit reward."""
    mask_truncated: bool = False
    """Rows whose response hit ``max_new_tokens`` without an EOS get no gradient."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last stretch of tokens before
    ``max_new_tokens`` over which the reward falls by up to ``overlong_penalty`` (0: off)."""
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0
    """The explorer's ``max_new_tokens`` (the overlong punishment's full length)."""

    def sft_weight_at(self, version: int | None) -> float:
        """mu at ``version``: from ``sft_weight`` to ``sft_weight_end`` linearly over the
        first ``sft_weight_steps`` versions, then ``sft_weight_end``; ``sft_weight``
        throughout when ``sft_weight_steps`` is 0 (or the version unknown)."""
        if not self.sft_weight_steps or version is None:
            return self.sft_weight
        end = self.sft_weight if self.sft_weight_end is None else self.sft_weight_end
        done = min(max(version, 0), self.sft_weight_steps) / self.sft_weight_steps
        return self.sft_weight + (end - self.sft_weight) * done

    @property
    def needs_reference(self) -> bool:
        """Whether a KL term, or DPO's log-ratios, need the reference model's log-probs."""
        return self.kl_loss_coef > 0 or self.kl_penalty_coef > 0 or self.pairs

    @property
    def pairs(self) -> bool:
        """Whether the loss is DPO's, of chosen/rejected pairs (preference groups) rather
        than of tokens."""
        return self.policy_loss_fn == "dpo"

    @property
    def needs_proximal(self) -> bool:
        """Whether the step recomputes the current policy's log-probs first."""
        return self.off_policy_correction != "none"

    @property
    def needs_critic(self) -> bool:
        """Whether the advantage needs a value model trained beside the policy (``gae``)."""
        return self.advantage_fn == "gae"

    @property
    def needs_teacher(self) -> bool:
        """Whether the advantage needs a teacher's log-probs (on-policy distillation)."""
        return self.advantage_fn == "distill"
