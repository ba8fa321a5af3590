"""Accelerator memory a run's processes need, estimated from the model's shape: arithmetic
only, no I/O (``streamrft plan`` reads the config and the model's files and prints it).

What is counted, in bytes (``b``: bytes per value of ``model.dtype``; ``N``: parameters;
``T``: tokens in one micro-batch; ``L`` layers of width ``H``, MLP width ``I``, key/value
width ``K`` (heads x head size); ``V`` vocabulary):

- **trainer**: float32 master weights ``4N`` (the trainer keeps float32 whatever it
  computes in), gradients ``4n`` and AdamW's two moments ``8n`` of the ``n`` trainable
  parameters (all, or the LoRA adapter's), each divided over the FSDP2 ranks; a frozen
  reference copy in ``b`` (``bN``) when a KL term or DPO needs one without LoRA (with LoRA
  the base with the adapter off serves); PPO's critic, a whole model trained (``16N``) with
  the policy's activations again but no logits. Activations of one micro-batch (split over
  the ranks): ``b T (6H + 2K + 4I)`` a layer (what a decoder layer with
  SDPA attention keeps for backward: the normed inputs, q/k/v, the attention output, the
  MLP's gate, up and product), all layers without gradient checkpointing, one layer's plus
  ``b T H`` a layer (the inputs kept) with it; and the logits: ``T V (b + 4 + 4)`` (the
  logits, their float32 log-softmax and its gradient).
- **explorer, transformers engine**: weights ``bN``; the KV cache of all ``S`` rows sampled
  together (``explorer.batch_size x repeat_times``) over prompt and response,
  ``2 L K b S (P + R)``; the last position's logits, ``8 S V``.
- **explorer, vLLM**: the share ``explorer.gpu_memory_utilization`` of the device, which
  vLLM takes whole (weights and KV cache inside it).
- **what an explorer or evaluator keeps to receive versions** (:func:`receive_memory`), each
  a version, ``bN``, and with LoRA the adapter beside its base, ``bN + 4n``: its staging copy
  (``synchronizer.staging``, a version received before its apply) on the device with
  ``device``, in host memory with ``host`` (pinned on a GPU box), nothing with ``none``; a
  version read from the trainer's GPU (``cuda_ipc``, the device path) is staged on the
  device whatever ``staging`` says but ``none``, which keeps the receiver's own buffer on
  the device instead; a shared-memory receive with ``device`` staging keeps a pinned host
  buffer of its own. A vLLM engine's torch mirror, which versions are received into, is in
  host memory, and so is its staging copy; its device path keeps the receiver's buffer on
  the device.
- **the trainer's device-path slots** (``synchronizer.method: auto`` or ``cuda_ipc``, the
  trainer on a GPU, not LoRA): two versions, ``2bN``, on the GPU of its first rank.

Not counted: the CUDA context and allocator slack (a few hundred MB a process), temporary
buffers of individual kernels, the trainer's snapshots of a version and shared memory's
two files (``2bN`` of host memory on the trainer's host). An estimate to choose sizes with,
not a guarantee.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamrft.schemas.errors import ConfigError

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_BYTES = 8
"""AdamW's two float32 moments per trainable parameter."""
MASTER_BYTES = GRAD_BYTES = 4
"""The trainer's float32 weights and gradients."""


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a decoder model."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    """Key (or value) width: key/value heads x head size."""
    vocab: int
    q_width: int = 0
    """Query (and attention output) width: heads x head size; 0: ``hidden``."""

    @property
    def query(self) -> int:
        return self.q_width or self.hidden


@dataclass(frozen=True)
class Workload:
    """What one step of the run asks of the processes."""

    dtype_bytes: int
    trainable: int
    """Parameters the trainer updates (all, or the adapter's)."""
    micro_batch_tokens: int
    prompt_tokens: int
    response_tokens: int
    rows_sampled: int
    """Sequences an explorer samples together."""
    ranks: int = 1
    reference: bool = False
    critic: bool = False


@dataclass
class Estimate:
    """One process's parts, in bytes (activations both ways: with checkpointing and not)."""

    role: str
    parts: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    """Host memory beside the device's (a staging copy in host memory): not in :attr:`total`."""
    activations: int = 0
    activations_checkpointed: int = 0
    checkpointing: bool = False

    @property
    def total(self) -> int:
        used = self.activations_checkpointed if self.checkpointing else self.activations
        return sum(self.parts.values()) + used


def layer_activations(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """Bytes one decoder layer keeps for backward over ``tokens`` tokens."""
    width = 6 * shape.hidden + 2 * shape.kv_width + 4 * shape.intermediate
    return dtype_bytes * tokens * width


def trainer_estimate(shape: ModelShape, work: Workload, checkpointing: bool) -> Estimate:
    """The memory of one trainer rank (``work.micro_batch_tokens`` are split over the ranks,
    as the FSDP2 engine splits each micro-batch)."""
    b, ranks = work.dtype_bytes, work.ranks
    parts = {
        "weights": MASTER_BYTES * shape.params // ranks,
        "gradients": GRAD_BYTES * work.trainable // ranks,
        "optimizer": ADAM_BYTES * work.trainable // ranks,
    }
    if work.reference:
        parts["reference"] = b * shape.params // ranks
    if work.critic:  # PPO's value model: all of it trained, a value head in place of logits
        parts["critic"] = (MASTER_BYTES + GRAD_BYTES + ADAM_BYTES) * shape.params // ranks
    tokens = -(-work.micro_batch_tokens // ranks)
    layer = layer_activations(shape, tokens, b)
    kept = shape.layers * b * tokens * shape.hidden  # the layer inputs checkpointing keeps
    logits = tokens * shape.vocab * (b + 4 + 4)
    models = 2 if work.critic else 1
    return Estimate(
        role="trainer",
        parts=parts,
        activations=models * shape.layers * layer + logits,
        activations_checkpointed=models * (layer + kept) + logits,
        checkpointing=checkpointing,
    )


def explorer_estimate(shape: ModelShape, work: Workload, role: str = "explorer") -> Estimate:
    """The memory of one explorer (or evaluator: ``role``) running the transformers engine."""
    b, rows = work.dtype_bytes, work.rows_sampled
    length = work.prompt_tokens + work.response_tokens
    return Estimate(
        role=role,
        parts={
            "weights": b * shape.params,
            "kv_cache": 2 * shape.layers * shape.kv_width * b * rows * length,
            "logits": 8 * rows * shape.vocab,
        },
    )


def staging_bytes(shape: ModelShape, work: Workload, lora: bool) -> int:
    """The staging copy of one explorer: a version in ``model.dtype``, and with LoRA an
    adapter (float32) beside its base."""
    return work.dtype_bytes * shape.params + (4 * work.trainable if lora else 0)


def receive_memory(
    version: int, staging: str, on_gpu: bool, vllm: bool, device_path: bool, shared: bool
) -> tuple[dict[str, int], dict[str, int]]:
    """What an explorer (or evaluator) keeps to receive versions of ``version`` bytes, as
    (parts on its device, parts in host memory beside it): see the module. ``staging``:
    ``synchronizer.staging``; ``on_gpu``: the process is on a GPU; ``vllm``: its engine is
    vLLM; ``device_path``: versions come from the trainer's GPU (``cuda_ipc``); ``shared``:
    versions may come through shared memory (``shared``, ``auto``)."""
    staged = staging != "none"
    if not on_gpu:  # host memory is the device's
        return ({"staging": version} if staged else {}), {}
    device: dict[str, int] = {}
    host: dict[str, int] = {}
    if vllm:  # the torch mirror versions are received into, and its staging, are host memory
        host["mirror"] = version
        if staged:
            host["staging"] = version
        if device_path:  # the receiver's copy of the trainer's slot, on the GPU
            device["ipc_buffer"] = version
        return device, host
    if not staged:
        if device_path:
            device["ipc_buffer"] = version
        return device, host
    if staging == "device" or device_path:
        device["staging"] = version
    if staging == "device" and shared:  # the file is read into pinned host memory first
        host["shm_buffer"] = version
    elif staging == "host" and (shared or not device_path):  # the other versions (pinned)
        host["staging"] = version
    return device, host


def vllm_estimate(utilization: float, device_bytes: int | None, role: str = "explorer") -> Estimate:
    """vLLM's share of the device (unknown without the device's size)."""
    taken = int(utilization * device_bytes) if device_bytes else 0
    return Estimate(role=f"{role} (vllm)", parts={"vllm_share": taken})


def lora_params(shape: ModelShape, rank: int, targets: Sequence[str]) -> int:
    """Parameters of a rank-``rank`` LoRA adapter on the decoder's ``targets`` (``r (in +
    out)`` a module a layer)."""
    h, k, i, q = shape.hidden, shape.kv_width, shape.intermediate, shape.query
    widths = {
        "q_proj": (h, q),
        "k_proj": (h, k),
        "v_proj": (h, k),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    unknown = [t for t in targets if t not in widths]
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules: the planner knows {', '.join(widths)}, not "
            f"{', '.join(unknown)}"
        )
    return shape.layers * sum(rank * sum(widths[t]) for t in targets)


def llama_shape(
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    tied: bool,
    head_dim: int | None = None,
) -> ModelShape:
    """The shape, parameters counted, of a Llama-style decoder (RMSNorm, gated MLP);
    ``head_dim``: the head size where it is not ``hidden / heads`` (Qwen3, Gemma)."""
    head = head_dim or hidden // heads
    kv, q = kv_heads * head, heads * head
    per_layer = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden
    params = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
    return ModelShape(params, layers, hidden, intermediate, kv, vocab, q if q != hidden else 0)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_size(text: str) -> int:
    """``80GiB``, ``80 GB``, ``81920MiB`` or a number of bytes, as bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"--device-memory: {text!r} is not a size such as 80GiB or 80GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
