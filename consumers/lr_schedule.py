"""The learning rate of each training step (``trainer.lr_schedule``): pure arithmetic.

The schedule moves once per training step (a version's worth of batches), as verl's
actor scheduler does, however many optimizer updates the step makes (``ppo_epochs``,
``mini_batch_size``). Step ``i`` (0-based) of ``total`` (``trainer.max_steps``) with
``w`` warm-up steps and ``m = min_lr_ratio`` gets ``lr x factor(i)``:

- warm-up, ``i < w``: ``(i + 1) / w`` (the first step already learns, at ``lr / w``);
- after it, with ``p = (i - w) / (total - w)`` (0 at the first step after warm-up,
  ``1 - 1/(total - w)`` at the last): ``constant`` 1; ``linear`` ``m + (1 - m)(1 - p)``;
  ``cosine`` ``m + (1 - m)(1 + cos(pi p)) / 2``, as Hugging Face's
  ``get_cosine_schedule_with_warmup`` with a floor.

The factor depends on the step alone, so a resumed trainer continues the curve where its
checkpoint left it.
"""

from __future__ import annotations

import math

import torch

from streamrft.infra.config import TrainerConfig


def warmup_steps(cfg: TrainerConfig) -> int:
    """``lr_warmup_steps``, or ``lr_warmup_ratio`` of ``max_steps`` rounded up."""
    if cfg.lr_warmup_steps:
        return cfg.lr_warmup_steps
    return math.ceil(cfg.lr_warmup_ratio * cfg.max_steps)


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """The multiple of ``trainer.lr`` at 0-based training step ``step``."""
    warm = warmup_steps(cfg)
    if step < warm:
        return (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return 1.0
    left = max(1, cfg.max_steps - warm)
    progress = min(1.0, (step - warm) / left)
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` at ``lr`` (from the config times the
    factor, never from the optimizer's own state, so a resume may change ``trainer.lr``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
