"""Agent functions for the ``agent`` workflow tests: plain code that talks to an OpenAI
endpoint, as an application's agent would (``explorer.agent: tests.helpers.agents:NAME``)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai

TRANSCRIPTS: dict[str, list] = {}
"""Episode base URL -> the completions the two-turn agent got (for the tests to compare)."""
_LOCK = threading.Lock()


_BASE = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="unused", max_retries=0)
"""One client, its connection pool shared: making a client costs ~40 ms (its TLS context),
a copy with another base URL ~0.1 ms."""


def _client(base_url: str) -> openai.OpenAI:
    return _BASE.with_options(base_url=base_url)


def addition_agent(task, base_url: str, model: str):
    """One completion of the task's prompt; None: ``explorer.reward`` scores it."""
    _client(base_url).completions.create(model=model, prompt=task.prompt, max_tokens=4)
    return None


def two_turn_agent(task, base_url: str, model: str):
    """Ask, then ask again with the first answer in the conversation; reward 1 when the
    first answer is right, with an info number."""
    client = _client(base_url)
    messages = [{"role": "user", "content": task.prompt}]
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=3, logprobs=True
    )
    answer = first.choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "sure?"}]
    second = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, logprobs=True
    )
    with _LOCK:
        TRANSCRIPTS[base_url] = [first, second]
    return (1.0 if answer.strip() == task.answer else 0.0), {"turns": 2.0}


def failing_agent(task, base_url: str, model: str):
    """Asks once, then fails: its episode is dropped."""
    _client(base_url).completions.create(model=model, prompt=task.prompt, max_tokens=2)
    raise RuntimeError("the agent's own bug")


def badly_rewarding_agent(task, base_url: str, model: str):
    """Asks once, then returns something that is no reward: its episode is dropped."""
    _client(base_url).completions.create(model=model, prompt=task.prompt, max_tokens=2)
    return "not a number"


def flaky_agent(task, base_url: str, model: str):
    """Fails every time on a task whose ``metadata["fail"]`` is ``always``, the first time
    only on one with ``once``; else one completion, reward 1."""
    with _LOCK:
        seen = TRANSCRIPTS.setdefault(f"flaky:{task.id}", [])
        seen.append(base_url)
        tries = len(seen)
    mode = task.metadata.get("fail")
    if mode == "always" or (mode == "once" and tries == 1):
        raise RuntimeError(f"tool broke on {task.id}")
    _client(base_url).completions.create(model=model, prompt=task.prompt, max_tokens=2)
    return 1.0


def no_limit_agent(task, base_url: str, model: str):
    """Names no ``max_tokens``: the explorer's ``max_new_tokens`` applies."""
    out = _client(base_url).completions.create(model=model, prompt=task.prompt)
    with _LOCK:
        TRANSCRIPTS[base_url] = [out]
    return 0.0


_HTTP, _ASYNC_HTTP = httpx.Client(timeout=60.0), httpx.AsyncClient(timeout=60.0)
"""HTTP clients for every LangGraph episode: ``ChatOpenAI`` makes its own otherwise, ~25 ms
each (a TLS context)."""


def calculator_graph(**chat_openai: Any) -> tuple[Any, list[tuple[int, int]]]:
    """LangGraph's ReAct graph (the graph of its tutorial: the model node, a ``ToolNode``,
    ``tools_condition``) with ``langchain-openai``'s ``ChatOpenAI(**chat_openai)`` and an
    ``add`` tool; and the list of the calls the tool gets."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    calls: list[tuple[int, int]] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    settings = {"api_key": "none", "max_retries": 0, "http_client": _HTTP, **chat_openai}
    llm = ChatOpenAI(http_async_client=_ASYNC_HTTP, **settings).bind_tools([add])
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [llm.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(), calls


def calculator_reward(
    task, calls: list[tuple[int, int]], answer: str | None
) -> tuple[float, dict[str, float]]:
    """The calculator agents' reward on ``task`` (``a+b=``): 0.25 for each of its two
    numbers in the agent's one call of ``add``, and 0.5 for then answering their sum
    (``answer`` None: the episode ended on a call); ``info``: ``called`` (1: the call of
    the task's numbers was made)."""
    a, b = (int(x) for x in task.prompt.rstrip("=").split("+"))
    args = calls[0] if len(calls) == 1 else (None, None)
    answered = bool(calls) and answer is not None and answer.strip() == str(a + b)
    reward = 0.25 * (args[0] == a) + 0.25 * (args[1] == b) + 0.5 * answered
    return reward, {"called": float(args == (a, b))}


def langgraph_calculator(task, base_url: str, model: str):
    """The :func:`calculator_graph` agent on ``task`` (``a+b=``), scored by
    :func:`calculator_reward`."""
    from langgraph.errors import GraphRecursionError

    graph, calls = calculator_graph(model=model, base_url=base_url)
    try:  # agent, tools, agent: the task needs no more
        out = graph.invoke({"messages": [("user", task.prompt)]}, {"recursion_limit": 4})
    except GraphRecursionError:
        return calculator_reward(task, calls, None)  # called again and again
    except openai.BadRequestError:  # a long first turn left the second no context
        return calculator_reward(task, calls, None)
    return calculator_reward(task, calls, str(out["messages"][-1].content))


def agents_sdk_calculator(task, base_url: str, model: str):
    """The OpenAI Agents SDK's agent on ``task`` (``a+b=``): a chat-completions model on an
    ``AsyncOpenAI`` client, an ``add`` tool, two model turns at most, tracing off; scored
    by :func:`calculator_reward`."""
    import asyncio

    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    async def run() -> str | None:
        # its own client, closed in this loop: an async HTTP client belongs to its loop
        async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
            llm = agents.OpenAIChatCompletionsModel(model=model, openai_client=client)
            agent = agents.Agent(name="calc", instructions="", tools=[add], model=llm)
            try:
                result = await agents.Runner.run(agent, task.prompt, max_turns=2)
            except agents.exceptions.MaxTurnsExceeded:
                return None  # called again
            except openai.BadRequestError:  # a long first turn left the second no context
                return None
            return str(result.final_output)

    return calculator_reward(task, calls, asyncio.run(run()))
