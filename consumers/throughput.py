"""How fast a training step went: tokens per second, an estimate of the model FLOPs
utilisation (MFU) and the accelerator's peak memory. The arithmetic is pure; the clock
and the CUDA memory counters are read by the caller.

FLOPs are estimated the usual way (Kaplan et al. 2020; PaLM's MFU, Chowdhery et al.
2022, appendix B, without the attention term): a forward pass costs ``2 N`` per token,
a backward ``4 N``, for ``N`` the model's parameters. A step of ``ppo_epochs`` passes
over ``T`` tokens costs ``6 N T`` per epoch, plus ``2 N T`` for each frozen forward pass
(the reference model, the proximal policy, a teacher). PPO's critic is not counted.
With LoRA the backward computes no weight gradients for the frozen base, so the estimate
runs high there.
"""

from __future__ import annotations

import torch

PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
}
"""Dense bf16/fp16 tensor-core peak of each GPU, by a part of its CUDA device name (SXM
figures for the H100/H200), in TFLOPS. A GPU not named here reports no MFU unless
``trainer.peak_tflops`` says its peak."""


def step_flops(params: int, tokens: int, epochs: int, frozen_passes: int) -> float:
    """Model FLOPs of one training step (see the module docstring)."""
    return float(params) * tokens * (6.0 * epochs + 2.0 * frozen_passes)


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """The peak to divide by: ``configured`` when set, else :data:`PEAK_TFLOPS` by the
    CUDA device's name; None on a CPU or an unknown GPU (no MFU is reported)."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_TFLOPS.items() if part in name), None)


def throughput_metrics(
    tokens: int, seconds: float, flops: float, peak: float | None, peak_bytes: int | None
) -> dict[str, float]:
    """The step's ``train/tokens_per_s``, ``train/mfu`` (with a peak) and
    ``train/peak_memory_gb`` (on an accelerator)."""
    out = {"train/tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
    if peak is not None and seconds > 0:
        out["train/mfu"] = flops / seconds / (peak * 1e12)
    if peak_bytes is not None:
        out["train/peak_memory_gb"] = peak_bytes / 2**30
    return out
