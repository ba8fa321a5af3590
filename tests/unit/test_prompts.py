"""Prompt rendering: chat template or raw text, one BOS, the same tokens for explorer,
evaluator and SFT warm-up."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from streamrft.consumers.warmup import sft_batch
from streamrft.infra.config import ModelConfig, TasksetConfig, from_dict
from streamrft.infra.modeling import DEFAULT_CHARSET, build_char_tokenizer, build_tiny_model
from streamrft.infra.prompts import PromptRenderer, chat_messages, raw_text, uses_chat
from streamrft.producers.engines import SimulatedEngine, TransformersEngine
from streamrft.producers.evaluation import greedy_accuracy
from streamrft.producers.rewards import exact_match
from streamrft.producers.workflows import RolloutSpec, math_workflow
from streamrft.schemas import TASK, ChatMessage, ConfigError, SchemaError, Task, unpack_i32

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

CHARSET = DEFAULT_CHARSET + "<>|\n"
WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A template that starts with the BOS, as Llama's and Mistral's do."""
NO_BOS = WITH_BOS.removeprefix("{{ bos_token }}")
"""A template without it, as Qwen's and SmolLM2's."""

PLAIN = Task(id="p", prompt="3+5=", answer="8")
CHAT = Task(
    id="c",
    answer="8",
    messages=[ChatMessage(role="user", content="what is 3+5?")],
)
OWN_SYSTEM = Task(
    id="s",
    answer="8",
    messages=[
        ChatMessage(role="system", content="be short"),
        ChatMessage(role="user", content="3+5?"),
    ],
)


def chat_tokenizer(template: str = WITH_BOS):
    tokenizer = build_char_tokenizer(CHARSET)
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def raw_tok():
    return build_char_tokenizer(CHARSET)


@pytest.fixture(scope="module")
def chat_tok():
    return chat_tokenizer()


def tiny_model(tokenizer):
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4)
    return build_tiny_model(cfg, tokenizer).eval()


# -- messages and raw text -------------------------------------------------------------------


def test_a_prompt_task_is_one_user_message_and_the_system_prompt_comes_first():
    assert chat_messages(PLAIN) == [{"role": "user", "content": "3+5="}]
    assert chat_messages(CHAT, "think") == [
        {"role": "system", "content": "think"},
        {"role": "user", "content": "what is 3+5?"},
    ]
    # a task that brings its own system message keeps it, and gets no second one
    assert chat_messages(OWN_SYSTEM, "think") == [
        {"role": "system", "content": "be short"},
        {"role": "user", "content": "3+5?"},
    ]


def test_raw_text_is_the_prompt_exactly_unless_asked_for_more():
    assert raw_text(PLAIN) == "3+5="
    assert raw_text(PLAIN, "think") == "think\n\n3+5="
    assert raw_text(CHAT) == "what is 3+5?"
    assert raw_text(OWN_SYSTEM, "think") == "be short\n\n3+5?"


# -- format ----------------------------------------------------------------------------------


def test_auto_is_chat_only_with_a_template(raw_tok, chat_tok):
    assert uses_chat("auto", chat_tok) and uses_chat("chat", chat_tok)
    assert not uses_chat("raw", chat_tok)
    assert not uses_chat("auto", raw_tok) and not uses_chat("raw", raw_tok)


def test_chat_without_a_template_is_a_config_error_naming_the_field(raw_tok):
    with pytest.raises(ConfigError, match=r"^taskset\.format: 'chat' needs a tokenizer with"):
        PromptRenderer(raw_tok, "chat")
    with pytest.raises(ConfigError, match=r"^taskset\.format"):
        PromptRenderer.from_config(TasksetConfig(format="chat"), raw_tok)


def test_config_fields_and_their_bounds():
    cfg = from_dict({"taskset": {"path": "t.jsonl", "format": "chat", "system_prompt": "hi"}})
    assert (cfg.taskset.format, cfg.taskset.system_prompt) == ("chat", "hi")
    assert TasksetConfig().format == "auto" and TasksetConfig().system_prompt is None
    with pytest.raises(ConfigError, match=r"^taskset\.format"):
        from_dict({"taskset": {"path": "t.jsonl", "format": "jinja"}})


# -- rendering and the BOS -------------------------------------------------------------------


def test_raw_rendering_is_what_the_engines_tokenized_before(raw_tok):
    render = PromptRenderer(raw_tok)
    assert not render.chat
    assert render.text(PLAIN) == "3+5="
    assert render.ids(PLAIN) == raw_tok("3+5=", add_special_tokens=True).input_ids
    assert render.ids(PLAIN)[0] == raw_tok.bos_token_id


