"""Policy losses. Pure functions of tensors; every tensor is ``(batch, response_len)``.

A policy loss takes the policy's log-probs (with grad), the rollout policy's log-probs,
per-token advantages, the mask (1 on trained response tokens) and the trainer config, and
returns the loss to minimise and float diagnostics. :data:`POLICY_LOSSES` is chosen by the
algorithm (``trainer.algorithm``) or ``trainer.policy_loss_fn``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamrft.consumers.algorithms.aggregation import aggregate
from streamrft.infra.config import TrainerConfig

PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, TrainerConfig],
    tuple[torch.Tensor, dict[str, float]],
]
"""``(logprobs, old_logprobs, advantages, mask, trainer config) -> (loss, diagnostics)``."""


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO/GRPO token-level clipped surrogate loss (to minimise).

    ``advantages`` is per token (broadcast a per-sequence advantage over its tokens).
    The ratio is taken against ``old_logprobs``, the rollout policy's log-probs.
    Returns the loss and diagnostics: clip fraction and approximate KL to the old policy.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        n = m.sum().clamp_min(1.0)
        clip_frac = (((unclipped > clipped).to(m.dtype)) * m).sum() / n
        approx_kl = ((0.5 * log_ratio**2) * m).sum() / n
    return loss, {"clip_frac": float(clip_frac), "approx_kl_old": float(approx_kl)}


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: TrainerConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`clipped_surrogate` with ``trainer.clip_low/clip_high/loss_agg_mode``."""
    return clipped_surrogate(
        logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.loss_agg_mode
    )


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip}
"""Policy losses by name (``trainer.policy_loss_fn``)."""
