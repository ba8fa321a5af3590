"""Agents written with LangGraph and the OpenAI Agents SDK, unchanged, train a model in a
real run: against a ``streamrft serve`` process (rewards through ``/feedback``) and each as
a run's ``explorer.agent`` (rewards from the function's return), each on the session's
broker and store with a real trainer process; the trainer trains every episode published,
once (the books balance), and each episode is one experience whose mask is 1 exactly on the
model's own tokens.

The model: the calculator model of ``tests/helpers/calculator.py`` (a tiny Llama whose
charset holds the tool-call JSON, its chat template listing the tools), after a short SFT
warm-up, so that it answers with ``<tool_call>`` blocks, written as a Hugging Face folder
that both processes load (``model.source: path``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from streamrft.infra.config import load_config, with_run_id
from streamrft.infra.modeling import save_policy
from streamrft.schemas.arrays import unpack_f32, unpack_i32
from tests.helpers.calculator import MAX_NEW_TOKENS, calculator_warm_start
from tests.helpers.cli import env, overrides, run_argv, run_ok, service_overrides, streamrft_cmd
from tests.helpers.paths import EXAMPLE
from tests.helpers.processes import wait_for
from tests.helpers.topics import groups_and_trainer_metrics

pytestmark = pytest.mark.e2e
pytest.importorskip("langgraph.prebuilt", reason="the agents extra")
agents_sdk = pytest.importorskip("agents", reason="the agents extra (openai-agents)")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def calculator_model(tmp_path_factory) -> Path:
    """The calculator model after 150 SFT steps: it answers with calls, not always of the
    task's numbers."""
    engine = calculator_warm_start(0, 150)
    return save_policy(engine.model, engine.tokenizer, tmp_path_factory.mktemp("calc") / "model")


def _settings(model: Path, runs: Path, *more: str) -> list[str]:
    return [
        f"run.dir={runs}",
        "model.source=path",
        f"model.path={model}",
        f"explorer.max_new_tokens={MAX_NEW_TOKENS}",
        "trainer.warmup_sft_steps=0",
        "trainer.save_interval=0",
        "eval.interval=0",
        *more,
    ]


def _mask_runs(exp) -> list[tuple[int, int]]:
    """The experience's response as (mask, length) runs."""
    runs: list[tuple[int, int]] = []
    for m in exp.action_mask:
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1] + 1)
        else:
            runs.append((m, 1))
    return runs


def _check_episode(exp, tokenizer) -> None:
    """One experience of an episode: its policy turns (mask 1) and, between two, the tool's
    result as the template renders it (mask 0, log-prob 0.0)."""
    runs = _mask_runs(exp)
    assert [m for m, _ in runs] == [1, 0, 1][: len(runs)] and len(runs) in (1, 3)
    assert exp.info["turns"] == (len(runs) + 1) // 2
    logprobs = unpack_f32(exp.logprobs)
    response = unpack_i32(exp.tokens)[exp.prompt_length :]
    if len(runs) == 3:
        start, length = runs[0][1], runs[1][1]
        assert logprobs[start : start + length] == [0.0] * length
        glue = tokenizer.decode(response[start : start + length])
        # a turn the policy ended holds its EOS; one cut at max_new_tokens is closed by the
        # template (serve batches requests as they come, so which turns are cut varies)
        ended = response[start - 1] == tokenizer.eos_token_id
        opening = "\n<|tool|>" if ended else "</s>\n<|tool|>"
        assert glue.startswith(opening) and glue.endswith("</s>\n<|assistant|>"), glue
    assert all(lp < 0 for lp, m in zip(logprobs, exp.action_mask, strict=True) if m)


def _server_url(runs: Path, run_id: str, proc) -> str:
    folder = runs / run_id / "serve"
    wait_for(lambda: folder.is_dir() and any(folder.glob("*.json")), proc, 180, "serve to start")
    return json.loads(next(folder.glob("*.json")).read_text())["url"]


