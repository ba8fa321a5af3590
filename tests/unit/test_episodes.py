"""One experience per conversation: the recorder's episodes (extended, rewarded through any
of their turns, published once, forgotten whole) and how a request is matched to the
response it continues (by tool-call ids, ``previous_response_id``, content within the
conversation) or refused a match (unknown, history rewritten, tools changed, a template
that renders earlier turns differently)."""

from __future__ import annotations

import msgspec
import pytest

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines.base import Rollout
from streamrft.producers.serving.episodes import (
    Episodes,
    answer,
    called_in,
    digest,
    tool_call_id,
)
from streamrft.producers.serving.openai_types import ToolDef
from streamrft.producers.serving.recorder import Continuation, Recorder
from streamrft.producers.serving.tool_calls import prompt_text
from streamrft.schemas.arrays import unpack_f32, unpack_i32, unpack_u8
from streamrft.schemas.experience import validate_group
from tests.helpers.scripted import ADD_TOOL, CHARSET, CHAT

TOK = build_char_tokenizer(CHARSET)
TOK.chat_template = CHAT
PROMPTS = PromptRenderer(TOK, format="chat")
EOS = TOK.eos_token_id
ASK = [{"role": "user", "content": "2+3?"}]


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


def _turn(prompt_ids: list[int], text: str, logprob: float) -> Rollout:
    """A sampled answer: ``text`` then EOS, each token with ``logprob``."""
    ids = [*_ids(text), EOS]
    return Rollout(list(prompt_ids), ids, [logprob] * len(ids), text)


def _glue(text: str, parent: tuple[str, int], before: Rollout) -> Continuation:
    glue = _ids(text)
    return Continuation(parent, glue, text, before.prompt_ids + before.response_ids + glue)


def test_an_episode_of_three_turns_is_published_once_as_one_experience_and_forgotten():
    rec = Recorder("run", "serve-1", group_size=0, max_recorded=100)
    first = _turn(_ids("<|user|>2+3?"), "5", -0.5)
    rec.record("r1", [first], 3, 1.0, "conv", now=0.0)
    how = _glue("<|user|>sure?", ("r1", 0), first)
    second = _turn(how.prompt_ids, "yes", -0.25)
    rec.record("r2", [second], 5, 1.0, None, now=1.0, parent=how)  # joins r1's group
    then = _glue("<|user|>why?", ("r2", 0), rec.get(("r2", 0)).rollout)
    rec.record("r3", [_turn(then.prompt_ids, "math", -0.125)], 4, 1.0, None, now=2.0, parent=then)
    assert rec.held == 3 and list(rec.groups) == ["conv"]
    assert rec.commit(3.0) == []  # no reward yet: nothing to publish
    assert rec.feedback(1.0, response_id="r1") == 1  # the first turn's reward: the episode's
    (group,) = rec.commit(4.0)
    validate_group(group)
    (exp,) = group.experiences
    policy = [[*_ids(t), EOS] for t in ("5", "yes", "math")]
    glues = [_ids("<|user|>sure?"), _ids("<|user|>why?")]
    response = policy[0] + glues[0] + policy[1] + glues[1] + policy[2]
    assert unpack_i32(exp.tokens) == _ids("<|user|>2+3?") + response
    assert exp.prompt_length == len(_ids("<|user|>2+3?"))
    assert unpack_u8(exp.action_mask) == (
        [1] * len(policy[0]) + [0] * len(glues[0]) + [1] * len(policy[1])
    ) + [0] * len(glues[1]) + [1] * len(policy[2])
    assert unpack_f32(exp.logprobs) == (
        [-0.5] * len(policy[0]) + [0.0] * len(glues[0]) + [-0.25] * len(policy[1])
    ) + [0.0] * len(glues[1]) + [-0.125] * len(policy[2])
    assert exp.model_version == group.model_version == 3  # the oldest turn's version
    assert exp.info["turns"] == 3.0
    assert exp.info["response_length"] == sum(map(len, policy))
    assert exp.info["episode_length"] == len(response)
    assert rec.held == 0 and rec.held_tokens == 0 and not rec.groups and not rec.group_of


