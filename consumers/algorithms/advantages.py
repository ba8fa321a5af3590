"""Advantage estimators. Pure functions of tensors.

An estimator takes :class:`AdvantageInputs` (the batch's groups one after the other, as
the trainer's batch holds them) and the :class:`~.spec.AlgorithmSpec`, and returns one
advantage per response token ``(B, R)``, 0 where the mask is 0. Outcome estimators score a
rollout by its reward minus any KL penalty summed over its tokens (``score``) and spread
that over its tokens; ``reinforce_plus_plus`` works per token, and so does ``distill``
(on-policy distillation: the teacher's log-probs of the sampled tokens against the
rollout's), and so does ``gae`` (PPO's: TD residuals of the critic's values,
:mod:`streamrft.consumers.critic`). :data:`ADVANTAGES` is chosen by
``algorithm.advantage_fn`` or the preset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from streamrft.consumers.algorithms.spec import AlgorithmSpec

WHITEN_EPS = 1e-8


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor
    """``(B,)`` each rollout's reward."""
    group_sizes: Sequence[int]
    """Rollouts of each group, in batch order."""
    mask: torch.Tensor
    """``(B, R)`` 1 on trained response tokens."""
    penalty: torch.Tensor | None = None
    """``(B, R)`` ``kl_penalty_coef`` x the KL penalty of each token, or None."""
    old_logprobs: torch.Tensor | None = None
    """``(B, R)`` the rollout policy's log-probs of the sampled tokens."""
    teacher_logprobs: torch.Tensor | None = None
    """``(B, R)`` the teacher's log-probs of the same tokens (``distill``), or None."""
    values: torch.Tensor | None = None
    """``(B, R)`` the critic's value of the state before each response token (``gae``),
    or None."""

    @property
    def scores(self) -> torch.Tensor:
        """``(B,)``: reward minus the summed KL penalty."""
        if self.penalty is None:
            return self.rewards
        return self.rewards - (self.penalty * self.mask).sum(-1)

    @property
    def token_rewards(self) -> torch.Tensor:
        """``(B, R)``: the reward on each rollout's last trained token, minus the penalty
        on every trained token."""
        return token_rewards(self.rewards, self.mask, self.penalty)


AdvantageFn = Callable[[AdvantageInputs, AlgorithmSpec], torch.Tensor]
"""``(inputs, spec) -> advantages (B, R)``."""


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, penalty: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, R)``: each reward on its rollout's last trained token, minus ``penalty`` (per
    token, already weighed) where the mask is 1."""
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows]
    return out if penalty is None else out - penalty * mask


def group_advantages(
    rewards: torch.Tensor, eps: float = 1e-6, std_normalize: bool = True
) -> torch.Tensor:
    """Advantage of each rollout relative to its group.

    ``rewards`` has shape ``(groups, repeat_times)``. Each row is centred on its mean and,
    with ``std_normalize``, divided by its (unbiased) standard deviation plus ``eps``. A
    group whose rewards are all equal gets zero advantages: it carries no signal.
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be (groups, repeat_times), got shape {tuple(rewards.shape)}"
        )
    mean = rewards.mean(dim=1, keepdim=True)
    centred = rewards - mean
    if not std_normalize or rewards.shape[1] < 2:
        return centred
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return centred / (std + eps)


def per_group(
    scores: torch.Tensor, sizes: Sequence[int], fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``fn`` of each group's ``(1, size)`` scores, concatenated back to ``(B,)`` (one call
    for the whole batch when every group has the same size)."""
    if len(set(sizes)) == 1:
        return fn(scores.view(len(sizes), -1)).reshape(-1)
    return torch.cat([fn(p.view(1, -1)).reshape(-1) for p in torch.split(scores, list(sizes))])


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` centred on their mean over the mask and divided by their (unbiased) std
    over it, over the whole batch; 0 off the mask."""
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (values * m).sum() / n.clamp_min(1.0)
    var = (((values - mean) ** 2) * m).sum() / (n - 1.0).clamp_min(1.0)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS) * m


