"""Policy losses. Pure functions of tensors; every tensor is ``(batch, response_len)``.

``mask`` is 1 on response tokens that are trained and 0 on padding and masked actions.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: LossAggMode) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    - ``token-mean``: mean over every unmasked token of the batch (long responses weigh
      more, as in DAPO).
    - ``seq-mean-token-mean``: mean over tokens within each sequence, then over sequences
      (the original GRPO).
    - ``seq-mean-token-sum``: sum over tokens within each sequence, mean over sequences.
    """
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


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: LossAggMode = "token-mean",
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


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): ``exp(r) - r - 1``, r = ref - logp.

    Unbiased, always >= 0 (Schulman's "Approximating KL divergence").
    """
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1.0


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy on the masked positions (supervised warm-up, SFT)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return aggregate(nll, mask, "token-mean")
