"""One experience per conversation (``serve.record: episode``): a chat request that continues
a response this server recorded is sampled from that response's own token ids with the new
messages appended, and recorded as the same episode, one turn longer.

**Which response a request continues.** Its last assistant message is the turn it
continues, found among the recorded responses by, in order: the ids of its tool calls
(``call_<response>_<choice>_<k>``, which this server gave them), ``previous_response_id``
(streamrft's field) with the message's content, or its content among the responses of the
request's conversation (``conversation_id``, the ``X-Conversation-Id`` header, an agent
episode's URL). The match holds only when the messages before that turn, and the tools
offered, are those the recorded response answered (a digest of both is kept with each
response): a framework that rewrote, trimmed or summarised its history has the turn
recorded as its own experience, and counted.

**The new prompt** is the recorded prompt and response ids, then the ids of the chat
template's text after the assistant turn (its closing, less the EOS the policy sampled)
and of the new messages up to the generation prompt: what rendering the conversation with
them adds to rendering it up to the turn
(:func:`~streamrft.producers.workflows.conversation.glue_text`). The policy's tokens are
never re-tokenized. Pure bookkeeping over the recorder: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.serving.recorder import Continuation, Recorded, Recorder, Ref
from streamrft.producers.workflows.conversation import assistant_closing, glue_text
from streamrft.schemas.errors import ConfigError

_CALL_ID = re.compile(r"call_([0-9a-f]{1,64})_(\d{1,4})_\d{1,4}")
Render = Callable[[list[dict[str, Any]], bool], str]
"""A request's messages as prompt text (with its tools), with or without the generation
prompt."""


def tool_call_id(response_id: str, choice: int, k: int) -> str:
    """The id of the ``k``-th call of choice ``choice`` of ``response_id``: unique in the
    response, the same for the same response, and naming it (:func:`called_in`)."""
    return f"call_{response_id.rpartition('-')[2]}_{choice}_{k}"


def called_in(call_id: str) -> Ref | None:
    """The response and choice a tool call id of :func:`tool_call_id` came from."""
    match = _CALL_ID.fullmatch(call_id)
    return (f"chatcmpl-{match[1]}", int(match[2])) if match else None


def digest(messages: list[dict[str, Any]], tools: list[Any]) -> bytes:
    """What a continuation's history must equal: the messages (as the chat templates read
    them) and the tools' definitions, keys sorted."""
    body = msgspec.json.encode([messages, tools], order="sorted")
    return hashlib.blake2b(body, digest_size=16).digest()


class Episodes:
    """Finds the response a chat request continues (see the module's docstring); counts
    what it found: ``continued``, ``unmatched`` (no recorded response is the one the
    request's last assistant message names), ``rewritten`` (one is, but the history or the
    tools before it differ, or the template renders it differently once messages follow)."""

    def __init__(self, prompts: PromptRenderer) -> None:
        self.prompts = prompts
        self.stats: Counter[str] = Counter()
        self._close: str | None = None

    def closing(self) -> str | None:
        """The template's text after an assistant turn (raw format: none); None when the
        template drops the assistant's content (nothing can be continued)."""
        if self._close is None:
            if not self.prompts.chat:
                self._close = ""
            else:
                render = self.prompts.render
                try:
                    self._close = assistant_closing(lambda m, gen: render(m, None, gen))
                except ConfigError:
                    return None
        return self._close

    def find(
        self,
        recorder: Recorder,
        messages: list[dict[str, Any]],
        tools: list[Any],
        render: Render,
        previous: str | None,
        conversation: str | None,
    ) -> Continuation | None:
        """What the request of ``messages`` (offering ``tools``, rendered by ``render``)
        continues; None for a fresh conversation or no match."""
        turn = next((i for i in reversed(range(len(messages))) if _is_assistant(messages[i])), None)
        if turn is None:
            return None  # a first turn
        found = _parent(recorder, messages[turn], previous, conversation)
        if found is None:
            self.stats["unmatched"] += 1
            return None
        ref, parent = found
        close = self.closing()
        text = None
        if close is not None and parent.digest == digest(messages[:turn], tools):
            rollout = parent.rollout
            before, after = render(messages[: turn + 1], False), render(messages, True)
            text = glue_text(close, self.prompts.tokenizer, rollout.response_ids, before, after)
        if text is None:
            self.stats["rewritten"] += 1
            return None
        self.stats["continued"] += 1
        glue = self.prompts.tokenize_within(text)
        ids = parent.rollout.prompt_ids + parent.rollout.response_ids + glue
        return Continuation(ref, glue, text, ids)


def _is_assistant(message: dict[str, Any]) -> bool:
    return message["role"] == "assistant"


def _parent(
    recorder: Recorder, message: dict[str, Any], previous: str | None, conversation: str | None
) -> tuple[Ref, Recorded] | None:
    """The recorded response ``message`` (an assistant turn) is: by its calls' ids, else by
    its content among ``previous``'s choices or ``conversation``'s responses."""
    for call in message.get("tool_calls", []):
        ref = called_in(call["id"])
        recorded = recorder.get(ref) if ref else None
        if recorded is not None:
            return ref, recorded  # type: ignore[return-value]
    if message.get("tool_calls") or not message["content"]:
        return None  # calls of ids it never gave; no content to match
    if previous is not None:
        candidates = recorder.choices_of(previous)
    elif conversation is not None:
        candidates = recorder.responses_of(conversation)
    else:
        return None
    same = [(ref, r) for ref, r in candidates if r.content == message["content"]]
    return same[-1] if same else None  # the latest: a retried request answered again
