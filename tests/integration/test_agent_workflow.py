"""The ``agent`` workflow: plain agent code with the official ``openai`` client, talking to
the explorer's own recording endpoint (a real HTTP server in process), becomes experiences;
and the tiny model learns addition through it."""

from __future__ import annotations

import pytest
import torch

from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import load_policy
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.rewards import exact_match
from streamrft.producers.serving.endpoint import recording_endpoint
from streamrft.producers.workflows import RolloutSpec, get_workflow
from streamrft.schemas.arrays import unpack_f32, unpack_i32
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task, validate_group
from tests.helpers import agents
from tests.helpers.learning import learn

pytestmark = pytest.mark.integration

TASKS = [Task(id=f"t{i}", prompt=f"{i}+1=", answer=str(i + 1), workflow="agent") for i in range(3)]


def _engine() -> TransformersEngine:
    torch.manual_seed(0)
    model, tokenizer = load_policy(ModelConfig(max_positions=64), dtype=torch.float32)
    return TransformersEngine(model.eval(), tokenizer)


def _spec(agent: str, repeat: int = 2, record: str = "episode") -> RolloutSpec:
    return RolloutSpec(
        repeat_times=repeat,
        temperature=1.0,
        max_new_tokens=4,
        seed=0,
        run="agents",
        explorer="explorer-0",
        model_version=3,
        agent=f"tests.helpers.agents:{agent}",
        agent_record=record,
    )


def _sent(transcript: list) -> list[list[float]]:
    """The log-probs the agent got with each completion of its episode."""
    return [[t.logprob for t in c.choices[0].logprobs.content] for c in transcript]


def _take_episode(logprobs: list[float], episodes: list[list[list[float]]]) -> list:
    """Remove and return the episode (its two turns' log-probs, as the agent got them)
    this experience holds: both turns at its ends. Two episodes of one task can begin with
    the same token, so its first log-prob alone does not tell them apart."""
    for i, (first, second) in enumerate(episodes):
        tail = len(logprobs) - len(second)
        if (
            tail >= len(first)
            and logprobs[: len(first)] == pytest.approx(first, abs=1e-6)
            and logprobs[tail:] == pytest.approx(second, abs=1e-6)
        ):
            return episodes.pop(i)
    raise AssertionError(f"no episode left whose log-probs this experience holds: {logprobs}")


def test_an_episode_is_one_experience_its_answers_trained_and_the_rest_masked():
    engine = _engine()
    agents.TRANSCRIPTS.clear()
    groups = get_workflow("agent")(engine, TASKS, exact_match, _spec("two_turn_agent"))
    assert [g.task_id for g in groups] == ["t0", "t1", "t2"]
    assert len(agents.TRANSCRIPTS) == 6  # 3 tasks x 2 episodes, each its own base URL
    episodes = [_sent(t) for t in agents.TRANSCRIPTS.values()]
    tok = engine.tokenizer
    for group in groups:
        validate_group(group)
        assert group.model_version == 3 and group.workflow == "agent"
        assert len(group.experiences) == 2  # the task's 2 episodes, one experience each
        task = next(t for t in TASKS if t.id == group.task_id)
        for exp in group.experiences:
            assert exp.model_version == 3 and exp.info["turns"] == 2.0
            first, second = _take_episode(unpack_f32(exp.logprobs), episodes)
            mask = list(exp.action_mask)
            glue = len(mask) - len(first) - len(second)
            # raw format: the user's next turn after a blank line, never trained
            assert mask == [1] * len(first) + [0] * glue + [1] * len(second)
            expected = first + [0.0] * glue + second
            assert unpack_f32(exp.logprobs) == pytest.approx(expected, abs=1e-6)
            response = unpack_i32(exp.tokens)[exp.prompt_length :]
            inserted = tok("\n\nsure?", add_special_tokens=False).input_ids
            assert response[len(first) : len(first) + glue] == inserted
            prompt = unpack_i32(exp.tokens)[: exp.prompt_length]
            assert tok.decode(prompt, skip_special_tokens=True) == task.prompt
            answer = tok.decode(response[: len(first)], skip_special_tokens=True)
            assert exp.reward == float(answer.strip() == task.answer)
    assert episodes == []  # every episode the agents ran is one experience


