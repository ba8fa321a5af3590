"""``stream: true`` through the official ``openai`` client against an explorer's recording
endpoint (the serve API in process): the chunks add up to the answer without streaming,
tool calls arrive as ``delta.tool_calls``, usage comes last when asked, the recorded
experience is the same as without streaming, and a client that goes away mid-stream
leaves a recorded, unrewarded response that expires by the TTL."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.serving.endpoint import RecordingEndpoint
from streamrft.producers.serving.streaming import pieces
from streamrft.schemas import unpack_f32, unpack_i32
from tests.helpers.endpoints import client_of, tiny_endpoint
from tests.helpers.scripted import CHARSET, HERMES, ScriptedEngine

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "12+34="}]


@pytest.fixture
def tiny():
    ep = tiny_endpoint("stream-run", version=4, max_tokens=12)
    yield ep
    ep.stop()


def recorded(ep, episode: str):
    [exp] = ep.collect(episode, 0.5)
    return unpack_i32(exp.tokens), unpack_f32(exp.logprobs), exp.model_version


def test_the_chunks_add_up_to_the_answer_and_the_same_experience_is_recorded(tiny):
    whole = client_of(tiny, "plain").chat.completions.create(
        model="policy", messages=ASK, seed=11, max_tokens=12
    )
    stream = client_of(tiny, "streamed").chat.completions.create(
        model="policy",
        messages=ASK,
        seed=11,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == whole.choices[0].finish_reason and not any(finishing[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # usage last
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.model_extra["model_version"] == 4 for c in chunks)
    # streaming changed nothing of what was sampled and recorded
    assert recorded(tiny, "streamed") == recorded(tiny, "plain")


def test_a_text_completion_streams_its_text(tiny):
    client = client_of(tiny, "text")
    whole = client.completions.create(model="policy", prompt="7+8=", seed=3, max_tokens=10)
    parts = list(
        client.completions.create(model="policy", prompt="7+8=", seed=3, max_tokens=10, stream=True)
    )
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="logprobs: not with stream=true"):
        client.completions.create(model="policy", prompt="1", logprobs=0, stream=True)


def test_a_tool_call_streams_as_a_tool_calls_delta():
    tok = build_char_tokenizer(CHARSET)
    tok.chat_template = HERMES
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    ep = RecordingEndpoint(
        ScriptedEngine(tok, [f"Adding. {call}"]),
        PromptRenderer(tok, format="chat"),
        "stream-tools",
        "explorer-0",
    )
    ep.start()
    ep.prepare(version=0, temperature=1.0, max_tokens=80)
    try:
        tools = [{"type": "function", "function": {"name": "add"}}]
        chunks = list(
            client_of(ep, "t").chat.completions.create(
                model="policy", messages=ASK, tools=tools, stream=True
            )
        )
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(d.content or "" for d in deltas) == "Adding."
        [called] = [tc for d in deltas for tc in d.tool_calls or []]
        assert called.index == 0 and called.id.startswith("call_")
        assert called.function.name == "add" and json.loads(called.function.arguments) == {"a": 2}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        ep.stop()


def test_a_client_gone_mid_stream_leaves_a_response_the_ttl_expires(tiny):
    baseline = tiny.recorder.held
    conn = http.client.HTTPConnection("127.0.0.1", tiny.port, timeout=30)
    body = json.dumps({"model": "policy", "messages": ASK, "stream": True, "max_tokens": 12})
    conn.request("POST", "/ep/gone/v1/chat/completions", body, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.read1(64).startswith(b"data: {")  # the first chunk, then hang up
    conn.close()
    assert tiny.recorder.held == baseline + 1  # recorded before the first chunk went out
    ttl = tiny.limits.unrewarded_ttl_s
    tiny.recorder.expire(time.time() + ttl + 1, ttl)  # as time passes: nobody rewarded it
    assert tiny.recorder.held == baseline


@pytest.mark.parametrize("text", ["", "a", "  a b\n\nc  ", "word", "\n", "x y", " lead", "trail  "])
def test_the_pieces_join_to_the_text(text):
    assert "".join(pieces(text)) == text
