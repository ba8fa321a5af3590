"""The transformers engine: batched sampling with a causal LM on CPU or GPU."""

from __future__ import annotations

import threading

import torch

from streamrft.infra.config import ExplorerConfig
from streamrft.infra.modeling import model_device
from streamrft.producers.decoding import sample
from streamrft.producers.engines.base import Rollout, ends_without_eos
from streamrft.sync.payload import ModuleTarget


class TransformersEngine(ModuleTarget):
    """Batched sampling with a transformers causal LM on CPU or GPU; versions are applied
    to that model in place (:class:`ModuleTarget`)."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Stop the sampling call running (between two tokens) and every later one: each
        raises :class:`~streamrft.schemas.errors.SamplingInterrupted`. For a process that
        is stopping; safe from any thread."""
        self._interrupted.set()

    @property
    def device(self) -> torch.device:
        """Where the model is: prompts, sampling and the generator follow it."""
        return model_device(self.model)

    def encode_prompts(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and attention mask of the prompts' token ids (nothing added)."""
        width = max(map(len, prompts))
        pad = [self.tokenizer.pad_token_id] * width
        # one tensor built from padded rows, not one small tensor copied in per prompt
        ids = torch.tensor([pad[len(p) :] + list(p) for p in prompts], dtype=torch.long)
        starts = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
        mask = (torch.arange(width) >= starts.unsqueeze(1)).long()
        return ids.to(self.device), mask.to(self.device)

    def _run(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_new_tokens: int,
        greedy: bool,
        seed: int,
        top_p: float = 1.0,
        top_k: int = 0,
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
            top_p=top_p,
            top_k=top_k,
            interrupted=self._interrupted.is_set,
        )
        return ids, mask, out

    @torch.no_grad()
    def rollout(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> list[list[Rollout]]:
        """``n`` samples of each prompt (its token ids), grouped per prompt."""
        flat = [p for p in prompts for _ in range(n)]
        _, _, out = self._run(flat, temperature, max_new_tokens, False, seed, top_p, top_k)
        responses = _responses(out.tokens, out.lengths)
        # one conversion of the whole batch, not one small tensor per row
        logprobs = out.logprobs.tolist()
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        rollouts = [
            Rollout(
                prompt_ids=list(flat[i]),  # exactly the ids given: the engine adds nothing
                response_ids=resp,
                logprobs=logprobs[i][: len(resp)],
                text=texts[i],
                truncated=ends_without_eos(resp, self.tokenizer.eos_token_id),
            )
            for i, resp in enumerate(responses)
        ]
        return [rollouts[j * n : (j + 1) * n] for j in range(len(prompts))]

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        _, _, out = self._run(prompts, 1.0, max_new_tokens, True, 0)
        return self.tokenizer.batch_decode(
            _responses(out.tokens, out.lengths), skip_special_tokens=True
        )


def _responses(tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Each row's response ids: its first ``lengths[row]`` tokens."""
    return [row[:length] for row, length in zip(tokens.tolist(), lengths.tolist(), strict=True)]


def make_transformers_engine(
    model: torch.nn.Module, tokenizer, cfg: ExplorerConfig
) -> TransformersEngine:
    """The ``transformers`` engine (it has no ``explorer.*`` options)."""
    return TransformersEngine(model, tokenizer)