def test_per_completion_recording_makes_each_completion_an_experience():
    engine = _engine()
    agents.TRANSCRIPTS.clear()
    spec = _spec("two_turn_agent", record="completion")
    groups = get_workflow("agent")(engine, TASKS, exact_match, spec)
    assert [g.task_id for g in groups] == ["t0", "t1", "t2"]
    sent = [s for t in agents.TRANSCRIPTS.values() for s in _sent(t)]
    tok = engine.tokenizer
    for group in groups:
        validate_group(group)
        assert len(group.experiences) == 4  # 2 episodes x 2 turns
        for exp in group.experiences:
            assert exp.model_version == 3 and exp.info["turns"] == 2.0
            response = unpack_i32(exp.tokens)[exp.prompt_length :]
            assert set(exp.action_mask) == {1}
            assert any(unpack_f32(exp.logprobs) == pytest.approx(s, abs=1e-6) for s in sent)
            assert tok.decode(response, skip_special_tokens=True) == exp.response_text
        # the second turn's prompt holds the whole conversation so far: the first answer
        by_episode: dict[float, list] = {}
        for exp in group.experiences:
            by_episode.setdefault(exp.info["episode"], []).append(exp)
        for first, second in by_episode.values():
            assert tok.decode(unpack_i32(second.tokens)[: second.prompt_length]).startswith(
                tok.decode(unpack_i32(first.tokens)[: first.prompt_length])
            )
            assert first.response_text in tok.decode(unpack_i32(second.tokens))
            assert first.reward == second.reward
            task = next(t for t in TASKS if t.id == group.task_id)
            assert first.reward == float(first.response_text.strip() == task.answer)


def test_a_failing_agent_drops_its_episodes_and_a_missing_agent_is_a_config_error():
    engine = _engine()
    for agent in ("failing_agent", "badly_rewarding_agent"):
        assert get_workflow("agent")(engine, TASKS[:1], exact_match, _spec(agent)) == []
        endpoint = recording_endpoint(engine, None, "agents", "explorer-0")
        assert endpoint.recorder.held == 0, agent  # nothing of the episode left behind
    with pytest.raises(ConfigError, match=r"explorer\.agent"):
        get_workflow("agent")(engine, TASKS[:1], exact_match, _spec("no_such_agent"))
    spec = RolloutSpec(**{**_spec("x").__dict__, "agent": ""})
    with pytest.raises(ConfigError, match=r"explorer\.agent"):
        get_workflow("agent")(engine, TASKS[:1], exact_match, spec)


@pytest.mark.parametrize("seed", [0])  # seed 1 (README): 0.28 -> 0.56
def test_the_tiny_model_learns_addition_through_the_agent_workflow(seed):
    learned = learn(
        {"type": "grpo"},
        steps=20,
        seed=seed,
        workflow="agent",
        agent="tests.helpers.agents:addition_agent",
    )
    print(
        f"agent seed {seed}: accuracy {learned.accuracy_before:.2f} -> "
        f"{learned.accuracy_after:.2f}, reward gain {learned.reward_gain():.3f}"
    )
    assert learned.accuracy_after >= learned.accuracy_before + 0.08
    assert learned.reward_gain() >= 0.02  # not seeded: 0.05-0.11 seen


def test_a_request_naming_no_max_tokens_gets_the_explorers_max_new_tokens():
    engine = _engine()
    agents.TRANSCRIPTS.clear()
    spec = RolloutSpec(**{**_spec("no_limit_agent").__dict__, "max_new_tokens": 3})
    groups = get_workflow("agent")(engine, TASKS, exact_match, spec)
    lengths = [e.response_length for g in groups for e in g.experiences]
    assert len(lengths) == 6 and max(lengths) <= 3
    assert max(o[0].usage.completion_tokens for o in agents.TRANSCRIPTS.values()) <= 3
