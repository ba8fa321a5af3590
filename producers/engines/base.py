"""What every rollout engine gives the workflows: grouped samples with their log-probs."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.experience import Experience

if TYPE_CHECKING:
    import torch


@dataclass
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]
    """Up to and including the first EOS (or max_new_tokens when none came)."""
    logprobs: list[float]
    text: str
    """Decoded response without special tokens."""
    truncated: bool = False
    """Cut at ``max_new_tokens`` before an EOS came."""
    mask: list[int] | None = None
    """Per response token 1 (sampled by the policy) or 0 (inserted: a tool's result, a
    user turn, the chat template's glue between turns); None: every token is the policy's.
    Inserted tokens carry log-prob 0.0."""
    version: int = -1
    """The model version that sampled it (:class:`SerialEngine` stamps it); -1: unknown,
    the workflow's step version stands."""

    def sampled_by(self, step_version: int) -> int:
        """:attr:`version` when stamped, else ``step_version``."""
        return self.version if self.version >= 0 else step_version

    def experience(
        self, eid: str, reward: float, version: int, info: dict[str, float]
    ) -> Experience:
        """This rollout as an experience: the policy's tokens trained (mask 1), with
        ``info``, its ``response_length`` (the policy's tokens) and ``truncated`` (1: cut
        at ``max_new_tokens``); a rollout with inserted tokens also its ``episode_length``
        (every token after the prompt). ``version``: the step's, unless the engine stamped
        the one that sampled it."""
        mask = [1] * len(self.response_ids) if self.mask is None else self.mask
        lengths = {"response_length": float(sum(mask))}
        if self.mask is not None:
            lengths["episode_length"] = float(len(self.response_ids))
        return Experience(
            id=eid,
            tokens=pack_i32(self.prompt_ids + self.response_ids),
            prompt_length=len(self.prompt_ids),
            logprobs=pack_f32(self.logprobs),
            action_mask=pack_u8(mask),
            reward=reward,
            model_version=self.sampled_by(version),
            response_text=self.text,
            info={**info, **lengths, "truncated": float(self.truncated)},
        )


def ends_without_eos(response_ids: list[int], eos_id: int | None) -> bool:
    """Whether a response cut after its first EOS (or at ``max_new_tokens``) was cut
    short: it does not end with the EOS."""
    return not response_ids or response_ids[-1] != eos_id


class RolloutEngine(Protocol):
    """Samples from prompts given as token ids: the workflow renders them
    (:class:`~streamrft.infra.prompts.PromptRenderer`: chat template or raw text, special
    tokens added once), the engine adds nothing, so a rollout's ``prompt_ids`` are exactly
    the ids it was given."""

    model: torch.nn.Module
    tokenizer: Any
    """Decodes responses; workflows render prompts with it."""

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
        """``n`` samples of each prompt (its token ids), grouped per prompt, from the
        policy at ``temperature`` truncated by ``top_k`` (0: none) and ``top_p`` (1: none),
        each token's log-prob under the distribution it was drawn from."""
        ...

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        """The greedy response text of each prompt (its token ids)."""
        ...

    # Optional: ``interrupt()`` stops the sampling call running (and every later one) with
    # ``SamplingInterrupted``, from any thread; the explorer calls it when it stops with
    # calls still sampling (the transformers engine has it; vLLM's and the simulated do not).
    # ``SerialEngine`` passes it through without its lock (the call it stops holds it).

    # Where an explorer's versions go (``sync.payload.WeightTarget``): engines that sample
    # with ``model`` itself copy into it (``ModuleTarget``), others into their own copy too.
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Full weights in place (``unique_state_dict`` names of ``model``)."""
        ...

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """A LoRA adapter version in place (``adapter_state_dict`` names)."""
        ...


class SerialEngine:
    """An engine whose sampling calls take turns: workflow calls run on several threads
    (:mod:`streamrft.producers.scheduler`), and an engine (vLLM's ``LLM`` above all) is not
    made to be called from two at once. Everything else is the wrapped engine's."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self.version = -1
        """The version loaded last (-1: none loaded through this engine)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

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
        with self._lock:
            grouped = self.engine.rollout(
                prompts, n, temperature, max_new_tokens, seed, top_p=top_p, top_k=top_k
            )
            for rollouts in grouped:  # the version cannot change inside the call
                for r in rollouts:
                    r.version = self.version
            return grouped

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        with self._lock:
            return self.engine.greedy(prompts, max_new_tokens)

    # a version is applied between two sampling calls, even those a timed-out workflow
    # call still makes after the explorer moved on
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self.engine.load_weights(version, tensors)
            self.version = version

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self.engine.load_adapter(version, tensors)
            self.version = version
