"""KL penalty estimators. Pure functions of tensors.

An estimator takes the policy's and the reference model's log-probs ``(batch,
response_len)`` and returns a per-token estimate of KL(policy || reference); the step
aggregates it with ``trainer.loss_agg_mode`` and weighs it by ``trainer.kl_coef``.
:data:`KL_LOSSES` is chosen by the algorithm (``trainer.algorithm``) or ``trainer.kl_loss_fn``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KlLossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logprobs, ref_logprobs) -> per-token KL``."""


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): ``exp(r) - r - 1``, r = ref - logp.

    Unbiased, always >= 0 (Schulman's "Approximating KL divergence").
    """
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1.0


KL_LOSSES: dict[str, KlLossFn] = {"k3": kl_k3}
"""KL estimators by name (``trainer.kl_loss_fn``)."""
