"""Loss aggregation: per-token values to one number. Pure functions of tensors.

Every function takes ``values`` and ``mask`` of shape ``(batch, response_len)``, ``mask`` 1 on
the tokens that are trained, and returns a scalar. :data:`LOSS_AGG` is chosen by
``algorithm.loss_agg_mode``; ``seq-mean-token-sum-norm`` also takes its constant length
(:func:`aggregation_of` binds it).

Every mode is a sum over rows divided by a count of the rows' mask, its
:data:`NORMALISERS` entry. So a batch cut into parts (micro-batches, ranks) gives the
whole batch's value and gradient when each part's value is weighed by
``normaliser(part's mask) / normaliser(whole mask)`` (:func:`normaliser`). A new mode
registers its normaliser beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

AggregateFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(values, mask) -> scalar``."""
NormaliserFn = Callable[[torch.Tensor], torch.Tensor]
"""``mask -> scalar``: what an aggregation divides its sum over rows by."""


def trained_tokens(mask: torch.Tensor) -> torch.Tensor:
    """The number of trained tokens (``token-mean`` divides by it)."""
    return mask.sum()


def trained_sequences(mask: torch.Tensor) -> torch.Tensor:
    """The number of sequences with a trained token (the ``seq-mean-*`` modes divide by it)."""
    return (mask.sum(dim=1) > 0).sum()


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over every unmasked token of the batch (long responses weigh more, as in DAPO)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / trained_tokens(mask).clamp_min(1.0)


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over tokens within each sequence, then over sequences (the original GRPO)."""
    mask = mask.to(values.dtype)
    per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    return _mean_over_sequences(per_seq, mask)


def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over tokens within each sequence, mean over sequences."""
    mask = mask.to(values.dtype)
    return _mean_over_sequences((values * mask).sum(dim=1), mask)


def seq_mean_token_sum_norm(
    values: torch.Tensor, mask: torch.Tensor, length: int = 1
) -> torch.Tensor:
    """Sum over tokens within each sequence divided by a constant ``length`` (the longest
    response allowed), mean over sequences: Dr. GRPO's unbiased normaliser (Liu et al.,
    "Understanding R1-Zero-Like Training", 2025), where a per-sequence token mean would
    favour long wrong answers and short right ones."""
    return seq_mean_token_sum(values, mask) / float(length)


def _mean_over_sequences(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the sequences with at least one trained token (an empty one counts for
    nothing, and an all-empty batch gives 0, not NaN)."""
    has_tokens = (mask.sum(dim=1) > 0).to(per_seq.dtype)
    count = trained_sequences(mask).to(per_seq.dtype)
    return (per_seq * has_tokens).sum() / count.clamp_min(1.0)


LOSS_AGG: dict[str, AggregateFn] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}
"""``algorithm.loss_agg_mode`` -> aggregation."""

NORMALISERS: dict[str, NormaliserFn] = {
    "token-mean": trained_tokens,
    "seq-mean-token-mean": trained_sequences,
    "seq-mean-token-sum": trained_sequences,
    "seq-mean-token-sum-norm": trained_sequences,  # times its constant length
}
"""``algorithm.loss_agg_mode`` -> what its :data:`LOSS_AGG` entry divides by (up to a
constant factor, which cancels in a part's share)."""

LENGTH_NORMALISED = frozenset({"seq-mean-token-sum-norm"})
"""Modes whose function takes the constant ``length`` (``algorithm.norm_length``)."""


def aggregation_of(mode: str, length: int = 1) -> AggregateFn:
    """The :data:`LOSS_AGG` entry ``mode`` as ``(values, mask) -> scalar``, with ``length``
    bound for the :data:`LENGTH_NORMALISED` modes."""
    try:
        fn: Callable[..., torch.Tensor] = LOSS_AGG[mode]
    except KeyError:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; known: {', '.join(LOSS_AGG)}"
        ) from None
    return functools.partial(fn, length=length) if mode in LENGTH_NORMALISED else fn


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, length: int = 1) -> torch.Tensor:
    """Reduce per-token values to a scalar with the :data:`LOSS_AGG` entry ``mode``."""
    return aggregation_of(mode, length)(values, mask)


def normaliser(mask: torch.Tensor, mode: str) -> float:
    """What the :data:`LOSS_AGG` entry ``mode`` divides by over the rows of ``mask`` (before
    its clamp to 1): a part of a batch weighs ``normaliser(part) / normaliser(batch)``."""
    try:
        fn = NORMALISERS[mode]
    except KeyError:
        raise ValueError(
            f"no normaliser for loss aggregation mode {mode!r}; known: {', '.join(NORMALISERS)}"
        ) from None
    return float(fn(mask))
