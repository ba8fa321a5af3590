"""Rollout engines behind one interface, chosen by ``explorer.engine``.

An engine is a factory ``(model, tokenizer) -> RolloutEngine`` registered in
:data:`ENGINES`; adding one is a module here and a line in that dict. The transformers
engine is the CPU path (and works on a GPU); vLLM is an optional GPU engine (not part of
this build: selecting it raises an ImportError that says what to do).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.producers.engines.transformers_engine import TransformersEngine
from streamrft.producers.engines.vllm_engine import make_vllm_engine
from streamrft.schemas.errors import ConfigError

EngineFactory = Callable[[torch.nn.Module, object], RolloutEngine]
"""``(model, tokenizer) -> engine``."""

ENGINES: dict[str, EngineFactory] = {
    "transformers": TransformersEngine,
    "vllm": make_vllm_engine,
}
"""``explorer.engine`` name -> factory."""

__all__ = [
    "ENGINES",
    "EngineFactory",
    "Rollout",
    "RolloutEngine",
    "TransformersEngine",
    "check_engine",
    "make_engine",
]


def check_engine(name: str) -> EngineFactory:
    """The factory registered as ``name``; a :class:`ConfigError` naming the known ones if none."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigError(
            f"explorer.engine: unknown engine {name!r}; known: {', '.join(ENGINES)}"
        ) from None


def make_engine(name: str, model: torch.nn.Module, tokenizer) -> RolloutEngine:
    """The engine ``explorer.engine`` names, around ``model``."""
    return check_engine(name)(model, tokenizer)
