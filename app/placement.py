"""Where ``streamrft run``'s processes go, and how vLLM explorers and the trainer fit on
one device.

Every process places its model on its role's device: ``trainer.device``,
``explorer.device`` or ``explorer.devices[i]``, else ``model.device`` (:func:`placement`).
Where explorers share the trainer's GPU: vLLM takes a fixed share of the GPU's memory when it starts
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

import os

from streamrft.infra.config import Config, role_device, role_engine
from streamrft.schemas.errors import ConfigError

GPU_BUDGET = 0.95
"""Share of a GPU's memory the processes may claim together."""


def placement(cfg: Config) -> list[tuple[str, str, str]]:
    """``(role, device, the field that chose it)`` of the trainer, the explorers and the
    evaluators ``streamrft run`` starts (explorers on one device listed together)."""
    t = cfg.trainer
    if t.devices:
        rows = [(f"trainer ranks 0-{t.nproc - 1}", ",".join(t.devices), "trainer.devices")]
    else:
        rows = [("trainer", *role_device(cfg, "trainer"))]
    explorers: dict[tuple[str, str], list[int]] = {}
    for i in range(cfg.explorer.count):
        explorers.setdefault(role_device(cfg, "explorer", i), []).append(i)
    for (device, field), indexes in explorers.items():
        rows.append((f"explorer {','.join(map(str, indexes))}", device, field))
    if cfg.eval.count:
        numbers = ",".join(map(str, range(cfg.eval.count)))
        rows.append((f"evaluator {numbers}", *role_device(cfg, "evaluator")))
    return rows


def physical_device(spec: str) -> str:
    """The device ``spec`` resolves to, one spelling per device: ``cuda`` is ``cuda:0``,
    ``auto`` the first GPU where torch sees one, else ``cpu``."""
    if spec == "auto":
        spec = "cuda" if gpu_visible() else "cpu"
    return f"{spec}:0" if spec == "cuda" else spec


def _gpu(spec: str) -> str | None:
    """The GPU ``spec`` resolves to, None for the CPU."""
    device = physical_device(spec)
    return None if device == "cpu" else device


def explorers_on_trainer_gpu(cfg: Config) -> int:
    """How many of ``streamrft run``'s vLLM engines share the trainer's GPU: its explorers'
    and its evaluators' (an evaluator samples with the explorer's engine)."""
    trainer = {_gpu(d) for d in cfg.trainer.devices} or {_gpu(role_device(cfg, "trainer")[0])}
    trainer.discard(None)
    return sum(1 for d in vllm_devices(cfg) if _gpu(d) in trainer)


def engine_gpus(cfg: Config, role: str) -> int:
    """GPUs one process of ``role`` samples on: ``explorer.tensor_parallel_size`` for a
    vLLM explorer or evaluator, else 1."""
    vllm = role in ("explorer", "evaluator") and role_engine(cfg, role) == "vllm"
    return cfg.explorer.tensor_parallel_size if vllm else 1


def span(device: str, count: int) -> list[str]:
    """The devices an engine on ``device`` spanning ``count`` GPUs uses: ``cuda:k`` to
    ``cuda:k+count-1`` (``cuda`` is ``cuda:0``); ``device`` itself when ``count`` is 1."""
    if count == 1 or not device.startswith("cuda"):
        return [device]
    first = int(device.split(":")[1]) if ":" in device else 0
    return [f"cuda:{first + r}" for r in range(count)]


def vllm_devices(cfg: Config) -> list[str]:
    """The GPU (or CPU) of each vLLM engine ``streamrft run`` starts, one entry per GPU a
    tensor-parallel engine spans: explorers' and evaluators' (``eval.engine``, else the
    explorers' engine)."""
    devices = []
    if cfg.explorer.engine == "vllm":
        tp = engine_gpus(cfg, "explorer")
        for i in range(cfg.explorer.count):
            devices += span(role_device(cfg, "explorer", i)[0], tp)
    if role_engine(cfg, "evaluator") == "vllm":
        tp = engine_gpus(cfg, "evaluator")
        devices += span(role_device(cfg, "evaluator")[0], tp) * cfg.eval.count
    return devices


def vllm_shares_gpu(cfg: Config) -> bool:
    """Whether ``streamrft run`` puts vLLM explorers on the trainer's GPU (``auto`` counts
    when torch sees a GPU)."""
    return explorers_on_trainer_gpu(cfg) > 0


def visible_gpus(indexes: list[int], field: str) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that shows a child (or this process) the GPUs
    ``cuda:i`` for each of ``indexes``, counted among the GPUs this process sees; a
    :class:`ConfigError` naming ``field`` for one it does not see."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [n.strip() for n in seen.split(",") if n.strip()] if seen is not None else None
    for i in indexes:
        if names is not None and i >= len(names):
            raise ConfigError(
                f"{field}: 'cuda:{i}' but only {len(names)} GPU(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={seen!r})"
            )
    return ",".join(names[i] if names is not None else str(i) for i in indexes)


def gpu_visible() -> bool:
    import torch  # here, not at import: the CLI starts without torch

    return torch.cuda.is_available()


def start_order(cfg: Config) -> str:
    """``trainer_first`` or ``explorers_first``, ``run.start_order`` resolved."""
    if cfg.run.start_order != "auto":
        return cfg.run.start_order
    return "explorers_first" if vllm_shares_gpu(cfg) else "trainer_first"


def check_gpu_shares(cfg: Config) -> None:
    """A :class:`ConfigError` naming the fields when vLLM engines (explorers, evaluators)
    would not fit together on one GPU, or beside the trainer on its GPU."""
    e = cfg.explorer
    counts: dict[str, int] = {}
    for device in vllm_devices(cfg):
        gpu = _gpu(device)
        if gpu is not None:
            counts[gpu] = counts.get(gpu, 0) + 1
    for gpu, n in counts.items():
        if n * e.gpu_memory_utilization > GPU_BUDGET + 1e-9:
            raise ConfigError(
                f"explorer.gpu_memory_utilization: {n} vLLM engines (explorers, evaluators) "
                f"on {gpu} x {e.gpu_memory_utilization} = {n * e.gpu_memory_utilization:.2f} "
                f"of one GPU; keep it within {GPU_BUDGET} (or eval.engine: transformers)"
            )
    shared = explorers_on_trainer_gpu(cfg)
    if not shared:
        return
    t = cfg.trainer
    where = f"vLLM engines on the trainer's device {role_device(cfg, 'trainer')[0]!r}"
    if t.gpu_memory_fraction == 0:
        raise ConfigError(
            f"trainer.gpu_memory_fraction: required when vLLM explorers or evaluators share the trainer's "
            f"GPU ({where}); e.g. 0.5 with explorer.gpu_memory_utilization 0.4"
        )
    total = shared * e.gpu_memory_utilization + t.gpu_memory_fraction
    if total > GPU_BUDGET + 1e-9:
        raise ConfigError(
            f"explorer.gpu_memory_utilization: {shared} vLLM engine(s) (explorers, evaluators) x "
            f"{e.gpu_memory_utilization} + trainer.gpu_memory_fraction "
            f"{t.gpu_memory_fraction} = {total:.2f} of one GPU ({where}); keep it within "
            f"{GPU_BUDGET}"
        )
