"""Agents as people write them, unchanged, against an explorer's recording endpoint (the
serve API in process): a LangGraph ReAct graph (model node, ``ToolNode``, ``tools_condition``) (``langchain-openai``'s ``ChatOpenAI`` with
``base_url``) and an OpenAI Agents SDK agent (``OpenAIChatCompletionsModel`` on an
``AsyncOpenAI`` client, tracing off: nothing leaves the machine), each with a calculator
tool, for several episodes. The engine answers a script (a Hermes tool call, then the
answer), so what is checked is the API as the frameworks use it: the call reaches the
tool with its arguments, the tool's result reaches the model's next prompt, the final
answer reaches the agent, and each episode is recorded as one experience whose mask is 1
exactly on the policy's tokens (checked token by token)."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines.base import Rollout
from streamrft.producers.serving.endpoint import RecordingEndpoint
from streamrft.schemas.arrays import unpack_f32, unpack_i32, unpack_u8
from tests.helpers.scripted import CHARSET, HERMES, ScriptedEngine

pytestmark = pytest.mark.integration

langgraph_prebuilt = pytest.importorskip("langgraph.prebuilt", reason="the agents extra")
langchain_openai = pytest.importorskip("langchain_openai", reason="the agents extra")
agents_sdk = pytest.importorskip("agents", reason="the agents extra (openai-agents)")

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "The sum is 5."
EPISODES = 3


class PerEpisode(ScriptedEngine):
    """The script restarts for each new prompt that holds no tool result: every episode
    calls the tool once, then answers."""

    def rollout(self, prompts, n, temperature, max_new_tokens, seed, **truncation):
        self.calls.append([list(p) for p in prompts])
        said = self.tokenizer.decode(prompts[0])
        text = ANSWER if ("<|tool|>" in said or "tool_response" in said) else CALL
        ids = [*self.ids(text), self.tokenizer.eos_token_id][:max_new_tokens]
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        logps = self.logprobs(0, len(ids))
        return [[Rollout(list(p), list(ids), logps, decoded) for _ in range(n)] for p in prompts]


@pytest.fixture
def endpoint():
    tok = build_char_tokenizer(CHARSET)
    tok.chat_template = HERMES
    engine = PerEpisode(tok, [])
    ep = RecordingEndpoint(engine, PromptRenderer(tok, format="chat"), "agents-run", "explorer-0")
    ep.start()
    ep.prepare(version=2, temperature=1.0, max_tokens=80)
    yield ep
    ep.stop()


def _check_episode(ep, episode: str, seen: list) -> None:
    """The tool ran with the model's arguments, and the episode was recorded as one
    experience: the call then the answer, each as sampled (mask 1, their log-probs), and
    between them the tool's result as the template renders it (mask 0, log-prob 0.0)."""
    assert seen == [(2.0, 3.0)]
    (e,) = ep.collect(episode, 1.0)
    assert (e.model_version, e.reward, e.info["turns"]) == (2, 1.0, 2.0)
    tok = ep.engine.tokenizer
    call = [*tok(CALL, add_special_tokens=False).input_ids, tok.eos_token_id]
    answer = [*tok(ANSWER, add_special_tokens=False).input_ids, tok.eos_token_id]
    response = unpack_i32(e.tokens)[e.prompt_length :]
    glue = response[len(call) : len(response) - len(answer)]
    assert response == call + glue + answer
    assert tok.decode(glue) == "\n<|tool|>5.0</s>\n<|assistant|>"  # after the call's EOS
    assert unpack_u8(e.action_mask) == [1] * len(call) + [0] * len(glue) + [1] * len(answer)
    logprobs = ScriptedEngine.logprobs(0, len(call)) + [0.0] * len(glue)
    logprobs += ScriptedEngine.logprobs(0, len(answer))
    assert unpack_f32(e.logprobs) == pytest.approx(logprobs)
    assert e.info["response_length"] == len(call) + len(answer)
    assert tok.decode(unpack_i32(e.tokens)[: e.prompt_length]).endswith("2+3?</s>\n<|assistant|>")


def _langgraph_episode(endpoint, episode: str) -> tuple[list, list]:
    """One episode of a LangGraph ReAct agent; its messages and the tool's calls."""
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph

    seen: list[tuple[float, float]] = []

    @tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        seen.append((a, b))
        return a + b

    model = langchain_openai.ChatOpenAI(
        model="policy", base_url=endpoint.base_url(episode), api_key="unused", max_retries=0
    ).bind_tools([add])

    def agent(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)  # the graph of LangGraph's ReAct tutorial
    graph.add_node("agent", agent)
    graph.add_node("tools", langgraph_prebuilt.ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", langgraph_prebuilt.tools_condition)
    graph.add_edge("tools", "agent")
    out = graph.compile().invoke({"messages": [("user", "2+3?")]})
    return out["messages"], seen


def test_a_langgraph_agent_calls_the_tool_and_answers(endpoint):
    for k in range(EPISODES):
        episode = f"langgraph-{k}"
        messages, seen = _langgraph_episode(endpoint, episode)
        assert messages[-1].content == ANSWER
        assert [m.type for m in messages] == ["human", "ai", "tool", "ai"]
        assert messages[1].tool_calls[0]["name"] == "add"
        assert messages[2].content == "5.0"
        last_prompt = endpoint.engine.tokenizer.decode(endpoint.engine.calls[-1][0])
        assert last_prompt.endswith("<|tool|>5.0</s>\n<|assistant|>")  # the result, rendered
        _check_episode(endpoint, episode, seen)


def test_an_openai_agents_sdk_agent_calls_the_tool_and_answers(endpoint):
    from openai import AsyncOpenAI

    agents_sdk.set_tracing_disabled(True)

    async def episode_run(episode: str, seen: list) -> str:
        @agents_sdk.function_tool
        def add(a: float, b: float) -> float:
            """Add two numbers."""
            seen.append((a, b))
            return a + b

        client = AsyncOpenAI(base_url=endpoint.base_url(episode), api_key="unused", max_retries=0)
        model = agents_sdk.OpenAIChatCompletionsModel(model="policy", openai_client=client)
        agent = agents_sdk.Agent(
            name="calc", instructions="Use the tool.", tools=[add], model=model
        )
        result = await agents_sdk.Runner.run(agent, "2+3?")
        return result.final_output

    for k in range(EPISODES):
        seen: list[tuple[float, float]] = []
        episode = f"agents-sdk-{k}"
        assert asyncio.run(episode_run(episode, seen)) == ANSWER
        _check_episode(endpoint, episode, seen)
