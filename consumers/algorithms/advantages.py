"""Advantage estimators. Pure functions of tensors.

An estimator takes the batch's rewards ``(n,)`` (groups one after the other, as the
trainer's batch holds them), the size of each group, and the trainer config, and returns
one advantage per rollout ``(n,)``. :data:`ADVANTAGES` is chosen by the algorithm
(``trainer.algorithm``) or ``trainer.advantage_fn``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from streamrft.infra.config import TrainerConfig

AdvantageFn = Callable[[torch.Tensor, Sequence[int], TrainerConfig], torch.Tensor]
"""``(rewards (n,), group sizes, trainer config) -> advantages (n,)``."""


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


def grpo_advantages(
    rewards: torch.Tensor, group_sizes: Sequence[int], cfg: TrainerConfig
) -> torch.Tensor:
    """GRPO: :func:`group_advantages` of each group (``trainer.std_normalize``: Dr. GRPO
    when False); groups of unequal size are normalised each on its own."""
    if len(set(group_sizes)) == 1:
        return group_advantages(
            rewards.view(len(group_sizes), -1), std_normalize=cfg.std_normalize
        ).view(-1)
    parts = torch.split(rewards, list(group_sizes))
    return torch.cat(
        [group_advantages(p.view(1, -1), std_normalize=cfg.std_normalize).view(-1) for p in parts]
    )


ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo_advantages}
"""Advantage estimators by name (``trainer.advantage_fn``)."""
