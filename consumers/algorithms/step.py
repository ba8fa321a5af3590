"""One policy-optimisation step over a batch of experience groups, built from the parts of
the resolved algorithm (:mod:`streamrft.consumers.algorithms.presets`).

The step: advantages per group, reference log-probs when a KL term is on, then
``trainer.ppo_epochs`` passes, each one optimizer step over micro-batches. A micro-batch's
loss is weighed by its rows' share of what ``trainer.loss_agg_mode`` divides by
(:func:`~.aggregation.normaliser`), so the gradient and the reported loss are the whole
batch's, however it is cut (``trainer.micro_batch_size``,
``trainer.max_tokens_per_micro_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrft.consumers.algorithms.aggregation import normaliser
from streamrft.consumers.algorithms.presets import ResolvedAlgorithm, resolve_algorithm
from streamrft.consumers.batching import PolicyBatch, collate, micro_slices, response_logprobs
from streamrft.consumers.precision import FP32, Precision
from streamrft.infra.config import TrainerConfig
from streamrft.infra.modeling import model_device
from streamrft.schemas.experience import ExperienceGroup


@dataclass
class StepInputs:
    """What every micro-batch of the step reads."""

    batch: PolicyBatch
    advantages: torch.Tensor
    """``(B,)``, one per rollout."""
    token_advantages: torch.Tensor
    """``(B, R)``: each rollout's advantage over its response tokens."""
    ref_logprobs: torch.Tensor | None
    """``(B, R)`` reference log-probs, or None without a KL term."""

    def rows(self, lo: int, hi: int) -> StepInputs:
        """Rows ``lo:hi``, padded only to their own widths (a micro-batch)."""
        batch = self.batch.rows(lo, hi)
        width = batch.old_logprobs.shape[1]
        ref = None if self.ref_logprobs is None else self.ref_logprobs[lo:hi, :width]
        return StepInputs(batch, self.advantages[lo:hi], self.token_advantages[lo:hi, :width], ref)


def policy_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[ExperienceGroup],
    cfg: TrainerConfig,
    pad_id: int,
    temperature: float,
    ref_model: torch.nn.Module | None = None,
    version: int | None = None,
    precision: Precision = FP32,
    share: BatchShare | None = None,
) -> dict[str, float]:
    """Advantages per group, then ``ppo_epochs`` passes of the policy loss (+ KL).
    ``version``: the one the model holds, for the rollout/trainer mismatch metrics;
    ``precision``: the device's compute dtype and loss scaling; ``share``: the rows this
    process trains (None: all of them)."""
    share = share or BatchShare(cfg.loss_agg_mode)
    algo = resolve_algorithm(cfg)
    inputs = prepare_inputs(
        algo, groups, cfg, pad_id, temperature, ref_model, model_device(model), precision
    )
    batch = inputs.batch
    slices = micro_slices(
        batch.prompt_lengths(),
        batch.response_lengths(),
        cfg.micro_batch_size,
        cfg.max_tokens_per_micro_batch,
    )
    model.train()
    stats: dict[str, float] = {}
    first_logp_diff = 0.0
    mismatch = Mismatch()
    for epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for lo, hi in slices:
            lo, hi, part, whole = share.rows(batch, lo, hi)
            micro = inputs.rows(lo, hi)
            with precision.autocast():
                loss, info, logp = micro_batch_loss(algo, model, micro, cfg, temperature)
            precision.backward(loss * part / whole)
            if epoch == 0 and part:
                first_logp_diff = max(first_logp_diff, logprob_drift(micro.batch, logp))
                mismatch.add(micro.batch, logp, version)
            for k, v in {"loss": float(loss.detach()), **info}.items():
                stats[k] = stats.get(k, 0.0) + v * part / whole / cfg.ppo_epochs
        grad_norm = precision.step(model, optimizer, cfg.grad_clip)
    model.eval()
    stats, first_logp_diff = share.combine(stats, first_logp_diff, mismatch)
    metrics = step_metrics(inputs, stats, grad_norm, first_logp_diff, len(groups))
    metrics["train/micro_batches"] = float(len(slices))
    return metrics if version is None else {**metrics, **mismatch.metrics()}


def prepare_inputs(
    algo: ResolvedAlgorithm,
    groups: list[ExperienceGroup],
    cfg: TrainerConfig,
    pad_id: int,
    temperature: float,
    ref_model: torch.nn.Module | None,
    device: torch.device,
    precision: Precision = FP32,
) -> StepInputs:
    """Collate the groups onto the model's device, compute advantages and (with a KL term)
    reference log-probs."""
    batch = collate([e for g in groups for e in g.experiences], pad_id).to(device)
    adv = algo.advantage(batch.rewards, [len(g.experiences) for g in groups], cfg)
    ref_logp = None
    if ref_model is not None and cfg.kl_coef > 0:
        with precision.autocast():
            ref_logp = reference_logprobs(ref_model, batch, temperature)
    return StepInputs(batch, adv, adv[:, None].expand_as(batch.old_logprobs), ref_logp)


