"""From sampled rollouts to OpenAI response bodies: stop strings, finish reasons, log-probs.

Pure functions of the rollouts and the tokenizer. A stop string cuts the *returned text*
before it, and the *recorded tokens* after the token that completed it: the policy did
sample those tokens, so they are what the trainer must score.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from streamrft.producers.engines.base import Rollout
from streamrft.producers.serving.episodes import tool_call_id
from streamrft.producers.serving.tool_calls import Turn

GREEDY_TEMPERATURE = 1e-3
"""``temperature: 0`` samples at this temperature: the argmax in practice, with log-probs
that are still defined (the recorded log-probs are under the temperature that sampled)."""


@dataclass(frozen=True)
class Choice:
    """One answered choice: the rollout as recorded (cut at a stop string) and why it ended."""

    rollout: Rollout
    finish_reason: str
    """``stop`` (EOS or a stop string) or ``length`` (``max_tokens`` reached)."""


def finish(rollout: Rollout, tokenizer: Any, stops: list[str], max_tokens: int) -> Choice:
    """``rollout`` cut at its first stop string (if any), with its finish reason."""
    if stops and any(s in rollout.text for s in stops):
        return _cut_at_stop(rollout, tokenizer, stops)
    ids = rollout.response_ids
    ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
    reason = "length" if len(ids) >= max_tokens and not ended else "stop"
    return Choice(rollout, reason)


def _cut_at_stop(rollout: Rollout, tokenizer: Any, stops: list[str]) -> Choice:
    """The shortest token prefix whose text holds a stop string (a binary search: a prefix
    that holds one, longer ones do too), and the text before the stop."""
    ids = rollout.response_ids

    def text(end: int) -> str:
        return tokenizer.decode(ids[:end], skip_special_tokens=True)

    low, high = 1, len(ids)  # text(high) holds a stop
    while low < high:
        mid = (low + high) // 2
        if any(s in text(mid) for s in stops):
            high = mid
        else:
            low = mid + 1
    cut_text = text(high)
    cut = replace(
        rollout,
        response_ids=ids[:high],
        logprobs=rollout.logprobs[:high],
        text=cut_text[: min(cut_text.index(s) for s in stops if s in cut_text)],
        truncated=False,  # it stopped at a stop string
    )
    return Choice(cut, "stop")


def _token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def chat_logprobs(rollout: Rollout, tokenizer: Any) -> dict[str, Any]:
    """The chat API's ``logprobs``: each sampled token with its log-prob."""
    tokens = _token_strings(tokenizer, rollout.response_ids)
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, rollout.logprobs, strict=True)
        ]
    }


def completion_logprobs(rollout: Rollout, tokenizer: Any) -> dict[str, Any]:
    """The completions API's ``logprobs``: tokens, their log-probs and text offsets."""
    tokens = _token_strings(tokenizer, rollout.response_ids)
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(rollout.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def usage(prompt_ids: list[int], choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.rollout.response_ids) for c in choices)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def response_body(
    chat: bool,
    response_id: str,
    model: str,
    created: int,
    version: int,
    prompt_ids: list[int],
    choices: list[Choice],
    tokenizer: Any,
    with_logprobs: bool,
    turns: list[Turn] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` (``chat``) or ``text_completion`` object, with
    ``model_version``, streamrft's extension: the version that sampled every choice.
    ``turns``: each choice read for tool calls (a chat request offering tools)."""
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [
            _choice(chat, i, c, tokenizer, with_logprobs, turns[i] if turns else None, response_id)
            for i, c in enumerate(choices)
        ],
        "usage": usage(prompt_ids, choices),
        "model_version": version,
    }


def _choice(
    chat: bool,
    index: int,
    choice: Choice,
    tokenizer: Any,
    with_logprobs: bool,
    turn: Turn | None,
    response_id: str,
) -> dict[str, Any]:
    text = choice.rollout.text
    logprobs = chat_logprobs if chat else completion_logprobs
    reason = choice.finish_reason
    if not chat:
        body: dict[str, Any] = {"text": text}
    elif turn is None or not turn.calls:
        body = {"message": {"role": "assistant", "content": text}}
    else:
        calls = [
            {
                "id": tool_call_id(response_id, index, k),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for k, c in enumerate(turn.calls)
        ]
        body = {"message": {"role": "assistant", "content": turn.content, "tool_calls": calls}}
        reason = "tool_calls"
    return {
        "index": index,
        **body,
        "finish_reason": reason,
        "logprobs": logprobs(choice.rollout, tokenizer) if with_logprobs else None,
    }