def _get(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


class Requests:
    """Counts an episode's chat requests (an ``httpx`` event hook)."""

    def __init__(self) -> None:
        self.sent = 0

    def hook(self, request) -> None:
        self.sent += request.url.path.endswith("/chat/completions")

    async def async_hook(self, request) -> None:
        self.hook(request)


def _langgraph_episode(url: str, model: str, conversation: str, a: int, b: int) -> tuple:
    """One LangGraph episode; (its requests, its last response id and reward, or None when
    it called again past the graph's limit: left unrewarded, never published)."""
    from langgraph.errors import GraphRecursionError

    from tests.helpers.agents import calculator_graph

    counted = Requests()
    graph, _ = calculator_graph(
        model=model,
        base_url=f"{url}/v1",
        seed=a,
        default_headers={"X-Conversation-Id": conversation},
        http_client=httpx.Client(event_hooks={"request": [counted.hook]}),
    )
    try:
        out = graph.invoke({"messages": [("user", f"{a}+{b}=")]}, {"recursion_limit": 4})
    except GraphRecursionError:
        return counted.sent, None
    last = out["messages"][-1]
    reward = float(str(last.content).strip() == str(a + b))
    return counted.sent, (last.response_metadata["id"], reward)


def _sdk_episode(url: str, model: str, conversation: str, prompt: str) -> int:
    """One Agents SDK episode (its tool: add, two turns at most); its requests."""
    from openai import AsyncOpenAI

    agents_sdk.set_tracing_disabled(True)
    counted = Requests()

    @agents_sdk.function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    async def run() -> None:
        client = AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key="none",
            max_retries=0,
            default_headers={"X-Conversation-Id": conversation},
            http_client=httpx.AsyncClient(event_hooks={"request": [counted.async_hook]}),
        )
        llm = agents_sdk.OpenAIChatCompletionsModel(model=model, openai_client=client)
        agent = agents_sdk.Agent(name="calc", instructions="", tools=[add], model=llm)
        try:
            await agents_sdk.Runner.run(agent, prompt, max_turns=2)
        except agents_sdk.exceptions.MaxTurnsExceeded:
            pass  # it called again: the episode ends there

    asyncio.run(run())
    return counted.sent


def test_langgraph_and_agents_sdk_against_serve_train_through_feedback(
    services, calculator_model, tmp_path
):
    run_id, runs = f"agents-serve-{os.getpid()}-{int(time.time())}", tmp_path / "runs"
    common = [*_settings(calculator_model, runs), "trainer.max_steps=1"]
    argv = lambda cmd, *extra: streamrft_cmd(  # noqa: E731
        cmd, str(EXAMPLE), "--run-id", run_id, *overrides(*common),
        *service_overrides(services), *extra,
    )  # fmt: skip
    server = None
    try:
        with (tmp_path / "s.log").open("w") as log:
            server = subprocess.Popen(
                argv("serve", "--port", "0", "-o", "serve.serve_initial=true"),
                env=env(), stdout=log, stderr=log, cwd=tmp_path,
            )  # fmt: skip
        url = _server_url(runs, run_id, server)
        wait_for(lambda: _get(f"{url}/health")["model_version"] >= 0, server, 180, "version 0")

        # LangGraph: two tasks, two episodes each under the task's conversation id (one
        # GRPO group per task), each rewarded through its last response's id
        requests, rewarded = [], []
        for task, (a, b) in (("t1", (2, 3)), ("t2", (4, 1))):
            for k in range(2):
                sent, last = _langgraph_episode(url, run_id, f"lg-{task}", a + k, b)
                requests.append(sent)
                if last is not None:
                    rid, reward = last
                    fb = _post(f"{url}/feedback", {"response_id": rid, "reward": reward})
                    assert fb == {"rewarded": 1}
                    rewarded.append(sent)
        # the Agents SDK: two episodes, each its own conversation, rewarded by it
        for k, prompt in enumerate(("3+3=", "1+5=")):
            requests.append(_sdk_episode(url, run_id, f"sdk-{k}", prompt))
            assert _post(f"{url}/feedback", {"conversation_id": f"sdk-{k}", "reward": 0.5}) == {
                "rewarded": 1
            }
            rewarded.append(requests[-1])
        assert sum(requests) > len(requests)  # some episodes called the tool
        health = _get(f"{url}/health")
        assert health["episodes"]["unmatched"] == health["episodes"]["rewritten"] == 0
        assert health["episodes"]["continued"] == sum(requests) - len(requests)
        committed = _post(f"{url}/commit", {})
        assert committed["published_experiences"] == len(rewarded)  # one an episode
        # the trainer trains them: one step of every published group
        train = argv("train", "-o", f"trainer.batch_size={committed['published_groups']}")
        with (tmp_path / "t.log").open("w") as log:
            trainer = subprocess.run(
                train, env=env(), stdout=log, stderr=log, cwd=tmp_path, timeout=300
            )
        assert trainer.returncode == 0, (tmp_path / "t.log").read_text()[-3000:]
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)

    cfg = load_config(EXAMPLE, [f"run.dir={runs}", *service_overrides_kv(services)])
    groups, metrics = groups_and_trainer_metrics(with_run_id(cfg, run_id))
    assert sorted(g.id for g in groups) == sorted(committed["group_ids"])
    trained = [row.group_id for m in metrics for row in m.trained]
    assert sorted(trained) == sorted(committed["group_ids"])  # the books balance: each once
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(calculator_model)
    turns = sorted(e.info["turns"] for g in groups for e in g.experiences)
    assert turns == sorted(rewarded)  # each episode: all its requests, one experience
    for g in groups:
        for exp in g.experiences:
            _check_episode(exp, tokenizer)


