"""Batched autoregressive sampling with a KV cache, returning exact per-token log-probs.

A plain loop rather than ``generate()``: every logit processor is explicit (temperature,
and on request top-k and top-p), so the log-probs recorded here are exactly those of the
distribution each token was drawn from, and the completion of each row ends at its first
EOS. With ``top_p`` = 1 and ``top_k`` = 0 (the default) that distribution is the one the
trainer recomputes at the same temperature; a truncated one (:func:`truncate`) differs from
it, which the trainer handles with an off-policy correction.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from streamrft.schemas.errors import SamplingInterrupted


@dataclass
class SampleOutput:
    tokens: torch.Tensor
    """``(batch, steps)`` sampled token ids; positions after a row's first EOS hold pad."""
    logprobs: torch.Tensor
    """``(batch, steps)`` log-prob of each sampled token under the distribution it was drawn
    from: ``softmax(logits / temperature)``, truncated by top-k / top-p when asked."""
    lengths: torch.Tensor
    """``(batch,)`` response length of each row, its first EOS included."""


def cache_keyword(model: Any) -> str:
    """The forward's name for the KV cache of ``model`` (a PEFT wrapper: of its base
    model): ``cache`` in newer transformers (``past_key_values`` is deprecated there and
    removed in 5.40), ``past_key_values`` in older ones (the vLLM tier's pin). The model's
    output carries the cache under the same name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _keyword_of(base.__class__)


@cache
def _keyword_of(model_cls: Any) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def truncate(logp: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The log-probs ``logp`` (``(..., vocab)``) renormalised over the tokens top-k and then
    top-p keep, ``-inf`` elsewhere: top-k keeps the ``top_k`` likeliest (0: all; tokens
    tied with the k-th are kept too), top-p the likeliest tokens until their mass reaches
    ``top_p`` (at least one). Unchanged when neither truncates."""
    vocab = logp.shape[-1]
    if 0 < top_k < vocab:
        kth = logp.topk(top_k, dim=-1).values[..., -1:]
        logp = logp.masked_fill(logp < kth, float("-inf")).log_softmax(dim=-1)
    if top_p < 1.0:
        ordered, order = logp.sort(dim=-1, descending=True)
        probs = ordered.exp()
        before = probs.cumsum(dim=-1) - probs  # the mass of the likelier tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logp = logp.masked_fill(drop, float("-inf")).log_softmax(dim=-1)
    return logp


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
    interrupted: Callable[[], bool] | None = None,
) -> SampleOutput:
    """Sample up to ``max_new_tokens`` for each left-padded prompt row, on the device of
    ``input_ids`` (the model's; ``generator`` must be on it too), from ``softmax(logits /
    temperature)`` truncated by ``top_k`` and ``top_p`` (:func:`truncate`). Log-probs are
    computed in float32 whatever the model's dtype. ``interrupted`` is asked before each
    forward pass: when it says so, :class:`SamplingInterrupted` is raised (a process that
    is stopping does not sit out a long generation)."""
    _check(interrupted)
    batch = input_ids.shape[0]
    keyword = cache_keyword(model)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,  # the last position's logits only: the others are never read
    )
    past = getattr(out, keyword)
    logits = out.logits[:, -1, :]
    next_pos = position_ids[:, -1] + 1
    device = input_ids.device
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    mask = attention_mask.long()
    for step in range(max_new_tokens):
        logp = truncate(torch.log_softmax(logits.float() / temperature, dim=-1), top_p, top_k)
        if greedy:
            tok = logp.argmax(dim=-1)
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        tok_logp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logps.append(torch.where(finished, torch.zeros_like(tok_logp), tok_logp))
        lengths += (~finished).long()
        finished = finished | (tok == eos_id)
        if step == max_new_tokens - 1 or bool(finished.all()):
            break  # no forward pass for logits that would never be sampled
        _check(interrupted)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=tok.unsqueeze(-1),
            attention_mask=mask,
            position_ids=next_pos.unsqueeze(-1),
            use_cache=True,
            **{keyword: past},
        )
        past = getattr(out, keyword)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return SampleOutput(torch.stack(tokens, dim=1), torch.stack(logps, dim=1), lengths)


def _check(interrupted: Callable[[], bool] | None) -> None:
    if interrupted is not None and interrupted():
        raise SamplingInterrupted("sampling interrupted: the process is stopping")
