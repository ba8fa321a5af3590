"""One policy-optimisation step over a batch of experience groups, built from the parts of
the resolved algorithm (:mod:`streamrft.consumers.algorithms.presets`).

The step: reference log-probs when a KL term is on, the teacher's log-probs under
on-policy distillation, the KL penalty in the reward, advantages, the proximal log-probs
and token weights of an off-policy correction (:mod:`.corrections`), then ``trainer.ppo_epochs`` passes, each one optimizer step over
micro-batches. Expert groups (workflow ``expert``: a task's answer, not a sample) in an RL
batch are trained with the supervised loss weighed by ``sft_weight`` (mu), the rest by
``1 - mu`` (SFT + RL in the CHORD style); they take no part in advantages, corrections or
log-prob metrics. A micro-batch's loss is weighed by its rows' share of what
``algorithm.loss_agg_mode`` divides by (:func:`~.aggregation.normaliser`), so the gradient
and the reported loss are the whole batch's, however it is cut
(``trainer.micro_batch_size``, ``trainer.max_tokens_per_micro_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from streamrft.consumers.algorithms.advantages import AdvantageInputs, gae_returns
from streamrft.consumers.algorithms.aggregation import normaliser
from streamrft.consumers.algorithms.corrections import correct
from streamrft.consumers.algorithms.policy_losses import LossInputs, masked_mean
from streamrft.consumers.algorithms.presets import ResolvedAlgorithm
from streamrft.consumers.algorithms.shaping import shape_batch, truncated_rows
from streamrft.consumers.batching import (
    PolicyBatch,
    collate,
    logprobs_and_entropy,
    micro_slices,
)
from streamrft.consumers.precision import FP32, Precision
from streamrft.infra.config import TrainerConfig
from streamrft.infra.expert import EXPERT_WORKFLOW
from streamrft.infra.modeling import model_device
from streamrft.schemas.experience import ExperienceGroup

if TYPE_CHECKING:
    from streamrft.consumers.critic import Critic

Slices = list[tuple[int, int]]


@dataclass
class StepInputs:
    """What every micro-batch of the step reads; every tensor but the batch's is
    ``(B, R)``."""

    batch: PolicyBatch
    advantages: torch.Tensor
    """Per token, 0 off the mask."""
    base: torch.Tensor
    """Log-probs the policy ratio is taken against (the rollout's, or the proximal
    policy's under an off-policy correction)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference log-probs, or None without a KL loss."""
    weights: torch.Tensor | None = None
    """Token weights of an off-policy correction (None: 1)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Of the whole batch, computed once (corrections, the KL penalty)."""
    expert: torch.Tensor | None = None
    """``(B,)`` True on the rows of expert groups (mixed SFT + RL); None: none."""
    sft_weight: float = 0.0
    """mu: the weight of the supervised loss of the expert rows (the rest: 1 - mu)."""
    scales: tuple[float, float] = (1.0, 0.0)
    """Per-token factors of the RL rows' loss and the expert rows' (:func:`mix_scales`)."""
    values: torch.Tensor | None = None
    """The critic's values before the step (``gae``), or None; whole batch only."""
    returns: torch.Tensor | None = None
    """The critic's targets (:func:`~.advantages.gae_returns`), or None; whole batch only."""

    @property
    def rl_mask(self) -> torch.Tensor:
        return rl_mask(self.batch.response_mask, self.expert)

    def rows(self, lo: int, hi: int) -> StepInputs:
        """Rows ``lo:hi``, padded only to their own widths (a micro-batch)."""
        batch = self.batch.rows(lo, hi)
        width = batch.old_logprobs.shape[1]

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[lo:hi, :width]

        return StepInputs(
            batch,
            self.advantages[lo:hi, :width],
            self.base[lo:hi, :width],
            cut(self.ref_logprobs),
            cut(self.weights),
            expert=None if self.expert is None else self.expert[lo:hi],
            sft_weight=self.sft_weight,
            scales=self.scales,
        )


def policy_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[ExperienceGroup],
    cfg: TrainerConfig,
    algo: ResolvedAlgorithm,
    pad_id: int,
    temperature: float,
    ref_model: torch.nn.Module | None = None,
    version: int | None = None,
    precision: Precision = FP32,
    share: BatchShare | None = None,
    teacher: torch.nn.Module | None = None,
    critic: Critic | None = None,
) -> dict[str, float]:
    """The inputs of the step (:func:`prepare_inputs`), then ``ppo_epochs`` passes of the
    algorithm's loss. ``version``: the one the model holds, for the rollout/trainer
    mismatch metrics; ``precision``: the device's compute dtype and loss scaling;
    ``share``: the rows this process trains (None: all of them); ``teacher``: the frozen
    teacher of on-policy distillation (``distill``); ``critic``: PPO's value model
    (``gae``), whose values before the step go into the advantages and which is then
    trained on the step's returns, after the policy."""
    share = share or BatchShare(algo.spec.loss_agg_mode)
    device = model_device(model)
    batch = collate([e for g in groups for e in g.experiences], pad_id).to(device)
    lengths = length_metrics(batch.response_mask.sum(1))
    batch, shaping = shape_batch(batch, truncated_rows(groups), algo.spec)
    slices = _micro_slices(batch, cfg)
    inputs = prepare_inputs(
        algo,
        batch,
        [len(g.experiences) for g in groups],
        slices,
        model,
        ref_model,
        temperature,
        precision,
        teacher,
        expert_rows(groups, algo, device),
        algo.spec.sft_weight_at(version),
        None if critic is None else critic.values(batch, slices),
    )
    minis = mini_batches([len(g.experiences) for g in groups], cfg.mini_batch_size)
    stats, grad_norm, first_logp_diff, mismatch = optimise(
        algo, model, optimizer, inputs, slices, cfg, temperature, version, precision, share, minis
    )
    stats, first_logp_diff = share.combine(stats, first_logp_diff, mismatch)
    metrics = step_metrics(inputs, stats, grad_norm, first_logp_diff, len(groups))
    metrics.update(shaping)
    metrics.update(lengths)
    metrics["train/micro_batches"] = float(len(slices))
    if inputs.expert is not None:
        metrics["train/expert_groups"] = float(sum(g.workflow == EXPERT_WORKFLOW for g in groups))
        metrics["train/sft_weight"] = inputs.sft_weight
    if critic is not None and inputs.values is not None and inputs.returns is not None:
        metrics.update(critic.update(batch, slices, inputs.values, inputs.returns, inputs.rl_mask))
    return metrics if version is None else {**metrics, **mismatch.metrics()}


