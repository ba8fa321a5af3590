"""Supervised warm-up: a few SFT steps on (prompt, answer) pairs before RL starts."""

from __future__ import annotations

import random

import torch

from streamrft.consumers.losses import sft_loss
from streamrft.infra.expert import answer_ids
from streamrft.infra.modeling import model_device
from streamrft.infra.prompts import PromptRenderer
from streamrft.schemas.experience import Task


def sft_batch(
    tokenizer, tasks: list[Task], prompts: PromptRenderer | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + EOS`` rows; the loss mask covers answer and EOS.

    ``prompts`` renders the prompt as the explorer does (``taskset.format``; None: the
    default renderer, raw text for a tokenizer without a chat template)."""
    render = prompts or PromptRenderer(tokenizer)
    rows, masks = [], []
    for t in tasks:
        p = render.ids(t)
        a = answer_ids(tokenizer, t.answer)
        rows.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width))
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, attn, loss_mask


def sft_warmup(
    model,
    tokenizer,
    tasks: list[Task],
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    prompts: PromptRenderer | None = None,
) -> list[float]:
    """Run ``steps`` SFT steps with a fresh AdamW; returns the loss of each step. Prompts
    are rendered by ``prompts`` (see :func:`sft_batch`)."""
    if steps == 0:
        return []
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    device = model_device(model)
    model.train()
    for _ in range(steps):
        ids, attn, mask = sft_batch(tokenizer, [rng.choice(tasks) for _ in range(batch)], prompts)
        ids, attn, mask = (t.to(device) for t in (ids, attn, mask))
        logits = model(input_ids=ids, attention_mask=attn).logits
        loss = sft_loss(logits[:, :-1], ids[:, 1:], mask[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
