"""One experience per conversation (``serve.record: episode``): a chat request that continues
a response this server recorded is sampled from that response's own token ids with the new
messages appended, and recorded as the same episode, one turn longer.

**Which response a request continues.** Its last assistant message is the turn it
continues, found among the recorded responses by the ids of its tool calls
(``call_<response>_<choice>_<k>``, which this server gave them), by
``previous_response_id`` (streamrft's field), or among the responses of the request's
conversation (``conversation_id``, the ``X-Conversation-Id`` header, an agent episode's
URL), and always within that conversation when the request names one. The match holds
only when the message is the answer the server gave (its content and calls, arguments
compared as objects) and the prompt before it renders exactly as the recorded response's
prompt did (a digest of that text is kept with each response: the same messages, system
prompt, tools and ``tool_choice``). A framework that rewrote, trimmed or summarised its
history, or edited the answer, has the turn recorded as its own experience, and counted.

**The new prompt** is the recorded prompt and response ids, then the ids of the chat
template's text after the assistant turn (its closing, less the EOS the policy sampled)
and of the new messages up to the generation prompt: what rendering the conversation with
them adds to rendering it up to the turn
(:func:`~streamrft.producers.workflows.conversation.glue_text`). The policy's tokens are
never re-tokenized. Pure bookkeeping over the recorder: no I/O.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2
import msgspec

from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.serving.recorder import Continuation, Recorded, Recorder, Ref
from streamrft.producers.serving.tool_calls import Turn
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


def digest(prompt: str) -> bytes:
    """Of a request's rendered prompt: what a continuation's history must render as."""
    return hashlib.blake2b(prompt.encode(), digest_size=16).digest()


def answer(content: str, calls: list[tuple[str, Any]]) -> bytes:
    """Of an assistant message: its content and its calls (name, arguments as an object),
    keys sorted."""
    body = msgspec.json.encode([content, calls], order="sorted")
    return hashlib.blake2b(body, digest_size=16).digest()


def answer_given(text: str, turn: Turn | None) -> bytes:
    """:func:`answer` of a choice as the API answers it: the content and calls of its
    ``turn`` when it was read for calls and made some, else its ``text``."""
    if turn is None or not turn.calls:
        return answer(text, [])
    return answer(turn.content or "", [(c.name, json.loads(c.arguments)) for c in turn.calls])


def answer_of(message: dict[str, Any]) -> bytes:
    """:func:`answer` of an assistant message as a request sends it back."""
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    return answer(message["content"], calls)


@dataclass(frozen=True)
class Found:
    """What :meth:`Episodes.find` found for a request."""

    continuation: Continuation | None
    outcome: str | None
    """``continued``, ``unmatched``, ``rewritten``, or None (a first turn)."""


class Episodes:
    """Finds the response a chat request continues (see the module's docstring); counts
    the outcomes of the requests recorded (:meth:`count`): ``continued``, ``unmatched`` (no
    recorded response of the conversation is the one the request's last assistant message
    names), ``rewritten`` (one is, but the answer or the prompt before it differ, or the
    template renders it differently once messages follow)."""

    def __init__(self, prompts: PromptRenderer) -> None:
        self.prompts = prompts
        self.stats: Counter[str] = Counter()

    @functools.cached_property
    def closing(self) -> str | None:
        """The template's text after an assistant turn (raw format: none); None when the
        template drops the assistant's content (nothing can be continued). Found once."""
        if not self.prompts.chat:
            return ""
        render = self.prompts.render
        try:
            return assistant_closing(lambda m, gen: render(m, None, gen))
        except (ConfigError, jinja2.TemplateError):
            return None

    def count(self, found: Found) -> None:
        """Count what was found for a request that was then recorded."""
        if found.outcome is not None:
            self.stats[found.outcome] += 1

    def find(
        self,
        recorder: Recorder,
        messages: list[dict[str, Any]],
        render: Render,
        prompt: str,
        previous: str | None,
        conversation: str | None,
    ) -> Found:
        """What the request of ``messages`` (rendered by ``render``; its whole prompt:
        ``prompt``) continues."""
        turn = next((i for i in reversed(range(len(messages))) if _is_assistant(messages[i])), None)
        if turn is None:
            return Found(None, None)  # a first turn
        found = _parent(recorder, messages[turn], previous, conversation)
        if found is None:
            return Found(None, "unmatched")
        ref, parent = found
        close = self.closing
        if close is None or parent.answer != answer_of(messages[turn]):
            return Found(None, "rewritten")
        try:
            if parent.digest != digest(render(messages[:turn], True)):
                return Found(None, "rewritten")
            before = render(messages[: turn + 1], False)
        except jinja2.TemplateError:  # a template that refuses a conversation ending so
            return Found(None, "rewritten")
        text = glue_text(close, self.prompts.tokenizer, parent.rollout.response_ids, before, prompt)
        if text is None:
            return Found(None, "rewritten")
        glue = self.prompts.tokenize_within(text)
        ids = parent.rollout.prompt_ids + parent.rollout.response_ids + glue
        return Found(Continuation(ref, glue, text, ids), "continued")


def _is_assistant(message: dict[str, Any]) -> bool:
    return message["role"] == "assistant"


def _parent(
    recorder: Recorder, message: dict[str, Any], previous: str | None, conversation: str | None
) -> tuple[Ref, Recorded] | None:
    """The recorded response ``message`` (an assistant turn) names: by its calls' ids,
    else by its answer among ``previous``'s choices or ``conversation``'s responses; within
    ``conversation`` when one is named."""
    for call in message.get("tool_calls", []):
        ref = called_in(call["id"])
        if ref is None or conversation not in (None, recorder.group_key(ref[0])):
            continue
        recorded = recorder.get(ref)
        if recorded is not None:
            return ref, recorded
    if previous is not None:
        candidates = recorder.choices_of(previous)
        if conversation is not None and recorder.group_key(previous) != conversation:
            candidates = []
    elif conversation is not None:
        candidates = recorder.responses_of(conversation)
    else:
        return None
    said = answer_of(message)
    same = [(ref, r) for ref, r in candidates if r.answer == said]
    return same[-1] if same else None  # the latest: a retried request answered again
