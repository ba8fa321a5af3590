"""Off-policy corrections for stale experiences. Pure functions of tensors.

An explorer may sample a batch with a version older than the trainer's (up to
``trainer.max_staleness``), and its engine may compute slightly different log-probs than
the trainer even for the same version. The trainer recomputes the current (proximal)
policy's log-probs at the start of a step; a correction then takes the policy ratio
against them and weighs each token by the importance weight ``w = pi_prox / pi_behaviour``
(behaviour: the rollout's log-probs), capped, truncated or masked
(``algorithm.off_policy_correction``):

- ``decoupled_ppo``: w as is; tokens with w above ``is_cap`` get 0 (AReaL's decoupled PPO,
  Fu et al., 2025).
- ``truncated_is_token`` / ``truncated_is_sequence``: w capped at ``is_cap``, per token or
  once per sequence as the product of its tokens' weights (truncated importance sampling,
  Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
  2025; verl's rollout correction).
- ``masked_is_token`` / ``masked_is_sequence``: w where it lies in [``is_mask_low``,
  ``is_mask_high``], 0 outside, per token (IcePop, Ling team, 2025) or per sequence by the
  geometric mean of its tokens' weights (verl's sequence rejection).

A masked token still counts in the aggregation's denominator: the batch's normaliser
does not depend on the weights, so micro-batches and ranks split it as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamrft.consumers.algorithms.spec import AlgorithmSpec

MAX_LOG_WEIGHT = 20.0
"""Log importance weights are clamped to +-this before ``exp`` (no inf)."""


@dataclass
class Correction:
    base: torch.Tensor
    """``(B, R)`` log-probs the policy ratio is taken against."""
    weights: torch.Tensor | None
    """``(B, R)`` per-token weights of the loss (no grad); None: all 1."""
    metrics: dict[str, float]
    """``is_weight_mean``/``max`` (before capping or masking) over the trained tokens, and
    ``is_capped_frac`` or ``is_masked_frac``."""


def _stats(w: torch.Tensor, mask: torch.Tensor, changed: torch.Tensor, what: str) -> dict:
    m = mask > 0
    n = float(m.sum())
    if not n:
        return {"is_weight_mean": 1.0, "is_weight_max": 1.0, f"is_{what}_frac": 0.0}
    return {
        "is_weight_mean": float(w[m].mean()),
        "is_weight_max": float(w[m].max()),
        f"is_{what}_frac": float((changed & m).sum()) / n,
    }


def _token_log_weights(behaviour: torch.Tensor, proximal: torch.Tensor) -> torch.Tensor:
    return (proximal - behaviour).clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)


def _sequence_log_weights(log_w: torch.Tensor, mask: torch.Tensor, mean: bool) -> torch.Tensor:
    """Per sequence, the sum (a product of weights) or the mean (a geometric mean) of the
    token log-weights, spread back over the tokens."""
    m = mask.to(log_w.dtype)
    total = (log_w * m).sum(-1)
    if mean:
        total = total / m.sum(-1).clamp_min(1.0)
    return total.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)[:, None].expand_as(log_w)


def decoupled_ppo(log_w, mask, spec):
    w = torch.exp(log_w)
    over = w > spec.is_cap
    return torch.where(over, torch.zeros_like(w), w), _stats(w, mask, over, "masked")


def truncated_is_token(log_w, mask, spec):
    w = torch.exp(log_w)
    over = w > spec.is_cap
    return w.clamp(max=spec.is_cap), _stats(w, mask, over, "capped")


def truncated_is_sequence(log_w, mask, spec):
    w = torch.exp(_sequence_log_weights(log_w, mask, mean=False))
    over = w > spec.is_cap
    return w.clamp(max=spec.is_cap), _stats(w, mask, over, "capped")


def _masked(w, mask, spec):
    outside = (w < spec.is_mask_low) | (w > spec.is_mask_high)
    return torch.where(outside, torch.zeros_like(w), w), _stats(w, mask, outside, "masked")


def masked_is_token(log_w, mask, spec):
    return _masked(torch.exp(log_w), mask, spec)


def masked_is_sequence(log_w, mask, spec):
    return _masked(torch.exp(_sequence_log_weights(log_w, mask, mean=True)), mask, spec)


WeightFn = Callable[
    [torch.Tensor, torch.Tensor, AlgorithmSpec], tuple[torch.Tensor, dict[str, float]]
]
"""``(token log-weights, mask, spec) -> (weights, metrics)``."""

CORRECTIONS: dict[str, WeightFn] = {
    "decoupled_ppo": decoupled_ppo,
    "truncated_is_token": truncated_is_token,
    "truncated_is_sequence": truncated_is_sequence,
    "masked_is_token": masked_is_token,
    "masked_is_sequence": masked_is_sequence,
}
"""``algorithm.off_policy_correction`` (other than ``none``) -> its weights."""


@torch.no_grad()
def correct(
    behaviour: torch.Tensor,
    proximal: torch.Tensor | None,
    mask: torch.Tensor,
    spec: AlgorithmSpec,
) -> Correction:
    """The ratio base and token weights of ``spec.off_policy_correction``: ``none`` (or no
    proximal log-probs) keeps the rollout's log-probs as the base and no weights."""
    if spec.off_policy_correction == "none" or proximal is None:
        return Correction(behaviour, None, {})
    fn = CORRECTIONS[spec.off_policy_correction]
    weights, metrics = fn(_token_log_weights(behaviour, proximal), mask, spec)
    return Correction(proximal, weights * mask, metrics)
