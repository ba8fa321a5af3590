"""The critic's loss and how well it predicts. Pure functions of tensors.

PPO's critic (``gae``, :mod:`streamrft.consumers.critic`) regresses each response token's
value on its GAE return, with its change over a step clipped around the value it had
before the step (Schulman et al., 2017; verl's ``core_algos.compute_value_loss``).
"""

from __future__ import annotations

import torch


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)``
    and where the clipped branch is the larger (``(B, R)`` each; the caller masks and
    aggregates)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    return 0.5 * torch.maximum(plain_loss, clipped_loss), clipped_loss > plain_loss


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the tokens of ``mask`` (1: the values predict the
    returns exactly; 0: no better than their mean; below 0: worse). 0 when the returns do
    not vary."""
    m = mask.to(returns.dtype)
    n = m.sum().clamp_min(1.0)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return (((x - mean) ** 2) * m).sum() / n

    total = var(returns)
    if float(total) <= 0.0:
        return 0.0
    return float(1.0 - var(returns - values) / total)
