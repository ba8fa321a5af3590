"""KL estimators. Pure functions of tensors.

An estimator takes the policy's and the reference model's log-probs ``(batch,
response_len)`` and returns a per-token estimate of KL(policy || reference), the sampled
token standing in for the expectation (Schulman, "Approximating KL divergence", 2020; the
names as in verl's ``kl_penalty``). :data:`KL_ESTIMATORS` serves both uses:
``algorithm.kl_penalty_fn`` (subtracted from the reward) and ``algorithm.kl_loss_fn``
(added to the loss).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KlFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logprobs, ref_logprobs) -> per-token KL estimate``."""

LOW_VAR_KL_BOUND = 10.0
"""``low_var_kl`` is clamped to [-this, this] (as verl does), so one token whose
probability collapsed cannot dominate a step."""


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1: ``logp - ref``. Unbiased, can be negative per token, high variance."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2: ``(logp - ref)^2 / 2``. Biased, always >= 0, low variance; its gradient is the
    gradient of the true KL's second-order expansion."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3: ``exp(r) - r - 1`` with ``r = ref - logp``. Unbiased and always >= 0."""
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1.0


def kl_low_var(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 clamped to [-:data:`LOW_VAR_KL_BOUND`, :data:`LOW_VAR_KL_BOUND`] (verl's
    ``low_var_kl``)."""
    r = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(r) - r - 1.0).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|``."""
    return (logprobs - ref_logprobs).abs()


KL_ESTIMATORS: dict[str, KlFn] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
    "abs": kl_abs,
}
"""KL estimators by name (``algorithm.kl_penalty_fn``, ``algorithm.kl_loss_fn``)."""
