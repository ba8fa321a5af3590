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

    def prompt_lengths(self) -> list[int]:
        return self.attention_mask[:, : self.prompt_width].sum(1).tolist()

    def response_lengths(self) -> list[int]:
        return self.attention_mask[:, self.prompt_width :].sum(1).tolist()

    def rows(self, lo: int, hi: int) -> PolicyBatch:
        """Rows ``lo:hi`` padded only to their own widths (views, no copies)."""
        attn = self.attention_mask[lo:hi]
        width_p = int(attn[:, : self.prompt_width].sum(1).max())
        width_r = int(attn[:, self.prompt_width :].sum(1).max())
        cols = slice(self.prompt_width - width_p, self.prompt_width + width_r)
        return PolicyBatch(
            self.input_ids[lo:hi, cols],
            attn[:, cols],
            width_p,
            self.response_mask[lo:hi, :width_r],
            self.old_logprobs[lo:hi, :width_r],
            self.rewards[lo:hi],
            self.versions[lo:hi],
        )

    def to(self, device: torch.device) -> PolicyBatch:
        if self.input_ids.device == device:
            return self
        return PolicyBatch(
            *(t.to(device) for t in (self.input_ids, self.attention_mask)),
            self.prompt_width,
            *(
                t.to(device)
                for t in (self.response_mask, self.old_logprobs, self.rewards, self.versions)
            ),
        )


def micro_slices(
    prompt_lengths: list[int], response_lengths: list[int], rows: int, tokens: int
) -> list[tuple[int, int]]:
    """``(lo, hi)`` row ranges of the micro-batches: consecutive rows, at most ``rows`` of
    them (0: no limit), while rows x (longest prompt + longest response among them) stays
    within ``tokens`` (0: no budget; a row over the budget goes alone)."""
    n, out, lo = len(prompt_lengths), [], 0
    while lo < n:
        hi, width_p, width_r = lo + 1, prompt_lengths[lo], response_lengths[lo]
        while hi < n and (not rows or hi - lo < rows):
            wp, wr = max(width_p, prompt_lengths[hi]), max(width_r, response_lengths[hi])
            if tokens and (hi - lo + 1) * (wp + wr) > tokens:
                break
            width_p, width_r, hi = wp, wr, hi + 1
        out.append((lo, hi))
        lo = hi
    return out


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
    return logprobs_and_entropy(model, input_ids, attention_mask, prompt_width, temperature)[0]


def logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    temperature: float = 1.0,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(B, R)`` log-probs of the response tokens and, with ``entropy``, the entropy of
    the policy's distribution at each of them (both with grad if enabled)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).logits
    logits = logits[:, prompt_width - 1 : -1, :].float() / temperature
    targets = input_ids[:, prompt_width:]
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return chosen, None
    return chosen, -(logp.exp() * logp).sum(-1)
