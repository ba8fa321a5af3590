"""Policy losses. Pure functions of tensors; every tensor is ``(batch, response_len)``.

A policy loss takes :class:`LossInputs` (the policy's log-probs with grad, the log-probs
its ratio is taken against, per-token advantages, the mask) and the
:class:`~.spec.AlgorithmSpec`, and returns the loss of each token to minimise and float
diagnostics over the mask. The step weighs the tokens (an off-policy correction) and
aggregates them with ``algorithm.loss_agg_mode``. :data:`POLICY_LOSSES` is chosen by
``algorithm.policy_loss_fn`` or the preset; its ``dpo`` is a marker (the loss of
preference pairs lives in :mod:`.dpo`, with its own step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamrft.consumers.algorithms.aggregation import aggregate
from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.schemas.errors import ConfigError


@dataclass
class LossInputs:
    logprobs: torch.Tensor
    """The policy's log-probs of the response tokens (with grad)."""
    old_logprobs: torch.Tensor
    """What the ratio is taken against: the rollout policy's log-probs, or the proximal
    policy's under an off-policy correction."""
    advantages: torch.Tensor
    """Per token, 0 off the mask."""
    mask: torch.Tensor
    """1 on trained response tokens."""


PolicyLossFn = Callable[[LossInputs, AlgorithmSpec], tuple[torch.Tensor, dict[str, float]]]
"""``(inputs, spec) -> (per-token loss, diagnostics)``."""


@torch.no_grad()
def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` over the mask (0 for an empty mask), as a float."""
    m = mask.to(values.dtype)
    return float((values * m).sum() / m.sum().clamp_min(1.0))


def _old_kl(inp: LossInputs) -> float:
    """``mean((logp - old)^2 / 2)``: how far the policy moved from ``old`` (a diagnostic)."""
    return masked_mean(0.5 * (inp.logprobs.detach() - inp.old_logprobs) ** 2, inp.mask)


def surrogate_tokens(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A)`` per token, and where
    the clipped side was taken."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), unclipped > clipped


def ppo_clip(inp: LossInputs, spec: AlgorithmSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate per token (Schulman et al., 2017), with separate low and
    high clip ranges (DAPO's clip-higher)."""
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)
    per_token, was_clipped = surrogate_tokens(ratio, inp.advantages, spec.clip_low, spec.clip_high)
    return per_token, {
        "clip_frac": masked_mean(was_clipped.to(ratio.dtype), inp.mask),
        "approx_kl_old": _old_kl(inp),
    }


def gspo(inp: LossInputs, spec: AlgorithmSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al., "Group Sequence Policy Optimization", 2025): one ratio per
    sequence, the geometric mean of its tokens' ratios, clipped; each token carries it
    with its own gradient (``sg(s_i) x pi / sg(pi)``)."""
    m = inp.mask.to(inp.logprobs.dtype)
    log_ratio = inp.logprobs - inp.old_logprobs
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp_min(1.0)
    token_log_ratio = seq_log_ratio.detach()[:, None] + inp.logprobs - inp.logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    per_token, was_clipped = surrogate_tokens(ratio, inp.advantages, spec.clip_low, spec.clip_high)
    return per_token, {
        "clip_frac": masked_mean(was_clipped.to(ratio.dtype), inp.mask),
        "approx_kl_old": _old_kl(inp),
    }


def cispo(inp: LossInputs, spec: AlgorithmSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(ratio, 1 - clip_low, 1 + clip_high)) A log pi``
    per token. The importance weight is clipped, not the update, so every token keeps its
    gradient."""
    ratio = torch.exp(inp.logprobs.detach() - inp.old_logprobs)
    weight = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
    return -weight * inp.advantages * inp.logprobs, {
        "clip_frac": masked_mean((weight != ratio).to(ratio.dtype), inp.mask),
        "approx_kl_old": _old_kl(inp),
    }


def opmd(inp: LossInputs, spec: AlgorithmSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """Online policy mirror descent in the form of Kimi k1.5 (arXiv 2501.12599, its
    surrogate's gradient): ``-A log pi + tau / 2 (log pi - log pi_old)^2`` per token, a
    policy gradient with a group-mean baseline kept near the rollout policy by the squared
    log-ratio. Trinity-RFT's ``opmd`` (technical report, arXiv 2505.17826) scales the policy
    gradient by ``1 / (1 + tau)`` instead; the two agree on-policy up to that factor."""
    log_ratio = inp.logprobs - inp.old_logprobs
    per_token = -inp.advantages * inp.logprobs + 0.5 * spec.opmd_tau * log_ratio**2
    return per_token, {"approx_kl_old": _old_kl(inp)}


def sft(inp: LossInputs, spec: AlgorithmSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised: the negative log-likelihood of each trained token (advantages unused)."""
    return -inp.logprobs, {"nll": masked_mean(-inp.logprobs.detach(), inp.mask)}


def dpo(inp: LossInputs, spec: AlgorithmSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO (Rafailov et al., 2023) is a loss of chosen/rejected pairs of whole sequences,
    not of tokens: :func:`~.dpo.dpo_step` computes it, and the train engine takes that
    step for this name. Registered here so the name resolves; a per-token call refuses."""
    raise ConfigError(
        "algorithm.policy_loss_fn: 'dpo' is a loss of preference pairs, computed by the "
        "dpo step (consumers/algorithms/dpo.py), not a per-token policy loss"
    )


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`ppo_clip` aggregated with ``agg``: the PPO/GRPO loss of a batch."""
    spec = AlgorithmSpec(clip_low=clip_low, clip_high=clip_high)
    per_token, info = ppo_clip(LossInputs(logprobs, old_logprobs, advantages, mask), spec)
    return aggregate(per_token, mask, agg), info


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
    "opmd": opmd,
    "sft": sft,
    "dpo": dpo,
}
"""Policy losses by name (``algorithm.policy_loss_fn``)."""
