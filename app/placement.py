"""One GPU box: how ``streamrft run`` fits vLLM explorers and the trainer on one device.

Every process ``streamrft run`` starts places its model on ``model.device``, so on a GPU
they share it. vLLM takes a fixed share of the GPU's memory when it starts
(``explorer.gpu_memory_utilization``) and sizes its KV cache from what is free then; the
trainer's caching allocator grows as it needs. So when vLLM explorers share the GPU:

1. the shares must fit: ``explorer.count`` x ``gpu_memory_utilization`` +
   ``trainer.gpu_memory_fraction`` <= :data:`GPU_BUDGET` (the rest is CUDA contexts and
   fragmentation), and the trainer's share must be set, since an uncapped trainer would
   take what vLLM counted on;
2. the explorers start first, and the trainer once each has built its engine
   (``run.start_order``).

Pure rules here; the supervisor applies them.
"""

from __future__ import annotations

from streamrft.infra.config import Config
from streamrft.schemas.errors import ConfigError

GPU_BUDGET = 0.95
"""Share of a GPU's memory the processes may claim together."""


def vllm_shares_gpu(cfg: Config) -> bool:
    """Whether ``streamrft run`` puts vLLM explorers on the trainer's GPU (``auto`` counts
    when torch sees a GPU)."""
    if cfg.explorer.engine != "vllm" or cfg.model.device == "cpu":
        return False
    return cfg.model.device != "auto" or gpu_visible()


def gpu_visible() -> bool:
    import torch  # here, not at import: the CLI starts without torch

    return torch.cuda.is_available()


def start_order(cfg: Config) -> str:
    """``trainer_first`` or ``explorers_first``, ``run.start_order`` resolved."""
    if cfg.run.start_order != "auto":
        return cfg.run.start_order
    return "explorers_first" if vllm_shares_gpu(cfg) else "trainer_first"


def check_gpu_shares(cfg: Config) -> None:
    """A :class:`ConfigError` naming the fields when vLLM explorers and the trainer would
    not fit on their shared GPU."""
    if not vllm_shares_gpu(cfg):
        return
    e, t = cfg.explorer, cfg.trainer
    where = f"explorer.engine vllm on model.device {cfg.model.device!r}"
    if t.gpu_memory_fraction == 0:
        raise ConfigError(
            f"trainer.gpu_memory_fraction: required when vLLM explorers share the trainer's "
            f"GPU ({where}); e.g. 0.5 with explorer.gpu_memory_utilization 0.4"
        )
    total = e.count * e.gpu_memory_utilization + t.gpu_memory_fraction
    if total > GPU_BUDGET + 1e-9:
        raise ConfigError(
            f"explorer.gpu_memory_utilization: {e.count} explorer(s) x "
            f"{e.gpu_memory_utilization} + trainer.gpu_memory_fraction "
            f"{t.gpu_memory_fraction} = {total:.2f} of one GPU ({where}); keep it within "
            f"{GPU_BUDGET}"
        )
