"""DPO: Direct Preference Optimization (Rafailov et al., 2023, arXiv 2305.18290).

The data are preference pairs: experience groups of kind ``preference`` (the
``preference`` workflow, or any producer), the chosen experience first, the rejected one
second, with the same prompt. A pair's loss is

    -log sigmoid(beta x ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))

where ``log pi(y)`` is the sum of the policy's log-probs of the trained tokens of
response ``y`` and ``ref`` is the reference model: the weights DPO started from (after
any warm-up), frozen. The step's loss is the mean over pairs. ``beta`` is
``algorithm.dpo_beta``.

:func:`dpo_step` is the train engine's step when ``algorithm.policy_loss_fn`` is ``dpo``:
one process (``trainer.nproc`` 1, checked at start-up), pairs never split across
micro-batches, ``trainer.ppo_epochs`` passes of one optimizer step each over the batch.
Its metrics are those of the first pass (before the step's first update): the margin on
pairs the policy has not been trained on yet. A trainer that runs DPO dead-letters every
group that is not a pair, and a trainer that does not dead-letters pairs
(:func:`check_group_kind`, applied by the intake); a non-pair that reaches
:func:`dpo_step` anyway is a :class:`SchemaError`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamrft.consumers.algorithms.presets import ResolvedAlgorithm
from streamrft.consumers.algorithms.step import frozen_logprobs
from streamrft.consumers.batching import collate, logprobs_and_entropy, micro_slices
from streamrft.consumers.precision import FP32, Precision
from streamrft.infra.config import TrainerConfig
from streamrft.infra.modeling import model_device
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import PREFERENCE, ExperienceGroup


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` sums of each row's log-probs over its trained tokens (``mask`` 1)."""
    return (logprobs * mask.to(logprobs.dtype)).sum(-1)


def dpo_loss(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean DPO loss of the pairs and each pair's implicit reward margin
    ``beta x ((pi_c - ref_c) - (pi_r - ref_r))``. ``policy`` and ``reference``: ``(2N,)``
    sequence log-probs, rows ``2i`` chosen and ``2i + 1`` rejected."""
    log_ratio = policy - reference
    margin = beta * (log_ratio[0::2] - log_ratio[1::2])
    return -F.logsigmoid(margin).mean(), margin


def check_group_kind(group: ExperienceGroup, pairs: bool) -> ExperienceGroup:
    """``group`` is a preference pair exactly when the trainer trains pairs (``pairs``:
    ``dpo``); a :class:`SchemaError` naming the rule otherwise (the intake dead-letters)."""
    if pairs and group.kind != PREFERENCE:
        raise SchemaError(
            f"group {group.id!r}: kind {group.kind!r}, but algorithm.policy_loss_fn 'dpo' "
            f"trains only groups of kind {PREFERENCE!r} (chosen/rejected pairs)"
        )
    if not pairs and group.kind == PREFERENCE:
        raise SchemaError(
            f"group {group.id!r}: a {PREFERENCE!r} pair is trained only by "
            "algorithm.policy_loss_fn 'dpo'"
        )
    return group


def pair_slices(
    prompt_lengths: list[int], response_lengths: list[int], rows: int, tokens: int
) -> list[tuple[int, int]]:
    """Row ranges of the micro-batches (``trainer.micro_batch_size`` rows,
    ``trainer.max_tokens_per_micro_batch`` tokens) that never split a pair: the pairs are
    cut as units of 2 rows."""
    units = micro_slices(
        prompt_lengths[0::2],
        [max(c, r) for c, r in zip(response_lengths[0::2], response_lengths[1::2], strict=True)],
        max(1, rows // 2) if rows else 0,
        max(1, tokens // 2) if tokens else 0,
    )
    return [(2 * lo, 2 * hi) for lo, hi in units]


def dpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[ExperienceGroup],
    cfg: TrainerConfig,
    algo: ResolvedAlgorithm,
    pad_id: int,
    ref_model: torch.nn.Module,
    precision: Precision = FP32,
) -> dict[str, float]:
    """``cfg.ppo_epochs`` passes of the DPO loss over the pairs of ``groups`` (all of kind
    ``preference``), each one optimizer step; the metrics of the first pass."""
    for group in groups:
        check_group_kind(group, pairs=True)
    batch = collate([e for g in groups for e in g.experiences], pad_id).to(model_device(model))
    slices = pair_slices(
        batch.prompt_lengths(),
        batch.response_lengths(),
        cfg.micro_batch_size,
        cfg.max_tokens_per_micro_batch,
    )
    mask = batch.response_mask
    reference = sequence_logprobs(frozen_logprobs(ref_model, batch, slices, 1.0, precision), mask)
    model.train()
    first: dict[str, float] = {}
    for epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        policy = torch.zeros_like(reference)
        for lo, hi in slices:
            rows = batch.rows(lo, hi)
            with precision.autocast():
                logp, _ = logprobs_and_entropy(
                    model, rows.input_ids, rows.attention_mask, rows.prompt_width
                )
            seq = sequence_logprobs(logp.float(), rows.response_mask)
            loss, _ = dpo_loss(seq, reference[lo:hi], algo.spec.dpo_beta)
            precision.backward(loss * (hi - lo) / len(reference))
            policy[lo:hi] = seq.detach()
        grad_norm = precision.step(model, optimizer, cfg.grad_clip)
        if epoch == 0:
            first = pair_metrics(policy, reference, algo.spec.dpo_beta, grad_norm)
    model.eval()
    return {**first, "train/groups": float(len(groups))}


@torch.no_grad()
def pair_metrics(
    policy: torch.Tensor, reference: torch.Tensor, beta: float, grad_norm: torch.Tensor
) -> dict[str, float]:
    """The loss, margin (mean implicit reward margin), accuracy (fraction of pairs with a
    positive margin) and the policy's mean chosen and rejected sequence log-probs."""
    loss, margin = dpo_loss(policy, reference, beta)
    return {
        "train/loss": float(loss),
        "train/dpo_margin": float(margin.mean()),
        "train/dpo_accuracy": float((margin > 0).float().mean()),
        "train/dpo_chosen_logprob": float(policy[0::2].mean()),
        "train/dpo_rejected_logprob": float(policy[1::2].mean()),
        "train/grad_norm": float(grad_norm),
    }
