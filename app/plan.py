"""``streamrft plan CONFIG [--device-memory 80GiB]``: the accelerator memory each process of
a run needs, estimated before anything starts (the arithmetic: :mod:`infra.memory_plan`).

The model's shape comes from the config (the tiny model) or from the model folder's
``config.json`` and the headers of its safetensors files (the exact parameter count; no
weight is read). Processes are placed as ``streamrft run`` places them: the trainer's
rank r of ``trainer.nproc`` on ``cuda:r`` under FSDP2 (on several hosts, ``trainer.nnodes``,
node 0's ranks, each with its share of a micro-batch among all the hosts' ranks), else on
its role's device, each
explorer and evaluator on its own (``app/placement.py``); each device's total is compared with ``--device-memory``
(else the size of the GPU torch sees, where there is one).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrft.app.model_shapes import KNOWN_MODELS, known_name, shape_of_config
from streamrft.app.placement import check_gpu_shares, engine_gpus, physical_device, span
from streamrft.infra.config import Config, ModelConfig, role_device, role_engine
from streamrft.infra.memory_plan import (
    DTYPE_BYTES,
    GIB,
    Estimate,
    ModelShape,
    Workload,
    explorer_estimate,
    llama_shape,
    lora_params,
    receive_memory,
    staging_bytes,
    trainer_estimate,
    vllm_estimate,
)
from streamrft.schemas.errors import ConfigError

DEFAULT_PROMPT_TOKENS = 512
"""Prompt length assumed when ``taskset.max_prompt_tokens`` is 0 and none is given."""
SPECIAL_TOKENS = 4
"""The tiny model's tokenizer: pad, BOS, EOS and unknown before its characters
(``infra.modeling.build_char_tokenizer``)."""
COLUMNS = (
    "weights",
    "gradients",
    "optimizer",
    "reference",
    "critic",
    "kv_cache",
    "logits",
    "vllm_share",
    "staging",
    "ipc_buffer",
    "ipc_slots",
)


@dataclass
class Plan:
    shape: ModelShape
    work: Workload
    processes: list[tuple[str, str, Estimate]]
    """(name, device, estimate)."""
    device_bytes: int | None
    trainer_share: float = 0.0
    """``trainer.gpu_memory_fraction``: the trainer's cap on its GPU (0: none)."""
    shares_refused: str | None = None
    """Why ``streamrft run`` would refuse the vLLM engines' shares of their GPUs
    (``app.placement.check_gpu_shares``), whatever the byte counts say; None: it would not."""
    model_source: str = ""
    """Where the model's shape was read (:func:`shape_and_source`)."""

    def by_device(self) -> dict[str, int]:
        """Each device's total (``cuda`` and ``cuda:0`` are one)."""
        totals: dict[str, int] = {}
        for _, device, est in self.processes:
            key = physical_device(device)
            totals[key] = totals.get(key, 0) + est.total
        return totals

    def trainer_over_cap(self) -> bool:
        """Whether a trainer rank needs more than ``trainer.gpu_memory_fraction`` of its GPU."""
        if not (self.trainer_share and self.device_bytes):
            return False
        cap = self.trainer_share * self.device_bytes
        return any(n.startswith("trainer") and e.total > cap for n, _, e in self.processes)

    def fits(self) -> bool | None:
        if self.device_bytes is None:
            return None
        size = self.device_bytes
        fit = all(t <= size for t in self.by_device().values()) and not self.trainer_over_cap()
        return fit and self.shares_refused is None


def model_shape(cfg: ModelConfig, named: str | None = None) -> ModelShape:
    """The shape of the model ``cfg`` names (or ``named``: see :func:`shape_and_source`),
    without loading it."""
    return shape_and_source(cfg, named)[0]


def shape_and_source(cfg: ModelConfig, named: str | None = None) -> tuple[ModelShape, str]:
    """The shape of the model, and where it was read: ``named`` (``--model``: a known
    model's name, a folder or its ``config.json``) in place of ``cfg``'s; the tiny model's
    fields; a folder's ``config.json`` (the safetensors headers give the exact count); or,
    for a folder without one (not downloaded yet), the known model its name spells."""
    if named is not None:
        return _named_shape(named)
    if cfg.source == "tiny":
        vocab = SPECIAL_TOKENS + len(dict.fromkeys(cfg.charset))
        shape = llama_shape(
            vocab,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_heads,
            tied=True,
        )
        return shape, "tiny"
    folder = Path(str(cfg.path))
    if not (folder / "config.json").is_file():
        known = known_name(folder.name)
        if known is None:
            raise ConfigError(
                f"model.path: {folder} has no config.json (not downloaded yet?): plan a known "
                f"model's shape with --model NAME ({', '.join(KNOWN_MODELS)}), or give a folder "
                f"holding the model's config.json"
            )
        shape = shape_of_config(KNOWN_MODELS[known], known)
        return shape, f"{known}, a known shape ({folder} has no config.json)"
    return _folder_shape(folder), str(folder)


