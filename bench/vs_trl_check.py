"""One step of both on the same batch: does streamrft's step move the weights as TRL's does?

TRL's ``GRPOTrainer`` (the options :func:`vs_trl_setup.trl_options` maps the config to)
trains one batch: it generates the completions, scores them, computes the advantages and
makes its ``num_iterations`` updates; the batch it built is kept (the output of its
``_generate_and_score_completions``, looked at, not changed). The same completions and
rewards then go, as experience groups, through streamrft's train engine
(``make_train_engine(cfg).train_step``: the trainer's step) from the same starting weights,
with the log-probs streamrft's own code computes for them (an explorer's, up to numerics).

Compared (:func:`check_step`): the rollout log-probs (TRL's ``old_per_token_logps``
against streamrft's), the advantages (raw, and with TRL's documented epsilon: it divides
by ``std + 1e-4`` where streamrft divides by ``std + 1e-6``), the loss (the mean of TRL's
updates against streamrft's ``train/loss``, itself the mean over its ``ppo_epochs``), and
the weights after the step (the largest difference against the largest change, and the
cosine of the two changes).
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl_setup import read_config, trl_options  # bench/, beside us

TRL_STD_EPS = 1e-4
SRFT_STD_EPS = 1e-6
"""The epsilon each adds to a group's reward std before dividing (TRL: ``grpo_trainer.py``;
streamrft: ``consumers/algorithms/advantages.py`` ``group_advantages``)."""

CHECK_LIMITS = {
    ("as_run", "logprob_max_diff"): 1e-4,
    ("", "advantage_max_diff_trl_eps"): 1e-5,
    ("eps_matched", "loss_rel_diff"): 1e-5,
    ("eps_matched", "update_rel_l2"): 1e-3,
    ("as_run", "update_rel_l2"): 1e-2,
}
"""Upper bounds of the one-step check's differences (float32 sums of another order, and
Adam's first steps, which turn the last bits of a near-zero gradient into a whole step)."""


def check_failures(check: dict) -> list[str]:
    """The one-step check's figures past :data:`CHECK_LIMITS`."""
    out = []
    for (part, key), limit in CHECK_LIMITS.items():
        value = (check[part] if part else check)[key]
        if not value <= limit:
            out.append(f"{part or 'check'}.{key} = {value:.3g} > {limit:g}")
    return out


