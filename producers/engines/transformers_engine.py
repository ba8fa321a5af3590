"""The transformers engine: batched sampling with a causal LM on CPU or GPU."""

from __future__ import annotations

import torch

from streamrft.infra.config import ExplorerConfig
from streamrft.infra.modeling import model_device
from streamrft.producers.engines.base import Rollout
from streamrft.producers.sampling import sample
from streamrft.sync.payload import ModuleTarget


class TransformersEngine(ModuleTarget):
    """Batched sampling with a transformers causal LM on CPU or GPU; versions are applied
    to that model in place (:class:`ModuleTarget`)."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer

    @property
    def device(self) -> torch.device:
        """Where the model is: prompts, sampling and the generator follow it."""
        return model_device(self.model)

    def encode_prompts(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and attention mask of the prompts' token ids (nothing added)."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _run(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_new_tokens: int,
        greedy: bool,
        seed: int,
    ):
        ids, mask = self.encode_prompts(prompts)
        gen = torch.Generator(device=ids.device).manual_seed(seed)
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
        self, prompts: list[list[int]], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[Rollout]]:
        """``n`` samples of each prompt (its token ids), grouped per prompt."""
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
    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        _, _, out = self._run(prompts, 1.0, max_new_tokens, True, 0)
        return [
            self.tokenizer.decode(
                out.tokens[i, : int(out.lengths[i])].tolist(), skip_special_tokens=True
            )
            for i in range(len(prompts))
        ]


def make_transformers_engine(
    model: torch.nn.Module, tokenizer, cfg: ExplorerConfig
) -> TransformersEngine:
    """The ``transformers`` engine (it has no ``explorer.*`` options)."""
    return TransformersEngine(model, tokenizer)