@torch.no_grad()
def reference_logprobs(
    ref_model: torch.nn.Module, batch: PolicyBatch, temperature: float
) -> torch.Tensor:
    return response_logprobs(
        ref_model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature
    )


def micro_batch_loss(
    algo: ResolvedAlgorithm,
    model: torch.nn.Module,
    micro: StepInputs,
    cfg: TrainerConfig,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Loss of the micro-batch (policy loss + ``kl_coef`` x KL), its diagnostics, and the
    policy's log-probs it was computed from."""
    batch = micro.batch
    logp = response_logprobs(
        model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature
    )
    mask = batch.response_mask
    loss, info = algo.policy_loss(logp, batch.old_logprobs, micro.token_advantages, mask, cfg)
    if micro.ref_logprobs is not None:
        kl = algo.aggregate(algo.kl_loss(logp, micro.ref_logprobs), mask)
        loss = loss + cfg.kl_coef * kl
        info = {**info, "kl_ref": float(kl.detach())}
    return loss, info, logp


@torch.no_grad()
def logprob_drift(batch: PolicyBatch, logp: torch.Tensor) -> float:
    """Largest |recomputed - sampled| log-prob on trained tokens (0 up to numerics before
    the first update: the explorer and the trainer agree)."""
    return float(((logp - batch.old_logprobs).abs() * batch.response_mask).max())


@dataclass
class Mismatch:
    """|trainer - rollout| log-probs of trained tokens sampled with the version the model
    holds (before the step's first update): the engines' numerical mismatch, apart from
    any policy change. Off-policy corrections need it; it is 0 up to numerics when the
    explorer and the trainer compute alike."""

    total: float = 0.0
    tokens: float = 0.0
    largest: float = 0.0

    @torch.no_grad()
    def add(self, batch: PolicyBatch, logp: torch.Tensor, version: int | None):
        if version is None:
            return
        mask = batch.response_mask * (batch.versions == version)[:, None]
        diff = (logp - batch.old_logprobs).abs() * mask
        self.total += float(diff.sum())
        self.tokens += float(mask.sum())
        self.largest = max(self.largest, float(diff.max())) if mask.any() else self.largest

    def metrics(self) -> dict[str, float]:
        """``train/rollout_logprob_diff_{mean,max}`` and the tokens they cover; only the
        count when no trained token was sampled with the model's version."""
        out = {"train/rollout_logprob_diff_tokens": self.tokens}
        if self.tokens:
            out["train/rollout_logprob_diff_mean"] = self.total / self.tokens
            out["train/rollout_logprob_diff_max"] = self.largest
        return out


class BatchShare:
    """Which rows of each micro-batch this process trains, and their weight in the step's
    loss; here every row (one process), weighed by the micro-batch's share of the batch's
    normaliser under ``loss_agg_mode`` (:func:`~.aggregation.normaliser`). A data-parallel
    engine passes its own (``consumers/distributed.py`` ``RankShare``)."""

    def __init__(self, loss_agg_mode: str) -> None:
        self.mode = loss_agg_mode

    def rows(self, batch: PolicyBatch, lo: int, hi: int) -> tuple[int, int, float, float]:
        """``(lo, hi, part, whole)`` of this process for the micro-batch ``lo:hi``: its
        rows and their loss's weight ``part / whole``."""
        return lo, hi, normaliser(batch.response_mask[lo:hi], self.mode), self.whole(batch)

    def whole(self, batch: PolicyBatch) -> float:
        """The batch's normaliser (1 when it is 0: then every part's is 0 too)."""
        return normaliser(batch.response_mask, self.mode) or 1.0

    def combine(
        self, stats: dict[str, float], drift: float, mismatch: Mismatch
    ) -> tuple[dict[str, float], float]:
        """The step's statistics and log-prob drift over every process (and ``mismatch``
        updated in place); here this process's own."""
        return stats, drift


def step_metrics(
    inputs: StepInputs,
    stats: dict[str, float],
    grad_norm: torch.Tensor,
    first_logp_diff: float,
    groups: int,
) -> dict[str, float]:
    batch = inputs.batch
    return {
        **{f"train/{k}": v for k, v in stats.items()},
        "train/grad_norm": float(grad_norm),
        "train/reward_mean": float(batch.rewards.mean()),
        "train/advantage_abs_mean": float(inputs.advantages.abs().mean()),
        "train/response_length": float(batch.response_mask.sum(1).mean()),
        "train/logprob_max_abs_diff": first_logp_diff,
        "train/groups": float(groups),
    }
