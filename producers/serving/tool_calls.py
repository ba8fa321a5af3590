"""Tool calls on the chat API: which tools a request offers (``tools``, ``tool_choice``), the
conversation with its earlier calls and results rendered for the model, and the policy's
text parsed back into ``tool_calls``. Pure: the tokenizer and the renderer are passed in.

**Rendering.** A chat template that reads ``tools`` (Qwen's, Hermes', Llama 3.1's...) gets
them, and the earlier turns as OpenAI sends them (an assistant message's ``tool_calls``,
``tool`` messages). Any other model gets the **compact format**: a system message listing
the functions (name, description, parameters as JSON) and asking for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an earlier call is written
into its assistant message that way, and a tool's result becomes a user message
``<tool_response>RESULT</tool_response>``.

**Parsing** (``serve.tool_parser``, :data:`PARSERS`): ``hermes`` reads every
``<tool_call>{json}</tool_call>`` block (Qwen and Hermes templates, and the compact format);
``json`` reads a response that is one JSON object ``{"name", "arguments"|"parameters"}``
(Llama 3.1's format). A block that does not parse, names a function the request did not
offer, or is never closed makes the turn **malformed**: the text comes back as the
message's content with no ``tool_calls``, and the server counts it.

``tool_choice``: ``none`` offers no tools; ``auto`` (the default with tools) lets the
model choose; ``required`` and a named function (which then is the only one offered) are
asked of the model in the compact format's instructions, and not enforced while decoding:
an answer without a call comes back as text and is counted (``unmet``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrft.infra.prompts import RAW_SEPARATOR, PromptRenderer, with_system_prompt
from streamrft.producers.serving.openai_types import ChatMessageIn, NamedChoice, ToolDef
from streamrft.producers.workflows.conversation import template_takes_tools
from streamrft.schemas.errors import SchemaError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str
    """The arguments as a JSON object's text (what the API's ``function.arguments`` holds)."""


@dataclass(frozen=True)
class Turn:
    """A policy turn as the API answers it."""

    content: str | None
    calls: list[Call] = field(default_factory=list)
    malformed: bool = False


# -- what the request offers ------------------------------------------------------------------


def offered(tools: list[ToolDef] | None, choice: str | NamedChoice | None) -> list[ToolDef]:
    """The tools the model is offered; a :class:`SchemaError` (a 400) for a ``tool_choice``
    without tools, or naming a function the request does not define."""
    tools = tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise SchemaError("tools: two functions of the same name")
    if choice is not None and not tools:
        raise SchemaError("tool_choice: only with tools")
    if choice == "none":
        return []
    if isinstance(choice, NamedChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise SchemaError(
                f"tool_choice: function {choice.function.name!r} is not among the tools"
            )
        return named
    return tools


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except (ValueError, RecursionError) as exc:
        raise SchemaError(f"{where}: arguments are not JSON ({type(exc).__name__})") from exc
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: arguments must be a JSON object")
    return value


def conversation(messages: list[ChatMessageIn]) -> list[dict[str, Any]]:
    """The messages as chat templates read them (an earlier call's arguments as an object);
    a :class:`SchemaError` for a call whose arguments are not a JSON object."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments, f"messages[{i}].tool_calls"),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


# -- rendering --------------------------------------------------------------------------------


def compact_instructions(tools: list[ToolDef], choice: str | NamedChoice | None) -> str:
    """The compact format's system text: the functions and how to call them."""
    lines = [
        f"- {t.function.name}: "
        + (f"{t.function.description} " if t.function.description else "")
        + f"Parameters: {json.dumps(t.function.parameters, separators=(',', ':'))}"
        for t in tools
    ]
    ask = "You may call these functions"
    if choice == "required" or isinstance(choice, NamedChoice):
        ask = "Call one of these functions now"
    return (
        f"{ask}. To call one, write {OPEN}"
        '{"name": "NAME", "arguments": {...}}'
        f"{CLOSE}; its result comes back as <tool_response>RESULT</tool_response>.\n"
        + "\n".join(lines)
    )


def _compact(
    messages: list[dict[str, Any]], tools: list[ToolDef], choice: str | NamedChoice | None
) -> list[dict[str, Any]]:
    """``messages`` in the compact format (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":  # results in a row: one user turn (templates that alternate)
            result = f"<tool_response>{m['content']}</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
            continue
        content = m["content"]
        for call in m.get("tool_calls", []):
            body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            content += f"{OPEN}{json.dumps(body)}{CLOSE}"
        out.append({"role": m["role"], "content": content})
    if tools:
        text = compact_instructions(tools, choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + RAW_SEPARATOR + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def prompt_text(
    renderer: PromptRenderer,
    messages: list[dict[str, Any]],
    tools: list[ToolDef],
    choice: str | NamedChoice | None,
    generation_prompt: bool = True,
) -> str:
    """The prompt of a chat request (with its tools, earlier calls and results);
    ``generation_prompt`` false: the conversation alone (what a later turn appends to)."""
    messages = with_system_prompt(messages, renderer.system_prompt)  # before the compact
    if renderer.chat and template_takes_tools(renderer.tokenizer):  # instructions join it
        defs = [msgspec.to_builtins(t) for t in tools] or None
        return renderer.render(messages, defs, generation_prompt)
    return renderer.render(_compact(messages, tools, choice), None, generation_prompt)


# -- parsing ----------------------------------------------------------------------------------


def _decoded(text: str) -> Any:
    """``text`` as JSON, or None when it is not (any depth, any text: never raises)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(body: Any, names: set[str]) -> Call | None:
    """A call from a decoded object, or None when it is not one of the offered functions
    with an object of arguments that is valid JSON again (no NaN, no lone surrogate)."""
    if not isinstance(body, dict):
        return None
    name = body.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = body.get("arguments", body.get("parameters", {}))
    if isinstance(args, str):
        args = _decoded(args)
    if not isinstance(args, dict):
        return None
    try:
        return Call(name, json.dumps(args, allow_nan=False))
    except (ValueError, RecursionError):
        return None


def parse_hermes(text: str, names: set[str]) -> Turn:
    """``<tool_call>{json}</tool_call>`` blocks; the text around them is the content. One
    pass over the text (a turn of many unclosed openings costs no more than its length)."""
    if OPEN not in text:
        return Turn(text)
    calls, outside, at = [], [], 0
    while (start := text.find(OPEN, at)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:  # a block never closed
            return Turn(text, malformed=True)
        call = _call(_decoded(text[start + len(OPEN) : end].strip()), names)
        if call is None:
            return Turn(text, malformed=True)
        calls.append(call)
        outside.append(text[at:start])
        at = end + len(CLOSE)
    content = "".join([*outside, text[at:]]).strip()
    return Turn(content or None, calls)


def parse_json(text: str, names: set[str]) -> Turn:
    """A response that is one JSON object naming a function (Llama 3.1's format)."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return Turn(text)
    call = _call(_decoded(stripped), names)
    return Turn(None, [call]) if call is not None else Turn(text, malformed=True)


PARSERS: dict[str, Callable[[str, set[str]], Turn]] = {
    "hermes": parse_hermes,
    "json": parse_json,
}
"""``serve.tool_parser`` -> how a policy turn is read for calls."""


def parse(parser: str, text: str, tools: list[ToolDef]) -> Turn:
    """The turn ``text`` as the API answers it, given the offered ``tools`` (none: text)."""
    if not tools:
        return Turn(text)
    return PARSERS[parser](text, {t.function.name for t in tools})
