"""Tool calls on the chat API, the pure part: what a request offers, how the conversation
is rendered (a template's own tools, or the compact format), and how a policy turn is read
back into calls or, when malformed, kept as text."""

from __future__ import annotations

import json

import msgspec
import pytest

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.serving.openai_types import ChatRequest
from streamrft.producers.serving.tool_calls import (
    Call,
    Turn,
    conversation,
    offered,
    parse,
    prompt_text,
)
from streamrft.schemas.errors import SchemaError
from tests.helpers.scripted import ADD_TOOL, CHARSET, CHAT, HERMES

pytestmark = pytest.mark.unit

ADD = ADD_TOOL
MUL = {"type": "function", "function": {"name": "mul"}}


def request(**body) -> ChatRequest:
    body.setdefault("messages", [{"role": "user", "content": "2+3?"}])
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatRequest)


def renderer(template: str | None) -> PromptRenderer:
    tok = build_char_tokenizer(CHARSET)
    if template is None:
        return PromptRenderer(tok, format="raw")
    tok.chat_template = template
    return PromptRenderer(tok, format="chat")


def test_what_a_request_offers():
    both = request(tools=[ADD, MUL])
    assert [t.function.name for t in offered(both.tools, None)] == ["add", "mul"]
    assert offered(both.tools, "none") == []
    named = request(tools=[ADD, MUL], tool_choice={"type": "function", "function": {"name": "mul"}})
    assert [t.function.name for t in offered(named.tools, named.tool_choice)] == ["mul"]
    with pytest.raises(SchemaError, match="'div' is not among the tools"):
        bad = request(tools=[ADD], tool_choice={"type": "function", "function": {"name": "div"}})
        offered(bad.tools, bad.tool_choice)
    with pytest.raises(SchemaError, match="tool_choice: only with tools"):
        offered(None, "required")
    with pytest.raises(SchemaError, match="same name"):
        offered(request(tools=[ADD, ADD]).tools, None)
    with pytest.raises(msgspec.ValidationError):  # a name no API would accept
        request(tools=[{"type": "function", "function": {"name": "a b"}}])


CALLED = [
    {"role": "user", "content": "2+3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]


def test_a_template_that_takes_tools_gets_them_and_the_turns_as_sent():
    req = request(messages=CALLED, tools=[ADD])
    messages = conversation(req.messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2}  # an object
    assert messages[2] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}
    text = prompt_text(renderer(HERMES), messages, offered(req.tools, None), None)
    assert text.startswith("<|system|>tools:add </s>\n<|user|>2+3?</s>\n")
    assert text.endswith("<|tool|>5</s>\n<|assistant|>")
    assert "<tool_call>" not in text  # the template's own way, not the compact format


@pytest.mark.parametrize("template", [CHAT, None], ids=["chat-template", "raw"])
def test_other_models_get_the_compact_format(template):
    req = request(messages=CALLED, tools=[ADD], tool_choice="required")
    text = prompt_text(
        renderer(template), conversation(req.messages), offered(req.tools, None), "required"
    )
    assert "Call one of these functions now. To call one, write <tool_call>" in text
    assert '- add: Add two numbers. Parameters: {"type":"object","properties"' in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>' in text  # earlier call
    assert "<tool_response>5</tool_response>" in text  # the result, as a user turn
    if template is not None:
        assert "<|user|><tool_response>5</tool_response></s>\n<|assistant|>" in text


def test_hermes_blocks_become_calls_and_the_rest_content():
    tools = request(tools=[ADD, MUL]).tools
    text = (
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 4}"}</tool_call>'
    )
    turn = parse("hermes", text, tools)
    assert turn == Turn("Let me add.", [Call("add", '{"a": 2, "b": 3}'), Call("mul", '{"a": 4}')])
    assert json.loads(turn.calls[1].arguments) == {"a": 4}  # a string of JSON, read too
    only = parse("hermes", '<tool_call>{"name": "add", "arguments": {}}</tool_call>', tools)
    assert only.content is None and only.calls == [Call("add", "{}")]
    assert parse("hermes", "5", tools) == Turn("5")


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": {"a": 2}</tool_call>',  # broken JSON
        '<tool_call>{"name": "div", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',  # not an object
        '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name"',  # unclosed
        "<tool_call>not json at all",
    ],
)
def test_a_malformed_call_is_kept_as_text(text):
    turn = parse("hermes", text, request(tools=[ADD]).tools)
    assert turn == Turn(text, [], malformed=True)


def test_the_json_parser_reads_one_object_naming_a_function():
    tools = request(tools=[ADD]).tools
    assert parse("json", ' {"name": "add", "parameters": {"a": 1}} ', tools) == Turn(
        None, [Call("add", '{"a": 1}')]
    )
    assert parse("json", "It is 5.", tools) == Turn("It is 5.")
    assert parse("json", '{"name": "nope"}', tools).malformed


def test_without_tools_nothing_is_read():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse("hermes", text, []) == Turn(text)  # tool_choice none: the text as is


@pytest.mark.parametrize(
    "body",
    [
        '{"name": ["add"], "arguments": {}}',  # a name that is no string
        '{"name": "add", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",  # deeper than JSON goes
        '{"name": "add", "arguments": {"a": NaN}}',  # not JSON for other clients
        "[" * 5000,
    ],
)
def test_what_a_drifting_policy_writes_never_raises(body):
    text = f"<tool_call>{body}</tool_call>"
    tools = request(tools=[ADD]).tools
    assert parse("hermes", text, tools) == Turn(text, [], malformed=True)
    assert parse("json", body, tools).calls == []


def test_arguments_come_back_as_json_any_client_reads():
    tools = request(tools=[ADD]).tools
    turn = parse(
        "hermes", '<tool_call>{"name": "add", "arguments": {"a": "\\ud800é"}}</tool_call>', tools
    )
    assert turn.calls[0].arguments == '{"a": "\\ud800\\u00e9"}'  # ASCII, escapes kept
    many = "<tool_call>" * 20000  # unclosed openings: one pass, malformed
    assert parse("hermes", many, tools) == Turn(many, [], malformed=True)


def test_an_earlier_call_too_deep_to_read_is_a_bad_request():
    deep = {**CALLED[1], "tool_calls": [{**CALLED[1]["tool_calls"][0]}]}
    deep["tool_calls"][0]["function"] = {"name": "add", "arguments": "[" * 5000}
    with pytest.raises(SchemaError, match="arguments are not JSON"):
        conversation(request(messages=[CALLED[0], deep]).messages)


def test_results_in_a_row_are_one_user_turn_in_the_compact_format():
    results = [*CALLED, {"role": "tool", "tool_call_id": "call_2", "content": "7"}]
    req = request(messages=results, tools=[ADD])
    text = prompt_text(renderer(CHAT), conversation(req.messages), offered(req.tools, None), None)
    assert "<|user|><tool_response>5</tool_response>\n<tool_response>7</tool_response></s>" in text
