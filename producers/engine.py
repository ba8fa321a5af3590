"""Rollout engines behind one interface, chosen by ``explorer.engine``.

The transformers engine is the CPU path (and works on a GPU); vLLM is an optional GPU
engine (not part of this build: selecting it raises an ImportError that says what to do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from streamrft.producers.sampling import sample


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


class TransformersEngine:
    """Batched sampling with a transformers causal LM on CPU or GPU."""

    def __init__(self, model: torch.nn.Module, tokenizer, device: str = "cpu") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device

    def encode_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=True)
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    def _run(
        self, prompts: list[str], temperature: float, max_new_tokens: int, greedy: bool, seed: int
    ):
        ids, mask = self.encode_prompts(prompts)
        gen = torch.Generator().manual_seed(seed)
        out = sample(
            self.model,
            ids,
            mask,
            max_new_tokens=max_new_tokens,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
            temperature=temperature,
            greedy=greedy,
            generator=gen,
        )
        return ids, mask, out

    @torch.no_grad()
    def rollout(
        self, prompts: list[str], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[Rollout]]:
        """``n`` samples of each prompt, grouped per prompt."""
        flat = [p for p in prompts for _ in range(n)]
        ids, mask, out = self._run(flat, temperature, max_new_tokens, False, seed)
        rollouts = []
        for i in range(len(flat)):
            length = int(out.lengths[i])
            prompt_ids = ids[i][mask[i].bool()].tolist()
            resp = out.tokens[i, :length].tolist()
            rollouts.append(
                Rollout(
                    prompt_ids=prompt_ids,
                    response_ids=resp,
                    logprobs=out.logprobs[i, :length].tolist(),
                    text=self.tokenizer.decode(resp, skip_special_tokens=True),
                )
            )
        return [rollouts[j * n : (j + 1) * n] for j in range(len(prompts))]

    @torch.no_grad()
    def greedy(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        _, _, out = self._run(prompts, 1.0, max_new_tokens, True, 0)
        return [
            self.tokenizer.decode(
                out.tokens[i, : int(out.lengths[i])].tolist(), skip_special_tokens=True
            )
            for i in range(len(prompts))
        ]


def make_engine(kind: str, model: torch.nn.Module, tokenizer) -> RolloutEngine:
    if kind == "transformers":
        return TransformersEngine(model, tokenizer)
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "explorer.engine 'vllm' needs vLLM and a GPU: pip install 'streamrft[vllm]'"
            ) from exc
        raise NotImplementedError(
            "the vLLM engine is not built yet; use explorer.engine: transformers"
        )
    raise ValueError(f"unknown engine {kind!r}")
