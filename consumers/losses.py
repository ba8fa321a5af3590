"""Supervised loss (warm-up, SFT). Pure; the RL losses are in :mod:`streamrft.consumers.algorithms`."""

from __future__ import annotations

import torch

from streamrft.consumers.algorithms.aggregation import aggregate


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy on the masked positions (supervised warm-up, SFT)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return aggregate(nll, mask, "token-mean")