def _named_shape(named: str) -> tuple[ModelShape, str]:
    known = known_name(named)
    if known is not None:
        return shape_of_config(KNOWN_MODELS[known], known), f"{known}, a known shape"
    path = Path(named)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if (path / "config.json").is_file():
        return _folder_shape(path), str(path)
    raise ConfigError(
        f"--model: {named!r} is not a model folder, a config.json, nor a known model "
        f"({', '.join(KNOWN_MODELS)})"
    )


def _folder_shape(folder: Path) -> ModelShape:
    try:
        conf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: cannot read {folder}/config.json: {exc}") from exc
    shape = shape_of_config(conf, f"model.path: {folder}/config.json")
    counted = safetensors_params(folder)
    return dataclasses.replace(shape, params=counted or shape.params)


def safetensors_params(folder: Path) -> int:
    """Parameters in the folder's ``*.safetensors`` files, from their headers only (0 when
    there is none)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= int(dim)
                total += count
    return total


def make_plan(
    cfg: Config,
    prompt_tokens: int | None = None,
    device_bytes: int | None = None,
    model: str | None = None,
) -> Plan:
    """The estimate of every process of ``cfg``'s run (``model``: the shape of this model in
    place of ``cfg``'s, as :func:`shape_and_source` reads it)."""
    from streamrft.consumers.algorithms.presets import resolve_algorithm

    shape, source = shape_and_source(cfg.model, model)
    spec = resolve_algorithm(cfg).spec
    lora = cfg.model.lora
    t, e = cfg.trainer, cfg.explorer
    prompt = prompt_tokens or cfg.taskset.max_prompt_tokens or DEFAULT_PROMPT_TOKENS
    sequence = prompt + e.max_new_tokens
    rows = t.micro_batch_size or t.batch_size * e.repeat_times
    tokens = rows * sequence
    if t.max_tokens_per_micro_batch:
        tokens = min(tokens, max(t.max_tokens_per_micro_batch, sequence))
    ranks = t.world if t.engine == "fsdp2" or t.world > 1 else 1
    trainable = lora_params(shape, lora.rank, lora.target_modules) if lora.enabled else shape.params
    work = Workload(
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
        trainable=trainable,
        micro_batch_tokens=tokens,
        prompt_tokens=prompt,
        response_tokens=e.max_new_tokens,
        rows_sampled=e.batch_size * e.repeat_times,
        ranks=ranks,
        reference=spec.needs_reference and not lora.enabled,
        critic=spec.needs_critic,
    )
    device = role_device(cfg, "trainer")[0]
    processes = []
    trainer = trainer_estimate(shape, work, t.gradient_checkpointing)
    slots_on = None  # the GPU of the trainer's device-path slots (None: no device path)
    for r in range(t.nproc):  # this host's ranks: node 0's (1 unless ranks > 1)
        name = f"trainer rank {r}" if ranks > 1 else "trainer"
        where = t.devices[r] if t.devices else _rank(device, r, ranks)
        est = trainer
        if r == 0 and device_path(cfg, where):  # two slots a version is read from
            slots_on = physical_device(where)
            slots = 2 * staging_bytes(shape, work, lora=False)
            est = dataclasses.replace(trainer, parts={**trainer.parts, "ipc_slots": slots})
        processes.append((name, where, est))
    for i in range(e.count):
        processes += _sampler(cfg, "explorer", i, shape, work, device_bytes, slots_on)
    ev = cfg.eval
    reading = dataclasses.replace(
        work,
        rows_sampled=min(ev.batch_size, ev.max_tasks or ev.batch_size),
        response_tokens=ev.max_new_tokens or e.max_new_tokens,
    )
    for i in range(ev.count):
        processes += _sampler(cfg, "evaluator", i, shape, reading, device_bytes, slots_on)
    try:
        check_gpu_shares(cfg)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    return Plan(shape, work, processes, device_bytes, t.gpu_memory_fraction, refused, source)


def _sampler(
    cfg: Config,
    role: str,
    index: int,
    shape: ModelShape,
    work: Workload,
    device_bytes: int | None,
    slots_on: str | None,
) -> list[tuple[str, str, Estimate]]:
    """The rows of explorer (or evaluator) ``index``: one, or one per GPU its vLLM engine
    spans (``explorer.tensor_parallel_size``), each holding vLLM's share of that GPU.
    ``slots_on``: the GPU of the trainer's device-path slots (None: none)."""
    name = f"{role}-{index}"
    device = role_device(cfg, role, index)[0]
    vllm = role_engine(cfg, role) == "vllm"
    gpus = span(device, engine_gpus(cfg, role)) if vllm else [device]
    # a process placed on GPUs is shown only those: it reads the slots where they are one
    reads_slots = slots_on is not None and slots_on in {physical_device(g) for g in gpus}
    if not vllm:
        est = explorer_estimate(shape, work, role)
        return [(name, device, _receiving(cfg, device, vllm, reads_slots, shape, work, est))]
    share = vllm_estimate(cfg.explorer.gpu_memory_utilization, device_bytes, role)
    rows = [(f"{name} tp{r}" if len(gpus) > 1 else name, gpu, share) for r, gpu in enumerate(gpus)]
    first, gpu, _ = rows[0]  # what it keeps to receive versions is the process's: first GPU
    rows[0] = (first, gpu, _receiving(cfg, gpu, vllm, reads_slots, shape, work, share))
    return rows


