"""A rollout engine without a model that answers a script, and chat templates with and
without tools: for the tests of multi-turn workflows and of tool calls on the chat API."""

from __future__ import annotations

import torch

from streamrft.infra.modeling import DEFAULT_CHARSET
from streamrft.producers.engines.base import Rollout

CHARSET = DEFAULT_CHARSET + "<>|\n_{}\"'"
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A template that closes every turn with the EOS and a newline, as ChatML's ``<|im_end|>``."""
HERMES = (
    "{% if tools %}<|system|>tools:{% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}{{ eos_token }}\n{% endif %}" + CHAT
)
"""A template that takes ``tools`` (Qwen-style templates list them in the system turn)."""


class ScriptedEngine:
    """Our RolloutEngine protocol without a model: turn ``t`` of every episode answers
    ``script[t]`` (the last one for later turns) then EOS, with log-probs that tell the
    turn and position apart; records the prompts of every call."""

    def __init__(self, tokenizer, script: list[str], max_positions: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.model = torch.nn.Linear(1, 1)
        if max_positions is not None:
            self.model.config = type("C", (), {"max_position_embeddings": max_positions})()
        self.calls: list[list[list[int]]] = []

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def rollout(self, prompts, n, temperature, max_new_tokens, seed, **truncation):
        turn = len(self.calls)
        self.calls.append([list(p) for p in prompts])
        text = self.script[min(turn, len(self.script) - 1)]
        ids = ([*self.ids(text), self.tokenizer.eos_token_id])[:max_new_tokens]
        out = []
        for p in prompts:
            logps = self.logprobs(turn, len(ids))
            decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append([Rollout(list(p), list(ids), logps, decoded) for _ in range(n)])
        return out

    @staticmethod
    def logprobs(turn: int, n: int) -> list[float]:
        return [-0.25 * (turn + 1) - 0.01 * k for k in range(n)]


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        },
    },
}
"""A calculator tool as an OpenAI request offers it."""
