"""The simulated engine: no model, random tokens at a fixed cost per generated token.

For benches of everything around the engine (task intake, publishing, the trainer, weight
sync) with as many explorers as wanted: an explorer running it uses no CPU to sample, it
sleeps ``explorer.simulated_seconds_per_token`` per generated token instead, as a
GPU-bound engine would wait on its device.

What it returns:
- every response is exactly ``max_new_tokens`` tokens, never an EOS (so a batch costs a
  known ``len(prompts) * n * max_new_tokens`` tokens);
- token ids drawn uniformly from the tokenizer's ordinary (non-special) ids, seeded by
  ``seed``: the same call returns the same rollouts; ``temperature`` is ignored;
- each log-prob is ``-log(number of ordinary ids)``, the log-probability of that uniform
  draw (the trainer's recomputation with the real model will differ: the loss of a
  simulated run means nothing, its timings do);
- the text is the decoded response without special tokens.

``greedy`` returns random short strings (seeded by the prompts); it is never used for
evaluation, the trainer's evaluator builds its own transformers engine.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable

import torch

from streamrft.infra.config import ExplorerConfig
from streamrft.producers.engines.base import Rollout
from streamrft.sync.payload import ModuleTarget


class SimulatedEngine(ModuleTarget):
    """Random rollouts that cost ``seconds_per_token`` of ``sleep`` per generated token."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        seconds_per_token: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.model = model  # weights are applied to it as usual; it never runs
        self.tokenizer = tokenizer
        self.seconds_per_token = seconds_per_token
        self.sleep = sleep
        special = set(tokenizer.all_special_ids)
        self.ordinary = [i for i in range(len(tokenizer)) if i not in special]
        """The ids responses are drawn from."""
        self.logprob = -math.log(len(self.ordinary))

    def _spend(self, tokens: int) -> None:
        if self.seconds_per_token > 0 and tokens > 0:
            self.sleep(tokens * self.seconds_per_token)

    def _response(self, rng: random.Random, length: int) -> list[int]:
        return rng.choices(self.ordinary, k=length)

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
        """``n`` random responses of ``max_new_tokens`` tokens per prompt (its token ids),
        grouped per prompt; sleeps for all their tokens once (no model: ``temperature``,
        ``top_p`` and ``top_k`` change nothing)."""
        rng = random.Random(seed)
        groups = []
        for ids in prompts:
            group = []
            for _ in range(n):
                resp = self._response(rng, max_new_tokens)
                group.append(
                    Rollout(
                        prompt_ids=list(ids),
                        response_ids=resp,
                        logprobs=[self.logprob] * len(resp),
                        text=self.tokenizer.decode(resp, skip_special_tokens=True),
                        truncated=True,  # ordinary tokens up to max_new_tokens, never an EOS
                    )
                )
            groups.append(group)
        self._spend(len(prompts) * n * max_new_tokens)
        return groups

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        """A random string of 1 to ``max_new_tokens`` tokens per prompt (the same for the
        same prompts); sleeps for their tokens."""
        rng = random.Random(zlib.crc32(repr(prompts).encode()))
        responses = [self._response(rng, rng.randint(1, max_new_tokens)) for _ in prompts]
        self._spend(sum(map(len, responses)))
        return [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]


def make_simulated_engine(
    model: torch.nn.Module, tokenizer, cfg: ExplorerConfig
) -> SimulatedEngine:
    """The ``simulated`` engine at ``explorer.simulated_seconds_per_token``."""
    return SimulatedEngine(model, tokenizer, cfg.simulated_seconds_per_token)
