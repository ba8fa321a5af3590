"""Experience groups to padded tensors, and the policy's log-probs of their responses.

Layout: prompts left-padded to the longest prompt ``P``, responses right-padded to the
longest response ``R``; the row is ``[pad.. prompt | response ..pad]``. This is the layout
the explorer sampled with, so recomputed log-probs match the recorded ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    versions: torch.Tensor  # (B, R) the model version that sampled each response token

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
            self.versions[lo:hi, :width_r],
        )

    def to(self, device: torch.device) -> PolicyBatch:
        if self.input_ids.device == device:
            return self
        return PolicyBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.prompt_width,
            self.response_mask.to(device),
            self.old_logprobs.to(device),
            self.rewards.to(device),
            self.versions.to(device),
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
    """Stack experiences into one :class:`PolicyBatch`: numpy views of each message's
    bytes copied once into the padded arrays, then handed to torch without a copy."""
    tokens = [np.frombuffer(e.tokens, dtype="<i4") for e in experiences]
    width_p = max(e.prompt_length for e in experiences)
    width_r = max(len(t) - e.prompt_length for t, e in zip(tokens, experiences, strict=True))
    b = len(experiences)
    input_ids = np.full((b, width_p + width_r), pad_id, dtype=np.int64)
    attention = np.zeros((b, width_p + width_r), dtype=np.int64)
    response_mask = np.zeros((b, width_r), dtype=np.float32)
    old = np.zeros((b, width_r), dtype=np.float32)
    versions = np.zeros((b, width_r), dtype=np.int64)
    for i, (t, e) in enumerate(zip(tokens, experiences, strict=True)):
        lo, hi = width_p - e.prompt_length, width_p + len(t) - e.prompt_length
        input_ids[i, lo:hi] = t
        attention[i, lo:hi] = 1
        n = hi - width_p
        response_mask[i, :n] = np.frombuffer(e.action_mask, dtype=np.uint8)
        old[i, :n] = np.frombuffer(e.logprobs, dtype="<f4")
        versions[i, :] = e.model_version
        for seg in e.segments[1:]:  # a partial rollout: each segment's version onwards
            versions[i, seg.start :] = seg.version
    rewards = torch.tensor([e.reward for e in experiences], dtype=torch.float32)
    return PolicyBatch(
        torch.from_numpy(input_ids),
        torch.from_numpy(attention),
        width_p,
        torch.from_numpy(response_mask),
        torch.from_numpy(old),
        rewards,
        torch.from_numpy(versions),
    )


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
    measure_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(B, R)`` log-probs of the response tokens and, with ``entropy``, the entropy of
    the policy's distribution at each of them (both with grad if enabled); with
    ``measure_entropy`` alone, the entropy without grad (a metric: no graph kept)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).logits
    logits = logits[:, prompt_width - 1 : -1, :].float() / temperature
    targets = input_ids[:, prompt_width:]
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not (entropy or measure_entropy):
        return chosen, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy):
        return chosen, -(logp.exp() * logp).sum(-1)
