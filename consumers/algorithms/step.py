"""One policy-optimisation step over a batch of experience groups, built from the parts of
the resolved algorithm (:mod:`streamrft.consumers.algorithms.presets`).

The step: advantages per group, reference log-probs when a KL term is on, then
``trainer.ppo_epochs`` passes, each one optimizer step over micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrft.consumers.algorithms.presets import ResolvedAlgorithm, resolve_algorithm
from streamrft.consumers.batching import PolicyBatch, collate, response_logprobs
from streamrft.infra.config import TrainerConfig
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


def policy_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[ExperienceGroup],
    cfg: TrainerConfig,
    pad_id: int,
    temperature: float,
    ref_model: torch.nn.Module | None = None,
    version: int | None = None,
) -> dict[str, float]:
    """Advantages per group, then ``ppo_epochs`` passes of the policy loss (+ KL).
    ``version``: the one the model holds, for the rollout/trainer mismatch metrics."""
    algo = resolve_algorithm(cfg)
    inputs = prepare_inputs(algo, groups, cfg, pad_id, temperature, ref_model)
    n = len(inputs.advantages)
    micro = cfg.micro_batch_size or n
    model.train()
    stats: dict[str, float] = {}
    first_logp_diff = 0.0
    mismatch = Mismatch()
    for epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for lo in range(0, n, micro):
            rows, size = slice(lo, lo + micro), min(lo + micro, n) - lo
            loss, info, logp = micro_batch_loss(algo, model, inputs, rows, cfg, temperature)
            (loss * size / n).backward()
            if epoch == 0:
                first_logp_diff = max(first_logp_diff, logprob_drift(inputs.batch, rows, logp))
                mismatch.add(inputs.batch, rows, logp, version)
            for k, v in {"loss": float(loss.detach()), **info}.items():
                stats[k] = stats.get(k, 0.0) + v * size / n / cfg.ppo_epochs
        grad_norm = optimizer_step(model, optimizer, cfg.grad_clip)
    model.eval()
    metrics = step_metrics(inputs, stats, grad_norm, first_logp_diff, len(groups))
    return metrics if version is None else {**metrics, **mismatch.metrics()}


def prepare_inputs(
    algo: ResolvedAlgorithm,
    groups: list[ExperienceGroup],
    cfg: TrainerConfig,
    pad_id: int,
    temperature: float,
    ref_model: torch.nn.Module | None,
) -> StepInputs:
    """Collate the groups, compute advantages and (with a KL term) reference log-probs."""
    batch = collate([e for g in groups for e in g.experiences], pad_id)
    adv = algo.advantage(batch.rewards, [len(g.experiences) for g in groups], cfg)
    ref_logp = None
    if ref_model is not None and cfg.kl_coef > 0:
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
    inputs: StepInputs,
    rows: slice,
    cfg: TrainerConfig,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Loss of the micro-batch ``rows`` (policy loss + ``kl_coef`` x KL), its diagnostics,
    and the policy's log-probs it was computed from."""
    batch = inputs.batch
    logp = response_logprobs(
        model, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_width, temperature
    )
    mask = batch.response_mask[rows]
    loss, info = algo.policy_loss(
        logp, batch.old_logprobs[rows], inputs.token_advantages[rows], mask, cfg
    )
    if inputs.ref_logprobs is not None:
        kl = algo.aggregate(algo.kl_loss(logp, inputs.ref_logprobs[rows]), mask)
        loss = loss + cfg.kl_coef * kl
        info = {**info, "kl_ref": float(kl.detach())}
    return loss, info, logp


@torch.no_grad()
def logprob_drift(batch: PolicyBatch, rows: slice, logp: torch.Tensor) -> float:
    """Largest |recomputed - sampled| log-prob on trained tokens (0 up to numerics before
    the first update: the explorer and the trainer agree)."""
    return float(((logp - batch.old_logprobs[rows]).abs() * batch.response_mask[rows]).max())


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
    def add(self, batch: PolicyBatch, rows: slice, logp: torch.Tensor, version: int | None):
        if version is None:
            return
        mask = batch.response_mask[rows] * (batch.versions[rows] == version)[:, None]
        diff = (logp - batch.old_logprobs[rows]).abs() * mask
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


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float
) -> torch.Tensor:
    """Clip the global grad norm to ``grad_clip`` (0: no clipping), step; the norm before."""
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        grad_norm = torch.sqrt(
            sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None)
        )
    optimizer.step()
    return grad_norm


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
