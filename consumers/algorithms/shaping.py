"""A batch's rewards and mask before its advantages: DAPO's soft overlong punishment and
truncated responses left out of the loss (``algorithm.overlong_buffer``,
``overlong_penalty``, ``mask_truncated``). Pure tensor arithmetic."""

from __future__ import annotations

import dataclasses

import torch

from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.consumers.batching import PolicyBatch
from streamrft.schemas.experience import ExperienceGroup

TRUNCATED = "truncated"
"""The experience ``info`` key the explorer sets to 1 on a response cut at
``max_new_tokens`` (no EOS), and a multi-turn episode that ran out of room."""


def truncated_rows(groups: list[ExperienceGroup]) -> list[bool]:
    """Per row of the batch (groups' experiences in order), whether it was truncated."""
    return [e.info.get(TRUNCATED, 0.0) > 0 for g in groups for e in g.experiences]


def overlong_penalty(lengths: torch.Tensor, spec: AlgorithmSpec) -> torch.Tensor:
    """``(B,)`` DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13)
    of responses of ``lengths`` policy tokens: 0 up to ``L - buffer``, then falling
    linearly to ``-overlong_penalty`` at ``L = max_new_tokens``, and that beyond."""
    start = spec.max_new_tokens - spec.overlong_buffer
    over = (lengths.float() - start).clamp(min=0.0) / spec.overlong_buffer
    return -spec.overlong_penalty * over.clamp(max=1.0)


def shape_batch(
    batch: PolicyBatch, truncated: list[bool], spec: AlgorithmSpec
) -> tuple[PolicyBatch, dict[str, float]]:
    """``batch`` with the overlong penalty in its rewards (lengths before any masking) and,
    under ``mask_truncated``, the truncated rows' tokens out of its mask; and the step's
    metrics of both."""
    rows = torch.tensor(truncated, dtype=torch.bool, device=batch.rewards.device)
    metrics = {"train/truncated_share": float(rows.float().mean()) if len(truncated) else 0.0}
    rewards, mask = batch.rewards, batch.response_mask
    if spec.overlong_buffer:
        penalty = overlong_penalty(mask.sum(1), spec)
        rewards = rewards + penalty
        metrics["train/overlong_penalty_mean"] = float(penalty.mean())
    if spec.mask_truncated:
        mask = mask * (~rows).to(mask.dtype)[:, None]
        metrics["train/truncated_masked"] = float(rows.sum())
    return dataclasses.replace(batch, rewards=rewards, response_mask=mask), metrics
