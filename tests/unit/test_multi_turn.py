"""Multi-turn and tool workflows: the whole conversation as one experience, trained only on
the policy's own tokens; the local tools are safe on any input."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from streamrft.consumers.batching import collate, response_logprobs
from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.rewards import exact_match
from streamrft.producers.workflows import WORKFLOWS, RolloutSpec
from streamrft.producers.workflows.conversation import TurnRenderer, template_takes_tools
from streamrft.producers.workflows.tools import (
    TOOL_SCHEMAS,
    ToolCall,
    calculator,
    lookup,
    parse_call,
    run_call,
)
from streamrft.schemas import ChatMessage, SchemaError, Task, unpack_f32, unpack_i32
from streamrft.schemas.experience import Experience, validate_group
from tests.helpers.scripted import CHARSET, CHAT, HERMES, ScriptedEngine

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)

CALL = "<tool>calculator(3+4)</tool>"
ADD = Task(id="add", prompt="3+4=", answer="7", workflow="tool_calling")


def spec(repeat_times: int = 2, max_new_tokens: int = 40, prompts=None) -> RolloutSpec:
    return RolloutSpec(
        repeat_times=repeat_times,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        seed=0,
        run="r",
        explorer="explorer-0",
        model_version=3,
        prompts=prompts,
    )


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(CHARSET)


def chat_tok(template: str):
    tokenizer = build_char_tokenizer(CHARSET)
    tokenizer.chat_template = template
    return tokenizer


def task(**metadata: str) -> Task:
    return msgspec.structs.replace(ADD, metadata=metadata)


def parts(exp: Experience) -> tuple[list[int], list[int], list[int], list[float]]:
    tokens = unpack_i32(exp.tokens)
    return (
        tokens[: exp.prompt_length],
        tokens[exp.prompt_length :],
        list(exp.action_mask),
        unpack_f32(exp.logprobs),
    )


# -- the experience, token by token ----------------------------------------------------------


def test_a_tool_episode_is_prompt_call_result_answer_with_the_mask_on_the_policy_only(tok):
    engine = ScriptedEngine(tok, [CALL, "7"])
    (group,) = WORKFLOWS["tool_calling"](engine, [ADD], exact_match, spec())
    validate_group(group)
    assert len(group.experiences) == 2 and len(engine.calls) == 2  # one engine call per turn
    assert len(engine.calls[0]) == 2  # both episodes of the task in the same call
    eos = tok.eos_token_id
    prompt = tok("3+4=").input_ids  # raw format: the prompt with its BOS
    turn1 = [*engine.ids(CALL), eos]
    glue = engine.ids("\n\n7\n\n")  # the tool's result between blank lines, after the EOS
    turn2 = [*engine.ids("7"), eos]
    for exp in group.experiences:
        got_prompt, response, mask, logprobs = parts(exp)
        assert got_prompt == prompt
        assert response == turn1 + glue + turn2
        assert mask == [1] * len(turn1) + [0] * len(glue) + [1] * len(turn2)
        assert logprobs == pytest.approx(
            engine.logprobs(0, len(turn1)) + [0.0] * len(glue) + engine.logprobs(1, len(turn2))
        )
        assert exp.reward == 1.0 and exp.model_version == 3
        assert exp.info["turns"] == 2 and exp.info["tool_calls"] == 1
        assert exp.info["truncated"] == 0 and exp.info["response_length"] == sum(mask)
    # the second turn was sampled from exactly the ids recorded before it
    assert engine.calls[1][0] == prompt + turn1 + glue
    assert group.workflow == "tool_calling"


def test_chat_glue_is_what_the_template_renders_for_the_whole_conversation():
    tokenizer = chat_tok(CHAT)
    engine = ScriptedEngine(tokenizer, [CALL, "7"])
    render = PromptRenderer(tokenizer, format="chat", system_prompt="be short")
    (group,) = WORKFLOWS["tool_calling"](engine, [ADD], exact_match, spec(1, prompts=render))
    exp = group.experiences[0]
    prompt, response, mask, _ = parts(exp)
    # the template's text of the finished conversation, tokenized at once, is the same ids:
    # the policy's EOS closes its turn (not doubled), the newline after it is glue
    system = (
        "be short\n\n"
        + (TurnRenderer(render, TOOL_SCHEMAS)._system([])[0]["content"].split("\n\n", 1)[1])
    )
    conversation = [
        {"role": "system", "content": system},
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    whole = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert prompt + response == tokenizer(whole, add_special_tokens=False).input_ids[:-1]
    assert "<tool>NAME(ARGUMENT)</tool>" in tokenizer.decode(prompt)  # told the plain format
    glue = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if not m])
    assert glue == "\n<|tool|>7</s>\n<|assistant|>"
    policy = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m])
    assert policy == CALL + "</s>7</s>"


def test_a_template_that_takes_tools_gets_them_and_a_hermes_call_is_run():
    tokenizer = chat_tok(HERMES)
    assert template_takes_tools(tokenizer) and not template_takes_tools(chat_tok(CHAT))
    hermes = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [hermes, "42"])
    six = msgspec.structs.replace(ADD, prompt="6*7=", answer="42")
    (group,) = WORKFLOWS["tool_calling"](engine, [six], exact_match, spec(1, 120))
    exp = group.experiences[0]
    prompt, response, mask, _ = parts(exp)
    assert tokenizer.decode(prompt).startswith("<|system|>tools:calculator lookup </s>")
    assert "NAME(ARGUMENT)" not in tokenizer.decode(prompt)  # no plain-format instructions
    glue = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if not m])
    assert glue == "\n<|tool|>42</s>\n<|assistant|>"
    assert exp.reward == 1.0


# -- bounds ------------------------------------------------------------------------------------


def test_max_turns_ends_an_episode_without_inserting_the_last_result(tok):
    engine = ScriptedEngine(tok, [CALL])  # calls the tool forever
    (group,) = WORKFLOWS["tool_calling"](engine, [task(max_turns="3")], exact_match, spec())
    validate_group(group)
    exp = group.experiences[0]
    _, response, mask, _ = parts(exp)
    turn = [*engine.ids(CALL), tok.eos_token_id]
    glue = engine.ids("\n\n7\n\n")
    assert response == turn + glue + turn + glue + turn  # the third result is not inserted
    assert mask[-len(turn) :] == [1] * len(turn)
    assert exp.info["turns"] == 3 and exp.info["truncated"] == 1 and exp.reward == 0.0
    assert len(engine.calls) == 3


def test_the_token_budget_cuts_a_turn_and_ends_the_episode(tok):
    engine = ScriptedEngine(tok, [CALL, "7"])
    budget = 5 + 30 + 3  # prompt + first turn + room for only part of the tool result
    (group,) = WORKFLOWS["tool_calling"](
        engine, [task(max_tokens=str(budget))], exact_match, spec()
    )
    validate_group(group)
    exp = group.experiences[0]
    assert exp.num_tokens <= budget
    assert exp.info["turns"] == 1 and exp.info["truncated"] == 1
    assert list(exp.action_mask) == [1] * exp.response_length  # no result was inserted
    # a budget inside the first turn cuts it (the prefix keeps its log-probs) and ends there
    engine = ScriptedEngine(tok, [CALL, "7"], max_positions=5 + 10)  # the model's context
    (group,) = WORKFLOWS["tool_calling"](engine, [ADD], exact_match, spec(1))
    exp = group.experiences[0]
    assert exp.num_tokens == 15 and exp.response_length == 10
    assert unpack_f32(exp.logprobs) == pytest.approx(engine.logprobs(0, 10))
    assert exp.info["tool_calls"] == 0 and exp.info["truncated"] == 0  # an unfinished call
    assert len(engine.calls) == 1


def test_the_per_turn_limit_is_spec_max_new_tokens(tok):
    engine = ScriptedEngine(tok, [CALL, "7"])
    (group,) = WORKFLOWS["tool_calling"](engine, [ADD], exact_match, spec(1, max_new_tokens=8))
    assert group.experiences[0].response_length == 8  # cut inside the call: a final answer
    assert group.experiences[0].reward == 0.0


# -- environments and rewards ------------------------------------------------------------------


def test_the_conversation_environment_plays_the_scripted_user_turns(tok):
    chat = Task(
        id="c",
        answer="9",
        workflow="multi_turn",
        messages=[ChatMessage(role="user", content="hi")],
        metadata={"turns": json.dumps(["and 4+5?"])},
    )
    engine = ScriptedEngine(tok, ["hello", "9"])
    (group,) = WORKFLOWS["multi_turn"](engine, [chat], exact_match, spec(1))
    exp = group.experiences[0]
    prompt, response, mask, _ = parts(exp)
    eos = tok.eos_token_id
    user = engine.ids("\n\nand 4+5?\n\n")
    assert prompt == tok("hi").input_ids
    assert response == [*engine.ids("hello"), eos, *user, *engine.ids("9"), eos]
    assert mask == [1] * 6 + [0] * len(user) + [1] * 2
    assert exp.reward == 1.0 and exp.info["turns"] == 2
    # a plain task is one policy turn, as the math workflow's
    (group,) = WORKFLOWS["multi_turn"](ScriptedEngine(tok, ["7"]), [ADD], exact_match, spec(1))
    assert group.experiences[0].info["turns"] == 1 and group.experiences[0].reward == 1.0


def test_expected_call_gates_the_reward_and_a_bad_environment_is_refused(tok):
    engine = ScriptedEngine(tok, [CALL, "7"])
    right, wrong = task(expected_call="calculator( 3 + 4 )"), task(expected_call="lookup(x)")
    wrong = msgspec.structs.replace(wrong, id="wrong")
    groups = WORKFLOWS["tool_calling"](engine, [right, wrong], exact_match, spec(1))
    assert [g.experiences[0].reward for g in groups] == [1.0, 0.0]
    assert [g.experiences[0].info["expected_call"] for g in groups] == [1.0, 0.0]
    with pytest.raises(SchemaError, match=r"environment 'nope'.*known: conversation, tools"):
        WORKFLOWS["tool_calling"](engine, [task(env="nope")], exact_match, spec(1))
    with pytest.raises(SchemaError, match="max_turns"):
        WORKFLOWS["tool_calling"](engine, [task(max_turns="0")], exact_match, spec(1))


# -- the real engine: each turn sampled from exactly the recorded ids ---------------------------


def test_recorded_logprobs_are_the_models_on_the_whole_sequence(tok):
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, max_positions=128
    )
    model = build_tiny_model(cfg, tok).eval()
    engine = TransformersEngine(model, tok)
    tasks = [task(max_turns="3"), msgspec.structs.replace(ADD, id="b", prompt="12+30=")]
    groups = WORKFLOWS["multi_turn"](
        engine,
        [
            msgspec.structs.replace(t, metadata={**t.metadata, "turns": '["go on", "more"]'})
            for t in tasks
        ],
        exact_match,
        spec(3, max_new_tokens=6),
    )
    experiences = [e for g in groups for e in validate_group(g).experiences]
    assert any(0 in e.action_mask for e in experiences)  # user turns were inserted
    batch = collate(experiences, tok.pad_token_id)
    with torch.no_grad():
        again = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width)
    on = batch.response_mask.bool()
    torch.testing.assert_close(again[on], batch.old_logprobs[on], atol=1e-4, rtol=0)
    assert (batch.old_logprobs[~on] == 0).all()


# -- the tools ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("2+3", "5"),
        (" (2 + 3) * 4 ", "20"),
        ("7/2", "3.5"),
        ("-3--4", "1"),
        ("1/3", "0.333333333"),
        ("2.5*2", "5"),
    ],
)
def test_the_calculator_does_arithmetic(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo pwned')",
        "open('/etc/passwd').read()",
        "(1).__class__",
        "2**1000000",
        "9" * 300,
        "1e300*1e300",
        "x+1",
        "1/0",
        "2+",
        "[1, 2]",
        "True+1",
        "lambda: 1",
        "(" * 150 + "1" + ")" * 150,
    ],
)
def test_the_calculator_refuses_anything_else_with_an_error_message(expression):
    result = calculator(expression)
    assert result.startswith("error: ")


def test_lookup_reads_the_tasks_table_and_calls_parse_in_both_formats():
    table = {"paris": "france"}
    assert lookup("paris", table) == "france" and lookup("'paris'", table) == "france"
    assert lookup("rome", table).startswith("error: ") and lookup("x", None).startswith("error")
    assert parse_call("ok <tool>lookup(paris)</tool> then") == ToolCall("lookup", "paris")
    assert parse_call('<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>') == (
        ToolCall("lookup", "k")
    )
    assert parse_call("<tool_call>{broken</tool_call>").name == "invalid"
    assert parse_call("the answer is 7") is None
    assert run_call(ToolCall("rm", "-rf"), None).startswith("error: unknown tool 'rm'")


def test_a_lookup_episode_reads_the_table_from_metadata(tok):
    engine = ScriptedEngine(tok, ["<tool>lookup(paris)</tool>", "france"])
    capital = Task(
        id="cap",
        prompt="paris is in?",
        answer="france",
        workflow="tool_calling",
        metadata={"lookup": json.dumps({"paris": "france"})},
    )
    (group,) = WORKFLOWS["tool_calling"](engine, [capital], exact_match, spec(1))
    assert "\n\nfrance\n\n" in group.experiences[0].response_text
    assert group.experiences[0].reward == 1.0 and group.experiences[0].info["tool_errors"] == 0
