"""The calculator agent's model: a tiny Llama whose charset holds the tool-call JSON and a
chat template that lists the tools (:data:`~tests.helpers.scripted.HERMES`), warm-started
by SFT on demonstration episodes played through the same LangGraph agent and recording
endpoint as the policy's own (so they carry its tokens and masks). For the learning test
and for the runs that serve it."""

from __future__ import annotations

import copy
import json
import random

import torch

from streamrft.consumers.train_engine import TorchTrainEngine
from streamrft.infra.config import TasksetConfig
from streamrft.infra.taskset import read_taskset
from streamrft.producers.engines.base import Rollout
from streamrft.producers.rewards import exact_match
from streamrft.producers.workflows import RolloutSpec, get_workflow
from tests.helpers.learning import ADDITION, learning_config
from tests.helpers.scripted import CHARSET, HERMES

AGENT = "tests.helpers.agents:langgraph_calculator"
MODEL = {
    "charset": CHARSET,
    "max_positions": 160,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_layers": 2,
}
"""The JSON and template characters; room for the call, the result and the answer."""
MAX_NEW_TOKENS = 72
"""The call is 63 tokens with its EOS."""


class Demonstrator:
    """Our RolloutEngine protocol playing the demonstrations: after the user's ``a+b=``,
    the call of ``add`` with ``a`` and ``b``; after the tool's result, that result."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.model = torch.nn.Linear(1, 1)
        self.model.config = type("Config", (), {"max_position_embeddings": 160})()

    def rollout(self, prompts, n, temperature, max_new_tokens, seed, **truncation):
        out = []
        for ids in prompts:
            last = self.tokenizer.decode(ids).rsplit("<|", 2)[-2]  # the last message
            role, _, content = last.partition("|>")
            content = content.removesuffix("</s>\n")
            if role == "user":
                a, b = content.rstrip("=").split("+")
                call = {"name": "add", "arguments": {"a": int(a), "b": int(b)}}
                reply = f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"
            else:
                reply = content  # the tool's result
            reply_ids = [
                *self.tokenizer(reply, add_special_tokens=False).input_ids,
                self.tokenizer.eos_token_id,
            ]
            out.append([Rollout(list(ids), reply_ids, [0.0] * len(reply_ids), reply)] * n)
        return out


def agent_spec(seed: int, step: int, repeat_times: int, concurrency: int) -> RolloutSpec:
    """The ``agent`` workflow's settings for the calculator agent at ``step``."""
    return RolloutSpec(
        repeat_times=repeat_times,
        temperature=1.0,
        max_new_tokens=MAX_NEW_TOKENS,
        seed=1000 * seed + step,
        run="learn",
        explorer="explorer-0",
        model_version=step,
        agent=AGENT,
        agent_concurrency=concurrency,
    )


def calculator_engine(algorithm: dict, seed: int, trainer: dict | None = None) -> TorchTrainEngine:
    """A train engine of the calculator model (:data:`MODEL`, the template set)."""
    torch.manual_seed(seed)
    engine = TorchTrainEngine(learning_config(algorithm, seed, trainer, MODEL))
    engine.tokenizer.chat_template = HERMES
    return engine


def calculator_warm_start(seed: int, steps: int) -> TorchTrainEngine:
    """The calculator model after ``steps`` SFT steps (lr 3e-3) on the demonstration
    episodes of the 100 addition tasks, 32 a step."""
    engine = calculator_engine({"type": "sft"}, seed, {"lr": 3e-3, "ppo_epochs": 1})
    engine.prepare()
    tasks = read_taskset(ADDITION, TasksetConfig())
    demo = Demonstrator(engine.tokenizer)
    demos = get_workflow("agent")(demo, tasks, exact_match, agent_spec(seed, 0, 1, 32))
    assert len(demos) == len(tasks) and all(g.experiences[0].reward == 1.0 for g in demos)
    rng = random.Random(seed)
    for step in range(steps):
        engine.train_step(rng.sample(demos, 32), step)
    return engine


def calculator_state(seed: int, steps: int) -> dict[str, torch.Tensor]:
    """The weights of :func:`calculator_warm_start`."""
    return copy.deepcopy(calculator_warm_start(seed, steps).model.state_dict())
