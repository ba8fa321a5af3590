"""Experience groups to padded tensors, and the policy's log-probs of their responses.

Layout: prompts left-padded to the longest prompt ``P``, responses right-padded to the
longest response ``R``; the row is ``[pad.. prompt | response ..pad]``. This is the layout
the explorer sampled with, so recomputed log-probs match the recorded ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrft.schemas.experience import Experience


@dataclass
class PolicyBatch:
    input_ids: torch.Tensor  # (B, P+R)
    attention_mask: torch.Tensor  # (B, P+R)
    prompt_width: int  # P
    response_mask: torch.Tensor  # (B, R) float, 1 on trained response tokens
    old_logprobs: torch.Tensor  # (B, R)
    rewards: torch.Tensor  # (B,)
    versions: torch.Tensor  # (B,) the model version each rollout was sampled with

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width :]


def collate(experiences: list[Experience], pad_id: int) -> PolicyBatch:
    """Stack experiences into one :class:`PolicyBatch` (no copies beyond the stacking)."""
    prompts, responses, logps, masks = [], [], [], []
    for exp in experiences:
        tokens = torch.frombuffer(bytearray(exp.tokens), dtype=torch.int32).long()
        prompts.append(tokens[: exp.prompt_length])
        responses.append(tokens[exp.prompt_length :])
        logps.append(torch.frombuffer(bytearray(exp.logprobs), dtype=torch.float32))
        masks.append(torch.frombuffer(bytearray(exp.action_mask), dtype=torch.uint8).float())
    width_p = max(len(p) for p in prompts)
    width_r = max(len(r) for r in responses)
    b = len(experiences)
    input_ids = torch.full((b, width_p + width_r), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width_p + width_r), dtype=torch.long)
    response_mask = torch.zeros((b, width_r))
    old = torch.zeros((b, width_r))
    for i, (p, r, lp, m) in enumerate(zip(prompts, responses, logps, masks, strict=True)):
        input_ids[i, width_p - len(p) : width_p] = p
        input_ids[i, width_p : width_p + len(r)] = r
        attention[i, width_p - len(p) : width_p + len(r)] = 1
        response_mask[i, : len(r)] = m
        old[i, : len(r)] = lp
    rewards = torch.tensor([e.reward for e in experiences], dtype=torch.float32)
    versions = torch.tensor([e.model_version for e in experiences], dtype=torch.long)
    return PolicyBatch(input_ids, attention, width_p, response_mask, old, rewards, versions)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``(B, R)`` log-probs of the response tokens under ``model`` (with grad if enabled)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).logits
    logits = logits[:, prompt_width - 1 : -1, :].float() / temperature
    targets = input_ids[:, prompt_width:]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