def device_path(cfg: Config, trainer: str) -> bool:
    """Whether a trainer on ``trainer`` sends versions from its GPU too (``cuda_ipc``):
    ``auto`` or the method itself, full weights (``sync.cuda_ipc.uses_device_path``)."""
    from streamrft.sync.cuda_ipc import uses_device_path

    lora, gpu = cfg.model.lora.enabled, physical_device(trainer)  # "auto" too
    return cfg.synchronizer.method in ("auto", "cuda_ipc") and uses_device_path(gpu, lora, True)


def _receiving(
    cfg: Config,
    device: str,
    vllm: bool,
    reads_slots: bool,
    shape: ModelShape,
    work: Workload,
    est: Estimate,
) -> Estimate:
    """``est`` with what the process keeps to receive versions (``receive_memory``): on its
    device, in its total; in host memory beside it, not."""
    on_gpu = device.startswith("cuda")
    parts, host = receive_memory(
        staging_bytes(shape, work, cfg.model.lora.enabled),
        cfg.synchronizer.staging,
        on_gpu,
        vllm,
        on_gpu and reads_slots,
        cfg.synchronizer.method in ("auto", "shared"),
    )
    return dataclasses.replace(est, parts={**est.parts, **parts}, host={**est.host, **host})


def _rank(device: str, rank: int, ranks: int) -> str:
    """Where rank ``rank`` of ``ranks`` trains: ``cuda:rank`` on GPUs, else ``device``."""
    return f"cuda:{rank}" if ranks > 1 and device.startswith("cuda") else device


def cuda_memory() -> int | None:
    """The first GPU's memory in bytes, where torch sees one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def render(plan: Plan) -> str:
    """The table ``streamrft plan`` prints."""
    w, s = plan.work, plan.shape
    lines = [
        f"model: {plan.model_source or 'as configured'}",
        f"  {s.params / 1e6:,.1f}M parameters ({w.trainable / 1e6:,.2f}M trained), "
        f"{s.layers} layers of {s.hidden}, vocabulary {s.vocab:,}; values of {w.dtype_bytes} bytes",
        f"step: micro-batches of {w.micro_batch_tokens:,} tokens; explorers sample "
        f"{w.rows_sampled} rows of {w.prompt_tokens} + {w.response_tokens} tokens",
        "",
    ]
    header = ["process", "device", *COLUMNS, "activations", "(ckpt on/off)", "total"]
    rows = [header]
    for name, device, est in plan.processes:
        acts = est.activations_checkpointed if est.checkpointing else est.activations
        other = est.activations if est.checkpointing else est.activations_checkpointed
        rows.append(
            [name, device]
            + [_gib(est.parts[c]) if c in est.parts else "" for c in COLUMNS]
            + [_gib(acts) if est.activations else "", f"({_gib(other)})" if est.activations else ""]
            + [_gib(est.total)]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += [
        "  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    lines.append("")
    size = plan.device_bytes
    for device, total in plan.by_device().items():
        if size is None:
            verdict = "; device size unknown: give --device-memory"
        else:
            verdict = f" of {_gib(size)} GiB: {'fits' if total <= size else 'does NOT fit'}"
        lines.append(f"{device}: {_gib(total)} GiB{verdict}")
    if plan.shares_refused is not None:
        lines.append(f"vLLM's shares of the GPUs: does NOT start: {plan.shares_refused}")
    if plan.trainer_over_cap():
        lines.append(
            f"the trainer needs more than its trainer.gpu_memory_fraction "
            f"({plan.trainer_share:g} of the GPU): does NOT fit"
        )
    beside = [(n, est.host) for n, _, est in plan.processes if est.host]
    if beside:
        each = "; ".join(
            f"{n} " + ", ".join(f"{part} {_gib(b)}" for part, b in h.items()) for n, h in beside
        )
        total = sum(sum(h.values()) for _, h in beside)
        lines.append(
            f"host memory beside the GPUs (pinned but a vLLM engine's): {each} GiB; "
            f"{_gib(total)} GiB in all"
        )
    lines.append(
        "figures in GiB; estimates without the CUDA context and allocator slack (add ~0.5 GiB "
        "a process)"
    )
    return "\n".join(lines)


def as_json(plan: Plan) -> dict[str, Any]:
    return {
        "params": plan.shape.params,
        "trainable": plan.work.trainable,
        "micro_batch_tokens": plan.work.micro_batch_tokens,
        "processes": [
            {
                "name": n,
                "device": d,
                "parts": est.parts,
                "host": est.host,
                "activations": est.activations,
                "activations_checkpointed": est.activations_checkpointed,
                "total": est.total,
            }
            for n, d, est in plan.processes
        ],
        "devices": plan.by_device(),
        "device_memory": plan.device_bytes,
        "shares_refused": plan.shares_refused,
        "fits": plan.fits(),
    }


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