def optimise(
    algo: ResolvedAlgorithm,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: StepInputs,
    slices: Slices,
    cfg: TrainerConfig,
    temperature: float,
    version: int | None,
    precision: Precision,
    share: BatchShare,
    minis: list[tuple[int, int]],
) -> tuple[dict[str, float], torch.Tensor, float, Mismatch]:
    """``ppo_epochs`` passes; in each, one optimizer step per mini-batch (``minis``: row
    ranges; one: the whole batch, over ``slices``), its loss normalised over the
    mini-batch alone and accumulated over its micro-batches. Returns this process's
    statistics (weighed by each micro-batch's share, averaged over the updates), the last
    grad norm, the first pass's log-prob drift and the rollout/trainer mismatch."""
    model.train()
    stats: dict[str, float] = {}
    first_logp_diff = 0.0
    mismatch = Mismatch()
    if len(minis) == 1:
        updates = [(inputs, slices)]
    else:
        parts = [inputs.rows(lo, hi) for lo, hi in minis]
        updates = [(mini, _micro_slices(mini.batch, cfg)) for mini in parts]
    for epoch in range(cfg.ppo_epochs):
        for part_of, micro_slices_of in updates:
            optimizer.zero_grad(set_to_none=True)
            for lo, hi in micro_slices_of:
                lo, hi, part, whole = share.rows(part_of.batch, lo, hi)
                micro = part_of.rows(lo, hi)
                with precision.autocast():
                    loss, info, logp = micro_batch_loss(algo, model, micro, temperature)
                precision.backward(loss * part / whole)
                if epoch == 0 and part:
                    first_logp_diff = max(
                        first_logp_diff, logprob_drift(micro.batch, logp, micro.rl_mask)
                    )
                    mismatch.add(micro.batch, logp, version, micro.rl_mask)
                weight = part / whole / cfg.ppo_epochs / len(updates)
                for k, v in {"loss": float(loss.detach()), **info}.items():
                    stats[k] = stats.get(k, 0.0) + v * weight
            grad_norm = precision.step(model, optimizer, cfg.grad_clip)
    model.eval()
    return stats, grad_norm, first_logp_diff, mismatch