def test_two_continuations_of_one_turn_are_two_episodes_and_expiry_takes_the_whole_tree():
    rec = Recorder("run", "serve-1", group_size=0, max_recorded=100)
    first = _turn(_ids("<|user|>2+3?"), "5", -0.5)
    rec.record("r1", [first], 0, 1.0, "conv", now=0.0)
    how = _glue("<|user|>sure?", ("r1", 0), first)
    both = [_turn(how.prompt_ids, "yes", -0.25), _turn(how.prompt_ids, "no", -0.75)]
    rec.record("r2", both, 0, 1.0, "conv", now=1.0, parent=how)  # n=2: two branches
    assert rec.feedback(0.5, conversation="conv") == 2  # the two episodes
    (group,) = rec.commit(2.0, conversation="conv")
    assert [e.response_text for e in group.experiences] == ["5<|user|>sure?yes", "5<|user|>sure?no"]
    assert all(
        unpack_i32(e.tokens)[: len(how.prompt_ids)] == how.prompt_ids for e in group.experiences
    )
    assert rec.held == 0 and not rec.groups

    rec.record("r3", [first], 0, 1.0, "c2", now=10.0)
    rec.record(
        "r4",
        [_turn(how.prompt_ids, "yes", -0.25)],
        0,
        1.0,
        None,
        now=10.0,
        parent=_glue("<|user|>sure?", ("r3", 0), first),
    )
    assert rec.held == 2 and rec.ready(now=10.0 + 3600, timeout_s=0, ttl_s=3600) == []
    assert rec.held == 0 and rec.held_tokens == 0 and not rec.groups
    assert rec.expired == 1  # the episode (its continued first turn went with it)


def _render(tools: list | None = None, prompts: PromptRenderer = PROMPTS, choice=None):
    offered = [msgspec.convert(t, ToolDef) for t in tools or []]
    return lambda messages, gen: prompt_text(prompts, messages, offered, choice, gen)


CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def _first(
    rec: Recorder,
    response_id: str,
    text: str,
    conversation: str | None,
    render=None,
    calls: list | None = None,
) -> Rollout:
    """Record the answer ``text`` to :data:`ASK` as the API does (``calls``: the calls it
    was read as, its content then empty)."""
    prompt = (render or _render())(ASK, True)
    rollout = _turn(PROMPTS.tokenize(prompt), text, -0.5)
    said = answer("", calls) if calls else answer(text, [])
    rec.record(
        response_id, [rollout], 0, 1.0, conversation, 0.0, answers=[said], digest=digest(prompt)
    )
    return rollout


def _find(episodes: Episodes, rec: Recorder, messages, render=None, previous=None, conv=None):
    """:meth:`Episodes.find` as the chat route calls it, the outcome counted."""
    render = render or _render()
    found = episodes.find(rec, messages, render, render(messages, True), previous, conv)
    episodes.count(found)
    return found.continuation


REPLY = [{"role": "assistant", "content": "5"}, {"role": "user", "content": "sure?"}]


def test_a_continuation_appends_the_templates_glue_to_the_recorded_ids():
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(PROMPTS)
    first = _first(rec, "chatcmpl-01", "5", "conv")
    then = [*ASK, *REPLY]
    found = _find(episodes, rec, then, conv="conv")
    assert found is not None and found.parent == ("chatcmpl-01", 0)
    # the policy closed its turn with EOS: the glue is the rest of the template's closing
    # ("\n") and the new user turn up to the generation prompt
    assert found.glue_text == "\n<|user|>sure?</s>\n<|assistant|>"
    assert found.prompt_ids == first.prompt_ids + first.response_ids + _ids(found.glue_text)
    assert TOK.decode(found.prompt_ids) == _render()(then, True)  # here, what rendering gives
    assert _find(episodes, rec, then, previous="chatcmpl-01").parent == found.parent
    assert episodes.stats == {"continued": 2}


def test_a_turn_is_found_by_its_tool_call_ids_within_its_conversation():
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(PROMPTS)
    response_id, tools = "chatcmpl-00ff", [ADD_TOOL]
    _first(rec, response_id, CALL_TEXT, None, _render(tools), [("add", CALL["arguments"])])
    call_id = tool_call_id(response_id, 0, 0)
    assert called_in(call_id) == (response_id, 0) and called_in("call_xyz") is None

    def then(call: dict) -> list[dict]:
        sent = {"id": call_id, "type": "function", "function": call}
        return [
            *ASK,
            {"role": "assistant", "content": "", "tool_calls": [sent]},
            {"role": "tool", "tool_call_id": call_id, "content": "5"},
        ]

    found = _find(episodes, rec, then(CALL), _render(tools))
    assert found is not None and found.parent == (response_id, 0)
    assert found.glue_text.endswith("<|user|><tool_response>5</tool_response></s>\n<|assistant|>")
    # the arguments edited (a guardrail rewrote them): not the answer the server gave
    edited = {"name": "add", "arguments": {"a": 2, "b": 4}}
    assert _find(episodes, rec, then(edited), _render(tools)) is None
    # the call's id names a response of another conversation (the request names its own)
    assert _find(episodes, rec, then(CALL), _render(tools), conv="elsewhere") is None
    assert episodes.stats == {"continued": 1, "rewritten": 1, "unmatched": 1}