def trl_one_step(cfg, out_dir: Path) -> dict:
    """TRL's trainer on one batch (``ppo_epochs`` optimizer steps): the weights before and
    after, the batch it built, its rewards and the loss of each update."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from streamrft.infra.taskset import read_training_set
    from streamrft.producers.rewards import get_reward
    from streamrft.schemas.experience import Task

    reward = get_reward(cfg.explorer.reward, cfg.explorer.reward_skips_thinking, cfg.reward)
    seen: dict = {"rewards": [], "losses": []}

    def score(prompts, completions, answer, id, **_):
        values = [
            reward(text, Task(id=i, prompt=p, answer=a))[0]
            for p, text, a, i in zip(prompts, completions, answer, id, strict=True)
        ]
        seen["rewards"].append(values)
        return values

    tasks = read_training_set(cfg.taskset)
    options = trl_options(cfg, out_dir) | {
        "max_steps": cfg.trainer.ppo_epochs,
        "save_strategy": "no",
    }
    trainer = GRPOTrainer(
        model=cfg.model.path,
        reward_funcs=score,
        args=GRPOConfig(**options),
        train_dataset=Dataset.from_list(
            [{"prompt": t.prompt, "answer": t.answer, "id": t.id} for t in tasks]
        ),
    )
    build, compute_loss = trainer._generate_and_score_completions, trainer.compute_loss

    def kept_batch(inputs):
        out = build(inputs)
        seen["batch"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()}
        return out

    def kept_loss(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        seen["losses"].append(float(loss.detach()))
        return loss

    trainer._generate_and_score_completions = kept_batch
    trainer.compute_loss = kept_loss
    seen["before"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    seen["after"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if len(seen["rewards"]) != 1:
        raise RuntimeError(f"TRL generated {len(seen['rewards'])} batches, expected 1")
    return seen


def groups_of(batch: dict, rewards: list[float], group: int) -> list:
    """TRL's batch as streamrft experience groups: each prompt's ``group`` consecutive
    completions (the order TRL's sampler gives them), their tokens up to the mask, log-probs
    0 (filled in by :func:`with_logprobs`)."""
    from streamrft.client.groups import make_group

    rows = []
    for i in range(batch["prompt_ids"].shape[0]):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        response = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        rows.append((prompt, response, [0.0] * len(response), rewards[i]))
    return [
        make_group("vs-trl", f"task-{g}", rows[g * group : (g + 1) * group], 0, "check")
        for g in range(len(rows) // group)
    ]


@torch.no_grad()
def with_logprobs(
    groups: list, model, pad_id: int, temperature: float
) -> tuple[list, torch.Tensor]:
    """``groups`` with each experience's log-probs as streamrft's trainer computes them with
    ``model`` (``logprobs_and_entropy``), and those log-probs ``(B, R)``."""
    import msgspec
    import numpy as np

    from streamrft.consumers.batching import collate, logprobs_and_entropy

    experiences = [e for g in groups for e in g.experiences]
    batch = collate(experiences, pad_id)
    logp, _ = logprobs_and_entropy(
        model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature
    )
    out, row = [], 0
    for g in groups:
        done = []
        for e in g.experiences:
            n = e.response_length
            values = logp[row, :n].numpy().astype("<f4")
            done.append(msgspec.structs.replace(e, logprobs=np.ascontiguousarray(values).tobytes()))
            row += 1
        out.append(msgspec.structs.replace(g, experiences=done))
    return out, logp * batch.response_mask


def srft_step(cfg, batch: dict, rewards: list[float], std_eps: float | None = None) -> dict:
    """streamrft's trainer step (``make_train_engine(cfg).train_step``) on TRL's batch from
    the config's model folder: its metrics, the weights before and after, the log-probs it
    computed. ``std_eps``: the epsilon of the group std in the advantages, in place of
    streamrft's own for this step only (``None``: streamrft's own, as it runs)."""
    from streamrft.consumers.algorithms import advantages
    from streamrft.consumers.train_engine import make_train_engine

    engine = make_train_engine(cfg)
    engine.prepare()
    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    groups, logp = with_logprobs(
        groups_of(batch, rewards, cfg.explorer.repeat_times),
        engine.model,
        engine.tokenizer.pad_token_id,
        cfg.explorer.temperature,
    )
    own = advantages.group_advantages
    if std_eps is not None:
        advantages.group_advantages = functools.partial(own, eps=std_eps)
    try:
        metrics = engine.train_step(groups, 0)
    finally:
        advantages.group_advantages = own
    after = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return {"metrics": metrics, "before": before, "after": after, "logp": logp}


def weight_figures(trl: dict, srft: dict) -> dict:
    """How far streamrft's update is from TRL's: the largest difference of any weight
    against the largest change, the relative L2 distance and the cosine of the updates."""
    diffs, changes, dots, norm_a, norm_b, norm_d = [], [], 0.0, 0.0, 0.0, 0.0
    for name, w0 in srft["before"].items():
        if not torch.equal(trl["before"][name], w0):
            raise RuntimeError(f"{name}: the two start from different weights")
        a = (trl["after"][name] - w0).double()
        b = (srft["after"][name] - w0).double()
        diffs.append(float((a - b).abs().max()))
        changes.append(float(a.abs().max()))
        dots += float((a * b).sum())
        norm_a += float((a * a).sum())
        norm_b += float((b * b).sum())
        norm_d += float(((a - b) ** 2).sum())
    return {
        "weight_max_diff": max(diffs),
        "weight_max_change": max(changes),
        "update_rel_l2": math.sqrt(norm_d / norm_a),
        "update_cosine": dots / math.sqrt(norm_a * norm_b),
    }


def check_step(config: Path, work: Path) -> dict:
    """Both steps on one batch from the config's model folder; the differences, of
    streamrft as it runs and (``eps_matched``) with TRL's epsilon in its advantages."""
    from streamrft.consumers.algorithms.advantages import group_advantages

    cfg = read_config(config)
    trl = trl_one_step(cfg, work / "trl-check")
    batch, rewards = trl["batch"], trl["rewards"][0]
    group = cfg.explorer.repeat_times
    r = torch.tensor(rewards)
    trl_adv = batch["advantages"].float()
    std = r.view(-1, group).std(dim=1, unbiased=True).repeat_interleave(group)
    srft_adv = group_advantages(r.view(-1, group)).reshape(-1)
    as_trl = srft_adv * (std + SRFT_STD_EPS) / (std + TRL_STD_EPS)
    trl_loss = sum(trl["losses"]) / len(trl["losses"])
    out: dict = {
        "rows": int(r.numel()),
        "groups": int(r.numel()) // group,
        "reward_mean": round(float(r.mean()), 4),
        "advantage_max_diff": float((srft_adv - trl_adv).abs().max()),
        "advantage_max_diff_trl_eps": float((as_trl - trl_adv).abs().max()),
        "trl_losses": trl["losses"],
        "trl_loss": trl_loss,
    }
    for label, eps in (("as_run", None), ("eps_matched", TRL_STD_EPS)):
        srft = srft_step(cfg, batch, rewards, eps)
        mask = batch["completion_mask"].float()
        width = min(srft["logp"].shape[1], mask.shape[1])
        trl_logp = batch["old_per_token_logps"][:, :width] * mask[:, :width]
        loss = srft["metrics"]["train/loss"]
        out[label] = {
            "logprob_max_diff": float((srft["logp"][:, :width] - trl_logp).abs().max()),
            "streamrft_loss": loss,
            "loss_rel_diff": abs(trl_loss - loss) / abs(trl_loss),
            **weight_figures(trl, srft),
        }
    return out
