"""Explorer extension points: engines, workflows and rewards chosen by name (or import path)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from streamrft.infra.config import ExplorerConfig, ModelConfig, from_dict
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.producers.engines import ENGINES, TransformersEngine, check_engine, make_engine
from streamrft.producers.engines.base import ends_without_eos
from streamrft.producers.engines.transformers_engine import make_transformers_engine
from streamrft.producers.rewards import REWARDS, exact_match, get_reward, last_number
from streamrft.producers.workflows import (
    WORKFLOWS,
    RolloutSpec,
    check_workflow,
    get_workflow,
    math_workflow,
)
from streamrft.schemas.arrays import unpack_i32
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task
from tests.helpers import rewards_example

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

EXAMPLE = "tests.helpers.rewards_example"
TASKS = [Task(id="a", prompt="3+5=", answer="8"), Task(id="b", prompt="12+30=", answer="42")]
EXPLORER = ExplorerConfig()
SPEC = RolloutSpec(
    repeat_times=3,
    temperature=0.9,
    max_new_tokens=5,
    seed=11,
    run="r",
    explorer="explorer-0",
    model_version=2,
    explorer_step=4,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_positions=32
    )
    return build_tiny_model(cfg, tokenizer).eval()


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return make_engine("transformers", model, tokenizer, EXPLORER)


# -- engines ---------------------------------------------------------------------------------


def test_transformers_engine_by_name(engine, model, tokenizer):
    assert isinstance(engine, TransformersEngine)
    assert engine.model is model and engine.tokenizer is tokenizer
    assert check_engine("transformers") is make_transformers_engine


def test_vllm_is_registered_and_says_what_is_missing(model, tokenizer):
    assert "vllm" in ENGINES
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: the engine itself is tested in tests/vllm")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'"):
        make_engine("vllm", model, tokenizer, EXPLORER)


def test_unknown_engine_is_a_config_error_naming_the_field_and_the_engines(model, tokenizer):
    with pytest.raises(
        ConfigError,
        match=r"^explorer\.engine: unknown engine 'tgi'; known: transformers, vllm, simulated$",
    ):
        make_engine("tgi", model, tokenizer, EXPLORER)


class Echo(TransformersEngine):
    pass


def make_echo(model, tokenizer, cfg) -> Echo:
    return Echo(model, tokenizer)


def test_registering_an_engine_is_one_line(monkeypatch, model, tokenizer):
    monkeypatch.setitem(ENGINES, "echo", f"{__name__}:make_echo")
    assert type(make_engine("echo", model, tokenizer, EXPLORER)) is Echo


def test_config_takes_any_engine_name_and_leaves_the_check_to_the_explorer():
    cfg = from_dict({"taskset": {"path": "t.jsonl"}, "explorer": {"engine": "echo"}})
    assert cfg.explorer.engine == "echo"
    with pytest.raises(ConfigError, match=r"^explorer\.engine: unknown engine 'echo'"):
        check_engine(cfg.explorer.engine)


# -- workflows -------------------------------------------------------------------------------


def test_math_workflow_by_name(engine):
    assert get_workflow("math") is math_workflow
    check_workflow("math")
    groups = get_workflow("math")(engine, TASKS, exact_match, SPEC)
    assert [g.task_id for g in groups] == ["a", "b"]
    for g in groups:
        assert (g.run, g.explorer, g.model_version, g.explorer_step) == ("r", "explorer-0", 2, 4)
        assert g.workflow == "math"
        assert len(g.experiences) == SPEC.repeat_times
        assert all(e.model_version == 2 for e in g.experiences)


def test_rollout_spec_holds_exactly_the_old_keyword_arguments():
    assert list(RolloutSpec.__dataclass_fields__) == [
        "repeat_times",
        "temperature",
        "max_new_tokens",
        "seed",
        "run",
        "explorer",
        "model_version",
        "explorer_step",
        "prompts",  # added with a default (issue 10: chat templates); old calls still work
        "agent",  # added with defaults (issue 12: the agent workflow)
        "agent_concurrency",
        "agent_record",  # added with a default (issue 32: one experience per conversation)
        "corrected",  # added with a default (issue 32: top_p, top_k)
        "refresh",  # added with a default (issue 33: partial rollouts)
    ]
    with pytest.raises(AttributeError):
        SPEC.seed = 1  # type: ignore[misc]


def test_unknown_workflow_is_a_config_error_naming_the_workflows():
    for call in (get_workflow, check_workflow):
        with pytest.raises(
            ConfigError,
            match=r"'chat' is not known .*taskset\.workflow.*known: math, expert, preference, multi_turn, tool_calling, agent$",
        ):
            call("chat")


def test_registering_a_workflow_is_one_line(monkeypatch, engine):
    def first_only(engine, tasks, reward, spec):
        return math_workflow(engine, tasks[:1], reward, spec)

    monkeypatch.setitem(WORKFLOWS, "first_only", first_only)
    check_workflow("first_only")
    groups = get_workflow("first_only")(engine, TASKS, exact_match, SPEC)
    assert [g.task_id for g in groups] == ["a"]


# -- rewards ---------------------------------------------------------------------------------


def test_registered_rewards():
    assert get_reward("exact_match") is exact_match
    assert get_reward("last_number") is last_number
    assert list(REWARDS) == [
        "exact_match",
        "last_number",
        "math_answer",
        "format",
        "math_answer_format",
    ]


def test_unknown_reward_names_the_field_the_rewards_and_the_import_form():
    with pytest.raises(
        ConfigError,
        match=r"^explorer\.reward: unknown reward 'nope'; known: exact_match, last_number, "
        r"math_answer, format, math_answer_format, judge, code_tests, or a function as "
        r"'package\.module:function'$",
    ):
        get_reward("nope")


def response_ids(e) -> list[int]:
    return unpack_i32(e.tokens)[e.prompt_length :]


def test_reward_by_import_path(engine):
    fn = get_reward(f"{EXAMPLE}:short_answer")
    assert fn is rewards_example.short_answer
    cfg = from_dict(
        {"taskset": {"path": "t.jsonl"}, "explorer": {"reward": f"{EXAMPLE}:short_answer"}}
    )
    groups = get_workflow("math")(engine, TASKS, get_reward(cfg.explorer.reward), SPEC)
    for g, task in zip(groups, TASKS, strict=True):
        for e in g.experiences:
            short = float(len(e.response_text.strip()) <= len(task.answer))
            assert e.reward == short
            assert e.info == {
                "short": short,
                "chars": float(len(e.response_text)),
                "response_length": e.response_length,
                "truncated": float(
                    ends_without_eos(response_ids(e), engine.tokenizer.eos_token_id)
                ),
            }


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "tests.helpers.no_such_rewards:f",
            r"^explorer\.reward: cannot import module 'tests\.helpers\.no_such_rewards' of "
            r"'tests\.helpers\.no_such_rewards:f': No module named",
        ),
        (
            f"{EXAMPLE}:missing",
            r"^explorer\.reward: module 'tests\.helpers\.rewards_example' has no attribute "
            r"'missing'$",
        ),
        (
            f"{EXAMPLE}:NOT_A_FUNCTION",
            r"^explorer\.reward: '.*:NOT_A_FUNCTION' is a int, not a function \(response_text, "
            r"task\)",
        ),
        (
            f"{EXAMPLE}:one_argument",
            r"^explorer\.reward: '.*:one_argument' cannot be called as \(response_text, task\): ",
        ),
        (":short_answer", r"^explorer\.reward: ':short_answer' is not of the form"),
        (f"{EXAMPLE}:", r"is not of the form 'package\.module:function'$"),
        (f"{EXAMPLE}:a:b", r"is not of the form"),
        ("tests/helpers/rewards_example.py:short_answer", r"is not of the form"),
    ],
)
def test_bad_reward_paths_are_config_errors(path, message):
    with pytest.raises(ConfigError, match=message):
        get_reward(path)