def grpo_advantages(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """GRPO (Shao et al., DeepSeekMath, 2024): a rollout's score centred on its group's
    mean and divided by the group's std (``std_normalize``; False: Dr. GRPO)."""
    adv = per_group(
        inp.scores,
        inp.group_sizes,
        lambda g: group_advantages(g, std_normalize=spec.std_normalize),
    )
    return adv[:, None] * inp.mask


def rloo_advantages(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """RLOO (Ahmadian et al., "Back to Basics", 2024): a rollout's score minus the mean of
    the other rollouts of its group, ``G / (G - 1) x (score - group mean)``; 0 for a group
    of one."""

    def leave_one_out(g: torch.Tensor) -> torch.Tensor:
        size = g.shape[1]
        if size < 2:
            return torch.zeros_like(g)
        return (g - g.mean(dim=1, keepdim=True)) * (size / (size - 1))

    return per_group(inp.scores, inp.group_sizes, leave_one_out)[:, None] * inp.mask


def reinforce_plus_plus_advantages(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025): each token's return (the sum of the token rewards from it to
    the end, discount 1), whitened over every trained token of the batch."""
    rewards = inp.token_rewards * inp.mask
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    return masked_whiten(returns, inp.mask)


def reinforce_plus_plus_baseline_advantages(
    inp: AdvantageInputs, spec: AlgorithmSpec
) -> torch.Tensor:
    """REINFORCE++ with a baseline: the score minus its group's mean, spread over the
    tokens and whitened over the batch."""
    centred = per_group(inp.scores, inp.group_sizes, lambda g: g - g.mean(dim=1, keepdim=True))
    return masked_whiten(centred[:, None] * inp.mask, inp.mask)


def opmd_advantages(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """OPMD (online policy mirror descent, Trinity-RFT technical report, 2025): the score
    minus its group's mean, not normalised (the loss adds the mirror-descent term)."""
    centred = per_group(inp.scores, inp.group_sizes, lambda g: g - g.mean(dim=1, keepdim=True))
    return centred[:, None] * inp.mask


def distill_advantages(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """On-policy distillation (Agarwal et al., GKD, 2024; Gu et al., MiniLLM, 2024;
    Thinking Machines, "On-Policy Distillation", 2025): each token's advantage is
    ``teacher_logp - old_logp``, the negative of the sampled token's reverse-KL estimate
    (k1) to the teacher, not summed over later tokens (discount 0); plus
    ``distill_reward_coef`` x the ``grpo`` advantage of the task reward when it is above 0.
    Both log-probs are at the sampling temperature (``explorer.temperature``)."""
    if inp.teacher_logprobs is None or inp.old_logprobs is None:
        raise ValueError("distill advantages need the teacher's and the rollout's log-probs")
    adv = (inp.teacher_logprobs - inp.old_logprobs) * inp.mask
    if spec.distill_reward_coef > 0:
        adv = adv + spec.distill_reward_coef * grpo_advantages(inp, spec)
    return adv


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """``(B, R)`` generalised advantage estimates (Schulman et al., 2016), not whitened:
    ``A_t = delta_t + gamma * lam * A_next`` with ``delta_t = r_t + gamma * V_next - V_t``,
    where "next" is the next token of the mask (tokens off the mask inside a response,
    such as a tool's output, are skipped: they carry ``V`` and ``A`` through, as verl's
    ``compute_gae_advantage_return``) and the value after the last one is 0. 0 off the
    mask (verl leaves the carried value there; its losses mask it)."""
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m > 0, delta + gamma * lam * running, running)
        next_value = torch.where(m > 0, values[:, t], next_value)
        out[:, t] = running
    return out * mask


def gae_returns(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """``(B, R)`` the critic's targets: GAE advantages (``algorithm.gamma``,
    ``algorithm.lam``) plus the values, over the token rewards; 0 off the mask."""
    return (_gae_of(inp, spec) + _values_of(inp)) * inp.mask


def gae_advantages(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """PPO's advantages (Schulman et al., 2017): :func:`gae` over the token rewards (the
    outcome reward on the last trained token minus any KL penalty) and the critic's
    values, whitened over every trained token of the batch (as verl does). The critic's
    targets are :func:`gae_returns` of the same inputs."""
    return masked_whiten(_gae_of(inp, spec), inp.mask)


def _values_of(inp: AdvantageInputs) -> torch.Tensor:
    if inp.values is None:
        raise ValueError("gae advantages need the critic's values (AdvantageInputs.values)")
    return inp.values


def _gae_of(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    return gae(inp.token_rewards, _values_of(inp), inp.mask, spec.gamma, spec.lam)


def no_advantages(inp: AdvantageInputs, spec: AlgorithmSpec) -> torch.Tensor:
    """Zeros: for losses that use none (``sft``)."""
    return torch.zeros_like(inp.token_rewards)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "opmd": opmd_advantages,
    "none": no_advantages,
    "distill": distill_advantages,
    "gae": gae_advantages,
}
"""Advantage estimators by name (``algorithm.advantage_fn``)."""
