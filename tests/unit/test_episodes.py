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
from streamrft.producers.serving.episodes import Episodes, called_in, digest, tool_call_id
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


def _render(tools: list | None = None, prompts: PromptRenderer = PROMPTS):
    offered = [msgspec.convert(t, ToolDef) for t in tools or []]
    return lambda messages, gen: prompt_text(prompts, messages, offered, None, gen)


def _recorded_first(
    rec: Recorder, response_id: str, text: str, conversation: str | None, tools: list | None = None
):
    prompt = PROMPTS.tokenize(_render(tools)(ASK, True))
    rollout = _turn(prompt, text, -0.5)
    rec.record(
        response_id, [rollout], 0, 1.0, conversation, now=0.0, digest=digest(ASK, tools or [])
    )
    return rollout


def test_a_continuation_appends_the_templates_glue_to_the_recorded_ids():
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(PROMPTS)
    first = _recorded_first(rec, "chatcmpl-01", "5", "conv")
    then = [*ASK, {"role": "assistant", "content": "5"}, {"role": "user", "content": "sure?"}]
    found = episodes.find(rec, then, [], _render(), None, "conv")
    assert found is not None and found.parent == ("chatcmpl-01", 0)
    # the policy closed its turn with EOS: the glue is the rest of the template's closing
    # ("\n") and the new user turn up to the generation prompt
    assert found.glue_text == "\n<|user|>sure?</s>\n<|assistant|>"
    assert found.prompt_ids == first.prompt_ids + first.response_ids + _ids(found.glue_text)
    assert TOK.decode(found.prompt_ids) == _render()(then, True)  # here, what rendering gives
    assert episodes.find(rec, then, [], _render(), "chatcmpl-01", None).parent == found.parent
    assert episodes.stats == {"continued": 2}


def test_a_turn_is_found_by_its_tool_call_ids_without_a_conversation():
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(PROMPTS)
    response_id = "chatcmpl-00ff"
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    _recorded_first(rec, response_id, call, None, [ADD_TOOL])
    call_id = tool_call_id(response_id, 0, 0)
    assert called_in(call_id) == (response_id, 0) and called_in("call_xyz") is None
    calls = [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
        }
    ]
    then = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": call_id, "content": "5"},
    ]
    found = episodes.find(rec, then, [ADD_TOOL], _render([ADD_TOOL]), None, None)
    assert found is not None and found.parent == (response_id, 0)
    assert found.glue_text.endswith("<|user|><tool_response>5</tool_response></s>\n<|assistant|>")
    foreign = [{**calls[0], "id": "call_made_up_by_the_framework"}]
    then[1] = {"role": "assistant", "content": "", "tool_calls": foreign}
    assert episodes.find(rec, then, [ADD_TOOL], _render([ADD_TOOL]), None, None) is None
    assert episodes.stats == {"continued": 1, "unmatched": 1}


def test_a_rewritten_history_changed_tools_or_an_unstable_template_get_no_match():
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(PROMPTS)
    _recorded_first(rec, "chatcmpl-01", "5", "conv")
    reply = [{"role": "assistant", "content": "5"}, {"role": "user", "content": "sure?"}]
    assert episodes.find(rec, ASK, [], _render(), None, "conv") is None  # a first turn
    assert episodes.stats == {}
    # an answer it never gave; no conversation to look in
    wrong = [*ASK, {"role": "assistant", "content": "6"}, reply[1]]
    assert episodes.find(rec, wrong, [], _render(), None, "conv") is None
    assert episodes.find(rec, [*ASK, *reply], [], _render(), None, None) is None
    assert episodes.stats == {"unmatched": 2}
    # the question before the answer was edited; the tools are not those it answered with
    edited = [{"role": "user", "content": "2+3? (summarised)"}, *reply]
    assert episodes.find(rec, edited, [], _render(), None, "conv") is None
    assert episodes.find(rec, [*ASK, *reply], [ADD_TOOL], _render([ADD_TOOL]), None, "conv") is None
    assert episodes.stats == {"unmatched": 2, "rewritten": 2}

    hides = build_char_tokenizer(CHARSET)  # earlier answers hidden once a turn follows
    hides.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    unstable = PromptRenderer(hides, format="chat")
    other = Episodes(unstable)
    assert other.find(rec, [*ASK, *reply], [], _render(None, unstable), None, "conv") is None
    assert other.stats == {"rewritten": 1}


@pytest.mark.parametrize("text", ["", "plain"])
def test_raw_format_continues_after_a_blank_line(text):
    raw = PromptRenderer(TOK, format="raw")
    rec, episodes = Recorder("run", "s", 0, 100), Episodes(raw)
    prompt = raw.tokenize(_render(None, raw)(ASK, True))
    rollout = _turn(prompt, "5" + text, -0.5)
    rec.record("r1", [rollout], 0, 1.0, "conv", now=0.0, digest=digest(ASK, []))
    then = [
        *ASK,
        {"role": "assistant", "content": "5" + text},
        {"role": "user", "content": "sure?"},
    ]
    found = episodes.find(rec, then, [], _render(None, raw), None, "conv")
    assert found is not None and found.glue_text == "\n\nsure?"