def test_chat_rendering_applies_the_template_with_the_generation_prompt(chat_tok):
    render = PromptRenderer(chat_tok, "auto", system_prompt="be brief")
    assert render.chat
    assert render.text(CHAT) == "<s><|system|>be brief\n<|user|>what is 3+5?\n<|assistant|>"
    assert render.text(CHAT) == chat_tok.apply_chat_template(
        chat_messages(CHAT, "be brief"), tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("template", [WITH_BOS, NO_BOS])
def test_a_chat_prompt_holds_exactly_the_special_tokens_of_its_template(template):
    tokenizer = chat_tokenizer(template)
    ids = PromptRenderer(tokenizer).ids(PLAIN)
    bos = tokenizer.bos_token_id
    # the template's BOS once, or none when the template has none; never the tokenizer's too
    assert ids.count(bos) == (1 if template == WITH_BOS else 0)
    if template == WITH_BOS:
        assert ids[0] == bos and ids[1] != bos
    # the same ids as transformers' own tokenizing path of the template
    tokenized = tokenizer.apply_chat_template(
        chat_messages(PLAIN), tokenize=True, add_generation_prompt=True
    )
    assert ids == list(tokenized["input_ids"])
    # the pitfall: tokenizing the templated string with special tokens doubles the BOS
    doubled = tokenizer(PromptRenderer(tokenizer).text(PLAIN), add_special_tokens=True).input_ids
    if template == WITH_BOS:
        assert doubled[:2] == [bos, bos]


# -- engines, workflow, evaluator and warm-up take the renderer's ids ------------------------


def test_the_transformers_engine_samples_from_the_ids_it_is_given(chat_tok):
    render = PromptRenderer(chat_tok)
    engine = TransformersEngine(tiny_model(chat_tok), chat_tok)
    prompts = render.batch([PLAIN, CHAT])
    assert len(prompts[0]) != len(prompts[1])  # left padding is exercised
    groups = engine.rollout(prompts, n=2, temperature=1.0, max_new_tokens=3, seed=0)
    for ids, group in zip(prompts, groups, strict=True):
        assert all(r.prompt_ids == ids for r in group)
    assert len(engine.greedy(prompts, 3)) == 2


def test_the_math_workflow_records_the_rendered_prompt(chat_tok):
    render = PromptRenderer(chat_tok, system_prompt="be brief")
    engine = SimulatedEngine(torch.nn.Linear(1, 1), chat_tok)
    spec = RolloutSpec(
        repeat_times=2,
        temperature=1.0,
        max_new_tokens=3,
        seed=0,
        run="r",
        explorer="explorer-0",
        model_version=0,
        prompts=render,
    )
    groups = math_workflow(engine, [PLAIN, CHAT], exact_match, spec)
    for task, group in zip([PLAIN, CHAT], groups, strict=True):
        for exp in group.experiences:
            assert unpack_i32(exp.tokens)[: exp.prompt_length] == render.ids(task)
    # without a renderer the spec falls back to the defaults around the engine's tokenizer
    groups = math_workflow(engine, [PLAIN], exact_match, dataclasses.replace(spec, prompts=None))
    exp = groups[0].experiences[0]
    assert unpack_i32(exp.tokens)[: exp.prompt_length] == PromptRenderer(chat_tok).ids(PLAIN)


class Recorder(SimulatedEngine):
    """A simulated engine that keeps the prompts ``greedy`` was given."""

    def greedy(self, prompts, max_new_tokens):
        self.seen = prompts
        return super().greedy(prompts, max_new_tokens)


def test_the_evaluator_and_the_warm_up_render_as_the_explorer_does(chat_tok):
    render = PromptRenderer(chat_tok, system_prompt="be brief")
    engine = Recorder(torch.nn.Linear(1, 1), chat_tok)
    greedy_accuracy(engine, [PLAIN, CHAT], exact_match, 3, prompts=render)
    assert engine.seen == render.batch([PLAIN, CHAT])
    ids, attn, mask = sft_batch(chat_tok, [PLAIN, CHAT], render)
    for row, task in enumerate([PLAIN, CHAT]):
        prompt = render.ids(task)
        answer = [*chat_tok("8", add_special_tokens=False).input_ids, chat_tok.eos_token_id]
        width = len(prompt) + len(answer)
        assert ids[row, :width].tolist() == prompt + answer
        assert mask[row, :width].tolist() == [0.0] * len(prompt) + [1.0] * len(answer)
        assert attn[row].sum() == width


def test_the_raw_warm_up_rows_are_unchanged(raw_tok):
    ids, _, _ = sft_batch(raw_tok, [PLAIN])
    prompt = raw_tok("3+5=").input_ids  # BOS and the characters, as before
    answer = raw_tok("8", add_special_tokens=False).input_ids
    assert ids[0].tolist() == [*prompt, *answer, raw_tok.eos_token_id]


# -- the wire --------------------------------------------------------------------------------


def test_a_chat_task_travels_and_an_old_reader_still_decodes_it():
    back = TASK.decode(TASK.encode(OWN_SYSTEM), TASK.headers())
    assert back == OWN_SYSTEM and back.messages[1].content == "3+5?"

    class OldTask(msgspec.Struct, kw_only=True):  # before messages: prompt required
        id: str
        prompt: str
        answer: str = ""

    assert msgspec.msgpack.decode(TASK.encode(CHAT), type=OldTask) == OldTask(
        id="c", prompt="", answer="8"
    )
    # a message without a role is refused by the codec, naming the task
    bad = msgspec.msgpack.encode(
        {"id": "t", "messages": [{"role": "", "content": "x"}]},
    )
    with pytest.raises(SchemaError, match=r"task 't': messages\[0\]\.role is empty"):
        TASK.decode(bad)
