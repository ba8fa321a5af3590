"""Group-relative advantages (GRPO). Pure functions of tensors."""

from __future__ import annotations

import torch


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
