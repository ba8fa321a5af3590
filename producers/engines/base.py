"""What every rollout engine gives the workflows: grouped samples with their log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]
    """Up to and including the first EOS (or max_new_tokens when none came)."""
    logprobs: list[float]
    text: str
    """Decoded response without special tokens."""


class RolloutEngine(Protocol):
    model: torch.nn.Module

    def rollout(
        self, prompts: list[str], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[Rollout]]: ...

    def greedy(self, prompts: list[str], max_new_tokens: int) -> list[str]: ...