def service_overrides_kv(services) -> list[str]:
    """:func:`service_overrides` as ``KEY=VALUE`` settings."""
    args = service_overrides(services)
    return [args[i + 1] for i in range(0, len(args), 2)]


@pytest.mark.parametrize("agent", ["langgraph_calculator", "agents_sdk_calculator"])
def test_an_agent_as_a_runs_explorer_agent_trains_and_the_books_balance(
    agent, services, calculator_model, tmp_path, monkeypatch
):
    run_id, runs = f"agents-run-{os.getpid()}-{int(time.time())}", tmp_path / "runs"
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the explorer imports the agent from tests/
    steps = 2
    settings = _settings(
        calculator_model,
        runs,
        "taskset.workflow=agent",
        f"explorer.agent=tests.helpers.agents:{agent}",
        "explorer.batch_size=4",
        "explorer.repeat_times=4",
        "explorer.agent_concurrency=16",
        "trainer.batch_size=4",
    )
    run_ok(run_argv(EXAMPLE, run_id, steps, runs, services, *settings[1:], explorers=1), tmp_path)
    cfg = load_config(EXAMPLE, [*settings[:1], *service_overrides_kv(services)])
    groups, metrics = groups_and_trainer_metrics(with_run_id(cfg, run_id))
    ledger = {m.step: [row.group_id for row in m.trained] for m in metrics if m.trained}
    assert sorted(ledger) == [1, 2]
    by_id = {g.id: g for g in groups}
    for step, ids in ledger.items():
        assert len(ids) == len(set(ids)) == 4, step  # each group of its batch, once
        assert {by_id[i].batch for i in ids} == {step - 1}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(calculator_model)
    trained = [by_id[i] for ids in ledger.values() for i in ids]
    log = (runs / run_id / "logs" / "explorer-0.log").read_text()
    dropped = [line for line in log.splitlines() if "agent episode" in line]
    assert all(g.workflow == "agent" and len(g.experiences) == 4 for g in trained), dropped
    for g in trained:
        for exp in g.experiences:
            _check_episode(exp, tokenizer)
            assert 0.0 <= exp.reward <= 1.0 and exp.info["called"] in (0.0, 1.0)
    assert any(e.info["turns"] == 2 for g in trained for e in g.experiences)  # calls were made