def mini_batches(group_sizes: list[int], groups_per_update: int) -> list[tuple[int, int]]:
    """Row ranges of the optimizer updates of one pass (``trainer.mini_batch_size``):
    consecutive groups, ``groups_per_update`` at a time (the last may hold fewer); 0 or
    more than the batch: one, the whole batch."""
    if not groups_per_update or groups_per_update >= len(group_sizes):
        return [(0, sum(group_sizes))]
    out, lo = [], 0
    for start in range(0, len(group_sizes), groups_per_update):
        hi = lo + sum(group_sizes[start : start + groups_per_update])
        out.append((lo, hi))
        lo = hi
    return out


def _micro_slices(batch: PolicyBatch, cfg: TrainerConfig) -> Slices:
    """The micro-batches of ``batch`` (``trainer.micro_batch_size``,
    ``max_tokens_per_micro_batch``)."""
    return micro_slices(
        batch.prompt_lengths(),
        batch.response_lengths(),
        cfg.micro_batch_size,
        cfg.max_tokens_per_micro_batch,
    )


def prepare_inputs(
    algo: ResolvedAlgorithm,
    batch: PolicyBatch,
    group_sizes: list[int],
    slices: Slices,
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    temperature: float,
    precision: Precision = FP32,
    teacher: torch.nn.Module | None = None,
    expert: torch.Tensor | None = None,
    sft_weight: float = 0.0,
    values: torch.Tensor | None = None,
) -> StepInputs:
    """Reference log-probs (a KL term), the teacher's (distillation), the KL penalty in the
    reward, the advantages (``values``: the critic's, for ``gae``; its returns are kept
    for the critic's update), and the proximal log-probs with the token weights of an
    off-policy correction."""
    spec = algo.spec
    mask = rl_mask(batch.response_mask, expert)
    ref = teacher_logp = None
    if ref_model is not None and spec.needs_reference:
        ref = frozen_logprobs(ref_model, batch, slices, temperature, precision)
    metrics: dict[str, float] = {}
    if teacher is not None and spec.needs_teacher:
        teacher_logp = frozen_logprobs(teacher, batch, slices, temperature, precision)
        reverse_kl = batch.old_logprobs - teacher_logp  # k1 of the sampled tokens
        metrics["train/teacher_reverse_kl"] = masked_mean(reverse_kl, mask)
    penalty = None
    if ref is not None and spec.kl_penalty_coef > 0:
        penalty = spec.kl_penalty_coef * algo.kl_penalty(batch.old_logprobs, ref)
        metrics["train/kl_penalty_mean"] = masked_mean(penalty, mask)
    adv_inputs = AdvantageInputs(
        batch.rewards, group_sizes, mask, penalty, batch.old_logprobs, teacher_logp, values
    )
    adv = algo.advantage(adv_inputs, spec)
    proximal = None
    if spec.needs_proximal:
        proximal = frozen_logprobs(model, batch, slices, temperature, precision)
    fix = correct(batch.old_logprobs, proximal, mask, spec)
    metrics.update({f"train/{k}": v for k, v in fix.metrics.items()})
    kl_ref = ref if spec.kl_loss_coef > 0 else None
    out = StepInputs(batch, adv * mask, fix.base, kl_ref, fix.weights, metrics, expert, sft_weight)
    if expert is not None:
        out.scales = mix_scales(batch.response_mask, expert, spec.loss_agg_mode, sft_weight)
    if values is not None:
        out.values, out.returns = values, gae_returns(adv_inputs, spec)
    return out


def mix_scales(
    mask: torch.Tensor, expert: torch.Tensor, mode: str, mu: float
) -> tuple[float, float]:
    """Per-token factors of the RL rows and the expert rows such that the step's loss,
    aggregated over the whole batch, is ``(1 - mu) x`` the RL loss aggregated over the RL
    rows ``+ mu x`` the supervised loss aggregated over the expert rows (CHORD's mix,
    each averaged over its own rows): the batch's normaliser over each part's."""
    whole = normaliser(mask, mode)
    rl, sft = normaliser(rl_mask(mask, expert), mode), normaliser(mask * expert[:, None], mode)
    return ((1.0 - mu) * whole / rl if rl else 0.0, mu * whole / sft if sft else 0.0)


def rl_mask(mask: torch.Tensor, expert: torch.Tensor | None) -> torch.Tensor:
    """``mask`` without the expert rows: the tokens the RL parts see."""
    return mask if expert is None else mask * (~expert)[:, None]


