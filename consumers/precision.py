"""Mixed precision for the trainer: float32 master weights and optimizer state, forward and
backward computed in ``model.dtype`` under autocast, loss scaling for float16.

The standard scheme (PyTorch AMP): parameters and AdamW moments stay float32, so small
updates are not rounded away; matmuls run in bfloat16 or float16 where autocast deems it
safe; float16's narrow range gets a dynamic loss scale (a step whose gradients overflow is
skipped and the scale lowered). bfloat16 needs no scaling. float32 is a no-op.
The float16 scale is not checkpointed: after a resume it starts again from its initial
value, and the first steps may be skipped until it has come down.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class Precision:
    """How one trainer computes: its device and compute dtype."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    scaler: torch.amp.GradScaler | None = None

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype) -> Precision:
        scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        return cls(device, dtype, scaler)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass's context: autocast to the compute dtype (off for float32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float
    ) -> torch.Tensor:
        """Unscale, clip the global grad norm to ``grad_clip`` (0: no clipping), step; the
        norm before clipping (inf/nan when a float16 step overflowed and was skipped)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        if grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in params])
            )
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return grad_norm


FP32 = Precision()
"""The default: float32 on the CPU, no autocast, no scaling."""
