"""The vLLM engine (GPU): registered by name, not built yet.

Selecting it says what is missing: vLLM itself (an ImportError with the install line), or,
with vLLM installed, this engine (NotImplementedError).
"""

from __future__ import annotations

import torch

from streamrft.infra.config import ExplorerConfig
from streamrft.producers.engines.base import RolloutEngine


def make_vllm_engine(model: torch.nn.Module, tokenizer, cfg: ExplorerConfig) -> RolloutEngine:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "explorer.engine 'vllm' needs vLLM and a GPU: pip install 'streamrft[vllm]'"
        ) from exc
    raise NotImplementedError("the vLLM engine is not built yet; use explorer.engine: transformers")