def expert_rows(
    groups: list[ExperienceGroup], algo: ResolvedAlgorithm, device: torch.device
) -> torch.Tensor | None:
    """``(B,)`` True on the rows of expert groups, or None when there are none (or the
    whole algorithm is supervised: then every row already has the supervised loss)."""
    if algo.spec.policy_loss_fn == "sft":
        return None
    rows = [g.workflow == EXPERT_WORKFLOW for g in groups for _ in g.experiences]
    return torch.tensor(rows, device=device) if any(rows) else None


@torch.no_grad()
def frozen_logprobs(
    model: torch.nn.Module,
    batch: PolicyBatch,
    slices: Slices,
    temperature: float,
    precision: Precision = FP32,
) -> torch.Tensor:
    """``(B, R)`` log-probs of the responses under ``model`` without grad, one
    micro-batch at a time (the reference model, or the policy before the step: the
    proximal log-probs)."""
    module = isinstance(model, torch.nn.Module)  # LoRA's reference is a view of the base
    was_training = module and model.training
    if module:
        model.eval()
    out = torch.zeros_like(batch.old_logprobs)
    for lo, hi in slices:
        rows = batch.rows(lo, hi)
        with precision.autocast():
            logp, _ = logprobs_and_entropy(
                model, rows.input_ids, rows.attention_mask, rows.prompt_width, temperature
            )
        out[lo:hi, : logp.shape[1]] = logp.float()
    if module:
        model.train(was_training)
    return out


def micro_batch_loss(
    algo: ResolvedAlgorithm,
    model: torch.nn.Module,
    micro: StepInputs,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Loss of the micro-batch (policy loss weighed per token, + KL, - entropy bonus), its
    diagnostics, and the policy's log-probs it was computed from."""
    spec, batch = algo.spec, micro.batch
    logp, entropy = logprobs_and_entropy(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.prompt_width,
        temperature,
        entropy=spec.entropy_coef > 0,
        measure_entropy=True,
    )
    mask = batch.response_mask
    per_token, info = algo.policy_loss(LossInputs(logp, micro.base, micro.advantages, mask), spec)
    if micro.weights is not None:
        per_token = per_token * micro.weights
    if micro.expert is not None:
        rl_scale, sft_scale = micro.scales
        per_token = torch.where(micro.expert[:, None], -sft_scale * logp, rl_scale * per_token)
        expert_mask = mask * micro.expert[:, None]
        info = {**info, "sft_nll": masked_mean(-logp.detach(), expert_mask)}
    loss = algo.aggregate(per_token, mask)
    if micro.ref_logprobs is not None:
        kl = algo.aggregate(algo.kl_loss(logp, micro.ref_logprobs), mask)
        loss = loss + spec.kl_loss_coef * kl
        info = {**info, "kl_ref": float(kl.detach())}
    if entropy is not None:  # the metric: per token; the bonus: aggregated as the loss
        if spec.entropy_coef > 0:
            loss = loss - spec.entropy_coef * algo.aggregate(entropy, mask)
        info = {**info, "entropy": masked_mean(entropy.detach(), mask)}
    return loss, info, logp


@torch.no_grad()
def logprob_drift(batch: PolicyBatch, logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |recomputed - sampled| log-prob on the tokens of ``mask`` (0 up to numerics
    before the first update: the explorer and the trainer agree)."""
    return float(((logp - batch.old_logprobs).abs() * mask).max())


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
    def add(
        self, batch: PolicyBatch, logp: torch.Tensor, version: int | None, mask: torch.Tensor
    ) -> None:
        """The tokens of ``mask`` sampled with ``version``."""
        if version is None:
            return
        mask = mask * (batch.versions == version)
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


def length_metrics(lengths: torch.Tensor) -> dict[str, float]:
    """Percentiles of the batch's response lengths (trained tokens per row, before any
    masking of truncated rows)."""
    q = torch.quantile(lengths.float(), torch.tensor([0.5, 0.9], device=lengths.device))
    return {
        "train/response_length_p50": float(q[0]),
        "train/response_length_p90": float(q[1]),
        "train/response_length_max": float(lengths.max()),
    }


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
        **inputs.metrics,
        "train/grad_norm": float(grad_norm),
        "train/reward_mean": float(batch.rewards.mean()),
        "train/advantage_abs_mean": masked_mean(inputs.advantages.abs(), batch.response_mask),
        "train/response_length": float(batch.response_mask.sum(1).mean()),
        "train/logprob_max_abs_diff": first_logp_diff,
        "train/groups": float(groups),
    }