def test_a_rewritten_history_other_tools_or_an_unstable_template_get_no_match():
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(PROMPTS)
    _first(rec, "chatcmpl-01", "5", "conv")
    assert _find(episodes, rec, ASK, conv="conv") is None  # a first turn
    assert episodes.stats == {}
    # an answer it never gave; no conversation to look in
    wrong = [*ASK, {"role": "assistant", "content": "6"}, REPLY[1]]
    assert _find(episodes, rec, wrong, conv="conv") is None
    assert _find(episodes, rec, [*ASK, *REPLY]) is None
    assert episodes.stats == {"unmatched": 2}
    # the question before the answer was edited; the prompt renders other tools
    edited = [{"role": "user", "content": "2+3? (summarised)"}, *REPLY]
    assert _find(episodes, rec, edited, conv="conv") is None
    assert _find(episodes, rec, [*ASK, *REPLY], _render([ADD_TOOL]), conv="conv") is None
    assert episodes.stats == {"unmatched": 2, "rewritten": 2}

    hides = build_char_tokenizer(CHARSET)  # earlier answers hidden once a turn follows
    hides.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    unstable = PromptRenderer(hides, format="chat")
    other = Episodes(unstable)
    assert _find(other, rec, [*ASK, *REPLY], _render(None, unstable), conv="conv") is None
    refuses = build_char_tokenizer(CHARSET)  # a conversation may not end with the assistant
    refuses.chat_template = (
        "{% if messages[-1]['role'] == 'assistant' and not add_generation_prompt %}"
        "{{ raise_exception('ends with the assistant') }}{% endif %}" + CHAT
    )
    strict = PromptRenderer(refuses, format="chat")
    third = Episodes(strict)
    assert _find(third, rec, [*ASK, *REPLY], _render(None, strict), conv="conv") is None
    assert other.stats == third.stats == {"rewritten": 1}  # served, recorded on its own


def test_another_tool_choice_renders_another_prompt_before_the_turn():
    """The compact format asks for a call under ``required``: a turn answered so, continued
    under ``auto``, was not sampled from the prompt the request renders."""
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(PROMPTS)
    response_id, tools = "chatcmpl-0a", [ADD_TOOL]
    required = _render(tools, choice="required")
    _first(rec, response_id, CALL_TEXT, "c", required, [("add", CALL["arguments"])])
    call_id = tool_call_id(response_id, 0, 0)
    sent = {"id": call_id, "type": "function", "function": CALL}
    then = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [sent]},
        {"role": "tool", "tool_call_id": call_id, "content": "5"},
    ]
    assert _find(episodes, rec, then, _render(tools, choice="auto"), conv="c") is None
    assert _find(episodes, rec, then, required, conv="c") is not None
    assert episodes.stats == {"rewritten": 1, "continued": 1}


def test_a_reward_given_before_a_turn_is_continued_goes_to_the_episode():
    rec = Recorder("run", "s", 0, 100)
    first = _turn(_ids("<|user|>2+3?"), "5", -0.5)
    rec.record("r1", [first], 0, 1.0, "conv", now=0.0)
    assert rec.feedback(0.75, response_id="r1") == 1
    how = _glue("<|user|>sure?", ("r1", 0), first)
    rec.record("r2", [_turn(how.prompt_ids, "yes", -0.25)], 0, 1.0, None, now=1.0, parent=how)
    (group,) = rec.commit(2.0)
    assert [(e.reward, e.info["turns"]) for e in group.experiences] == [(0.75, 2.0)]
    assert rec.held == 0


@pytest.mark.parametrize("text", ["", "plain"])
def test_raw_format_continues_after_a_blank_line(text):
    raw = PromptRenderer(TOK, format="raw")
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(raw)
    prompt = _render(None, raw)(ASK, True)
    rollout = _turn(raw.tokenize(prompt), "5" + text, -0.5)
    said = answer("5" + text, [])
    rec.record("r1", [rollout], 0, 1.0, "conv", 0.0, answers=[said], digest=digest(prompt))
    then = [
        *ASK,
        {"role": "assistant", "content": "5" + text},
        {"role": "user", "content": "sure?"},
    ]
    found = _find(episodes, rec, then, _render(None, raw), conv="conv")
    assert found is not None and found.glue_text == "\n\nsure?"
