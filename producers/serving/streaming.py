"""``stream: true``: a finished response sent as Server-Sent Events in OpenAI's chunk format.

Generate, then chunk: the engines here return whole responses (the transformers engine
samples every token before it returns; the vLLM engine is called the same way), so the
response is sampled, recorded and read for tool calls exactly as without streaming, then
sent as chunks: for a chat completion a first ``delta`` with the role, the content in
word-sized pieces (their concatenation is the content, to the character), each tool call
in one ``delta.tool_calls`` entry, a last chunk with the ``finish_reason``; for a text
completion the text in pieces and the ``finish_reason`` on the last. With
``stream_options.include_usage`` a final chunk with no choices carries ``usage``. Then
``data: [DONE]``. Every chunk carries ``model_version`` as the whole response does. Pure:
the body in, the event lines out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

_PIECE = re.compile(r"\s*\S+|\s+$")


def pieces(text: str) -> list[str]:
    """``text`` cut before each word (whitespace goes with the word after it); joined, the
    pieces are ``text``."""
    return _PIECE.findall(text) if text else []


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"  # ASCII: any str encodes


DONE = b"data: [DONE]\n\n"


def chunks(body: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """The chunk objects of the finished response ``body`` (chat or text completion)."""
    chat = body["object"] == "chat.completion"
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body["model"],
        "model_version": body["model_version"],
    }

    def one(index: int, part: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": index, **part, "finish_reason": finish}
        if not chat:
            choice["logprobs"] = None
        return {**head, "choices": [choice]}

    for c in body["choices"]:
        i = c["index"]
        if chat:
            message = c["message"]
            yield one(i, {"delta": {"role": "assistant", "content": ""}})
            for piece in pieces(message.get("content") or ""):
                yield one(i, {"delta": {"content": piece}})
            for k, call in enumerate(message.get("tool_calls") or []):
                yield one(i, {"delta": {"tool_calls": [{"index": k, **call}]}})
            yield one(i, {"delta": {}}, c["finish_reason"])
        else:
            for piece in pieces(c["text"]):
                yield one(i, {"text": piece})
            yield one(i, {"text": ""}, c["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": body["usage"]}


def events(body: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    """The SSE stream of ``body``: one ``data:`` event a chunk, then ``[DONE]``."""
    for chunk in chunks(body, include_usage):
        yield _frame(chunk)
    yield DONE
