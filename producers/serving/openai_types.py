"""The request bodies serve mode accepts: the OpenAI API's fields it honours.

The rule for a request's fields:

- a field it honours is used (the structs below);
- a field whose value it cannot honour (``top_logprobs``, ``echo``, ``top_p`` below 1
  while the run's trainer has no off-policy correction...) is refused with a 400 by
  :func:`refuse_unsupported`, never silently ignored;
- a field of OpenAI's API that changes nothing about what is sampled or recorded here
  (:data:`ACCEPTED_IGNORED`: ``metadata``, ``store``, ``service_tier``...) is accepted;
- any other field is accepted too (agent frameworks add their own), and named by
  :func:`unknown_fields`: the server logs each such name once and counts it (``/health``'s
  ``unknown_fields``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from streamrft.schemas.errors import SchemaError

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class TextPart(msgspec.Struct, kw_only=True):
    """A part of a message's content; only ``text`` parts are understood."""

    type: str = "text"
    text: str = ""


FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A function a request offers the model."""

    name: FunctionName
    description: str | None = ""
    parameters: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    """One of a chat request's ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDef


class ChosenFunction(msgspec.Struct, kw_only=True):
    name: FunctionName


class NamedChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming one function."""

    type: Literal["function"] = "function"
    function: ChosenFunction


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: FunctionName
    arguments: str = "{}"
    """A JSON object's text, as the API gave it."""


class ToolCallIn(msgspec.Struct, kw_only=True):
    """A call of an earlier assistant message, sent back in the conversation."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """One message of a chat request."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    """An assistant message's calls (what an earlier answer returned)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise SchemaError(f"messages: content part of type {part.type!r} is not supported")
        return "".join(part.text for part in self.content)


ACCEPTED_IGNORED = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prediction",
        "reasoning_effort",
        "prompt_cache_key",
        "safety_identifier",
        "verbosity",
    }
)
"""OpenAI request fields accepted and ignored: they change nothing about the tokens sampled
or recorded (``parallel_tool_calls``: the calls a turn holds are returned whatever it
says)."""


def _none_or(*harmless: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in harmless


REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_none_or(), "the legacy functions: send tools"),
    "function_call": (_none_or(), "the legacy function_call: send tool_choice"),
    "best_of": (_none_or(1), "best_of other than 1: not supported"),
    "suffix": (_none_or(""), "suffix (insertion): not supported"),
    "min_p": (_none_or(0), "min_p: not supported (the trainer recomputes plain log-probs)"),
    "repetition_penalty": (_none_or(1), "repetition_penalty: not supported"),
    "modalities": (_none_or(["text"]), "modalities other than text: not supported"),
    "web_search_options": (_none_or(), "web_search_options: no web search here"),
    "audio": (_none_or(), "audio output: not supported"),
}
"""Fields (OpenAI's, and vLLM's extras) that would change the output and that serve mode
cannot honour, outside the structs below: a value other than the harmless ones is a 400."""


def unknown_fields(body: bytes, type_: type[msgspec.Struct]) -> list[str]:
    """The top-level fields of the JSON object ``body`` that ``type_`` does not read and
    :data:`ACCEPTED_IGNORED` does not name (at most 16, each cut to 64 characters); a
    :class:`SchemaError` for a field of :data:`REFUSED` with a value it cannot honour."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError:
        return []  # the typed decode says what is wrong with it
    for name, (harmless, why) in REFUSED.items():
        if name not in fields:
            continue
        try:
            value = msgspec.json.decode(fields[name])
        except (msgspec.DecodeError, RecursionError) as exc:
            raise SchemaError(f"{name}: not a JSON value it can read") from exc
        if not harmless(value):
            raise SchemaError(f"{name}: {why}")
    known = set(type_.__struct_fields__) | ACCEPTED_IGNORED | set(REFUSED)
    return [name[:64] for name in fields if name not in known][:16]


Stop = str | list[str] | None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    """A last chunk with the ``usage`` (and no choices)."""


class _Sampling(msgspec.Struct, kw_only=True):
    """What chat and text completions share."""

    model: str = ""
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    """Nucleus sampling; below 1 only when the run's trainer corrects for it
    (:func:`refuse_unsupported`)."""
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    """vLLM's extra: sample among the ``top_k`` likeliest tokens (0 or -1: all); above 0
    only when the run's trainer corrects for it."""
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stop: Stop = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: dict | None = None
    conversation_id: Id | None = None
    """streamrft's own field (``extra_body``): responses with the same id form one group
    and ``/feedback`` can reward them together; also the ``X-Conversation-Id`` header."""

    def stops(self) -> list[str]:
        """The stop strings (at most 4, none empty)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise SchemaError("stop: up to 4 non-empty strings")
        return stops


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessageIn], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    previous_response_id: Id | None = None
    """streamrft's own field (``extra_body``): the response whose answer is the request's
    last assistant message (``serve.record: episode`` then extends that response's
    experience; found without it by the tool calls' ids or within the conversation)."""


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list[str]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    echo: bool = False

    def text(self) -> str:
        """The one prompt (a list of one is accepted)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise SchemaError("prompt: one prompt per request (a list of one is accepted)")
        return self.prompt[0]


class Feedback(msgspec.Struct, kw_only=True):
    """``POST /feedback``: a reward for a response (all its choices, or one) or for every
    response of a conversation."""

    reward: float
    response_id: Id | None = None
    conversation_id: Id | None = None
    choice: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Commit(msgspec.Struct, kw_only=True):
    """``POST /commit``: publish the rewarded responses (of one response or conversation,
    or all of them)."""

    response_id: Id | None = None
    conversation_id: Id | None = None


def truncation(req: ChatRequest | CompletionRequest) -> tuple[float, int]:
    """The request's ``(top_p, top_k)``, 1.0 and 0 when it does not truncate."""
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    return (1.0 if req.top_p is None else req.top_p), top_k


def refuse_unsupported(req: ChatRequest | CompletionRequest, corrected: bool) -> None:
    """Raise SchemaError for a field serve mode cannot honour; ``corrected``: whether the
    run's trainer corrects for a sampling distribution other than the policy's
    (``algorithm.off_policy_correction``), which ``top_p`` < 1 and ``top_k`` > 0 need."""
    wants_logprobs = req.logprobs is not None and req.logprobs is not False  # 0: its own
    if req.stream and wants_logprobs:
        raise SchemaError("logprobs: not with stream=true (send stream=false for log-probs)")
    if truncation(req) != (1.0, 0) and not corrected:
        raise SchemaError(
            "top_p < 1 and top_k > 0 sample from a truncated distribution, and this run's "
            "trainer trains with the ratio to the rollout log-probs "
            "(algorithm.off_policy_correction: none): set an off-policy correction "
            "(truncated_is_token, for one) or send top_p=1 and no top_k"
        )
    if req.logit_bias or req.presence_penalty or req.frequency_penalty:
        raise SchemaError(
            "logit_bias, presence_penalty, frequency_penalty: not supported (the trainer "
            "recomputes plain log-probs)"
        )
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise SchemaError("response_format: only text is supported")
    if isinstance(req, ChatRequest):
        if req.top_logprobs:
            raise SchemaError("top_logprobs: not supported (logprobs=true gives each token's)")
    elif req.echo:
        raise SchemaError("echo: not supported")
