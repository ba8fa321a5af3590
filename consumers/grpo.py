"""One GRPO optimisation step over a batch of experience groups."""

from __future__ import annotations

import torch

from streamrft.consumers.advantages import group_advantages
from streamrft.consumers.batching import collate, response_logprobs
from streamrft.consumers.losses import aggregate, clipped_surrogate, kl_k3
from streamrft.infra.config import TrainerConfig
from streamrft.schemas.experience import ExperienceGroup


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[ExperienceGroup],
    cfg: TrainerConfig,
    pad_id: int,
    temperature: float,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Advantages per group, then ``ppo_epochs`` passes of the clipped surrogate (+ KL)."""
    sizes = {len(g.experiences) for g in groups}
    experiences = [e for g in groups for e in g.experiences]
    batch = collate(experiences, pad_id)
    if len(sizes) == 1:
        adv = group_advantages(
            batch.rewards.view(len(groups), -1), std_normalize=cfg.std_normalize
        ).view(-1)
    else:  # groups of unequal size: normalise each on its own
        parts, start = [], 0
        for g in groups:
            n = len(g.experiences)
            parts.append(
                group_advantages(
                    batch.rewards[start : start + n].view(1, -1), std_normalize=cfg.std_normalize
                ).view(-1)
            )
            start += n
        adv = torch.cat(parts)
    token_adv = adv[:, None].expand_as(batch.old_logprobs)
    ref_logp = None
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref_logp = response_logprobs(
                ref_model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature
            )
    n = len(experiences)
    micro = cfg.micro_batch_size or n
    model.train()
    stats: dict[str, float] = {}
    first_logp_diff = 0.0
    for epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for lo in range(0, n, micro):
            sl = slice(lo, lo + micro)
            logp = response_logprobs(
                model,
                batch.input_ids[sl],
                batch.attention_mask[sl],
                batch.prompt_width,
                temperature,
            )
            mask = batch.response_mask[sl]
            loss, info = clipped_surrogate(
                logp,
                batch.old_logprobs[sl],
                token_adv[sl],
                mask,
                cfg.clip_low,
                cfg.clip_high,
                cfg.loss_agg_mode,
            )
            if ref_logp is not None:
                kl = aggregate(kl_k3(logp, ref_logp[sl]), mask, cfg.loss_agg_mode)
                loss = loss + cfg.kl_coef * kl
                info["kl_ref"] = float(kl)
            (loss * (min(lo + micro, n) - lo) / n).backward()
            if epoch == 0:
                with torch.no_grad():
                    diff = ((logp - batch.old_logprobs[sl]).abs() * mask).max()
                first_logp_diff = max(first_logp_diff, float(diff))
            for k, v in {"loss": float(loss.detach()), **info}.items():
                stats[k] = stats.get(k, 0.0) + v * (min(lo + micro, n) - lo) / n / cfg.ppo_epochs
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if cfg.grad_clip > 0
            else torch.sqrt(
                sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None)
            )
        )
        optimizer.step()
    model.eval()
    mask = batch.response_mask
    return {
        **{f"train/{k}": v for k, v in stats.items()},
        "train/grad_norm": float(grad_norm),
        "train/reward_mean": float(batch.rewards.mean()),
        "train/advantage_abs_mean": float(adv.abs().mean()),
        "train/response_length": float(mask.sum(1).mean()),
        "train/logprob_max_abs_diff": first_logp_diff,
        "train/groups": float(len(groups)),
    }
