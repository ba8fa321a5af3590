"""Tool calls through the official ``openai`` client, against an explorer's recording
endpoint (the serve API in process) whose engine answers a script: a call comes back as
``tool_calls`` with ``finish_reason`` ``tool_calls``; the next turn, with the assistant's
calls and the tool's result, is accepted and rendered for the model; a malformed call
comes back as text and is counted; a bad ``tool_choice`` is a 400."""

from __future__ import annotations

import json

import openai
import pytest

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.serving.endpoint import RecordingEndpoint
from tests.helpers.probes import check
from tests.helpers.scripted import ADD_TOOL, CHARSET, CHAT, HERMES, ScriptedEngine

pytestmark = pytest.mark.integration

ADD = ADD_TOOL
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def serve(template: str, script: list[str]):
    tok = build_char_tokenizer(CHARSET)
    tok.chat_template = template
    engine = ScriptedEngine(tok, script)
    ep = RecordingEndpoint(engine, PromptRenderer(tok, format="chat"), "tools-run", "explorer-0")
    ep.start()
    ep.prepare(version=0, temperature=1.0, max_tokens=80)
    return ep, engine


def client_of(ep, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url(episode), api_key="unused", max_retries=0)


def test_a_call_comes_back_as_tool_calls_and_the_result_goes_on_the_next_turn():
    ep, engine = serve(HERMES, [CALL, "5"])
    try:
        client = client_of(ep, "e1")
        ask = [{"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(model="policy", messages=ask, tools=[ADD])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert call.id.startswith("call_")
        # the template got the tools itself (no compact instructions)
        prompt = engine.tokenizer.decode(engine.calls[0][0])
        assert prompt.startswith("<|system|>tools:add </s>") and "<tool_call>" not in prompt

        then = [
            *ask,
            choice.message.model_dump(exclude_none=True),  # as an agent sends it back
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        second = client.chat.completions.create(model="policy", messages=then, tools=[ADD])
        assert second.choices[0].message.content == "5"
        assert second.choices[0].finish_reason == "stop"
        assert not second.choices[0].message.tool_calls
        prompt = engine.tokenizer.decode(engine.calls[1][0])
        assert prompt.endswith("<|tool|>5</s>\n<|assistant|>")
        _, health = check(ep.base_url("e1").removesuffix("/v1"), "/health")
        assert health["tool_calls"] == {"calls": 1, "malformed": 0, "unmet": 0}
        assert health["episodes"] == {"continued": 1, "unmatched": 0, "rewritten": 0}
        (episode,) = ep.collect("e1", 1.0)  # both turns: one experience
        assert episode.info["turns"] == 2.0
    finally:
        ep.stop()


def test_a_model_without_tool_template_gets_the_compact_format_and_bad_calls_stay_text():
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    ep, engine = serve(CHAT, [broken, CALL])
    try:
        client = client_of(ep, "e2")
        ask = [{"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(
            model="policy", messages=ask, tools=[ADD], tool_choice="required"
        )
        assert first.choices[0].message.content == broken  # returned as text, never a 500
        assert not first.choices[0].message.tool_calls
        prompt = engine.tokenizer.decode(engine.calls[0][0])
        assert "Call one of these functions now. To call one, write <tool_call>" in prompt
        # tool_choice none: no tools offered, the same text is not read for calls
        plain = client.chat.completions.create(
            model="policy", messages=ask, tools=[ADD], tool_choice="none"
        )
        assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
        assert "<tool_call>" not in engine.tokenizer.decode(engine.calls[1][0])
        _, health = check(ep.base_url("e2").removesuffix("/v1"), "/health")
        assert health["tool_calls"] == {"calls": 0, "malformed": 1, "unmet": 1}
        with pytest.raises(openai.BadRequestError, match="'mul' is not among the tools"):
            client.chat.completions.create(
                model="policy",
                messages=ask,
                tools=[ADD],
                tool_choice={"type": "function", "function": {"name": "mul"}},
            )
        with pytest.raises(openai.BadRequestError, match="arguments are not JSON"):
            client.chat.completions.create(
                model="policy",
                messages=[
                    *ask,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "add", "arguments": "{"},
                            }
                        ],
                    },
                ],
                tools=[ADD],
            )
    finally:
        ep.stop()


NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}" + CHAT
)
"""A template that refuses a system turn, as Gemma's does."""


def test_what_cannot_be_honoured_or_rendered_is_a_400_and_nothing_is_recorded():
    ep, engine = serve(NO_SYSTEM, [CALL])
    try:
        client = client_of(ep, "e3")
        ask = [{"role": "user", "content": "2+3?"}]
        # the compact format's system turn meets a template that refuses one
        with pytest.raises(openai.BadRequestError, match="chat template refused the messages"):
            client.chat.completions.create(model="policy", messages=ask, tools=[ADD])
        for extra, said in (
            ({"functions": [{"name": "add"}]}, "legacy functions: send tools"),
            ({"top_k": 5}, "top_k > 0 sample from a truncated distribution"),
            ({"top_p": 0.9}, r"off_policy_correction: none\): set an off-policy correction"),
            ({"modalities": ["text", "audio"]}, "modalities other than text"),
        ):
            with pytest.raises(openai.BadRequestError, match=said):
                client.chat.completions.create(model="policy", messages=ask, extra_body=extra)
        with pytest.raises(openai.BadRequestError, match="best_of other than 1"):
            client.completions.create(model="policy", prompt="1+1=", extra_body={"best_of": 3})
        harmless = {"top_k": -1, "modalities": ["text"], "functions": None}
        client.chat.completions.create(model="policy", messages=ask, extra_body=harmless)
        assert len(engine.calls) == 1 and ep.recorder.held == 1  # only the harmless one
    finally:
        ep.stop()
