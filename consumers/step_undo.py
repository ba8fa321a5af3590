"""A training step is applied whole or not at all: what a step changes, copied before it
and put back when it fails.

A step may make several optimizer updates: ``trainer.ppo_epochs`` passes, each of one
update per mini-batch (``trainer.mini_batch_size``), then PPO's critic's own passes. If
one fails (out of memory) after another was applied, retrying the batch would train it
one and a half times, and setting it aside would drop groups the model already learned
from. So before a step of more than one update the train engine copies, to host memory,
what the step changes (:class:`StepUndo`): every trainable parameter of each optimizer
(the policy's, the adapter alone under LoRA; the critic's), each optimizer's state (AdamW's
moments and step counts) and settings (its learning rate), the float16 loss scales, and
the random number generators. A failure puts them back: the failed step is as if it never
began, and the row-by-row retry trains the batch once.

A step of one update needs no copy (:func:`needs_undo`): its update is the last thing
it changes, so a failure before it leaves nothing to undo but the float16 loss scaler's
record of its ``unscale_`` (:func:`forget_unscale`). One that fails during or after
that update (the update applied) cannot be undone: the engine raises
:class:`~streamrft.schemas.errors.StepNotUndone`, the trainer exits, and the next one
resumes from the checkpoint (whose offsets are before the batch: it is read and trained
again, once). A step whose copy host memory cannot hold is treated the same way: it goes
on without a copy, and a failure after one of its updates raises ``StepNotUndone`` (the
engine warns once and counts such steps), never a dead letter of a batch the model may
have learned from.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch

Settings = dict[str, Any]


def needs_undo(updates: int) -> bool:
    """Whether a step of ``updates`` optimizer updates must be copied before it: a
    failure after its first update would leave the model half trained on the batch."""
    return updates > 1


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory: where the copy's memory is allocated (a
    :class:`MemoryError`, or a :class:`RuntimeError` such as torch's out-of-memory, when
    it cannot be)."""
    return tensor.detach().to("cpu", copy=True)


def _host_copy(value: Any) -> Any:
    """A tensor copied to host memory (with the device to put it back on); anything else
    deep-copied."""
    if isinstance(value, torch.Tensor):
        return (to_host(value), value.device)
    return copy.deepcopy(value)


def _put_back(saved: Any) -> Any:
    if isinstance(saved, tuple) and len(saved) == 2 and isinstance(saved[0], torch.Tensor):
        tensor, device = saved
        return tensor.to(device, copy=True)
    return copy.deepcopy(saved)


def forget_unscale(scalers: list[Any | None]) -> None:
    """Drop what the loss ``scalers`` recorded of a failed step (an ``unscale_`` or a step
    of an optimizer), which would refuse the next step's ``unscale_``; their scale is kept.
    Also after a failed step that changed nothing else (no copy needed)."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    for scaler in scalers:
        if scaler is not None:
            scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


class StepUndo:
    """The state ``optimizers`` train (their parameters, their state and settings) and the
    ``scalers``' loss scales, in host memory, as they were when this was made. Making it
    raises :class:`MemoryError` or :class:`RuntimeError` when host memory cannot hold the
    copy (about 3 times the trainable weights under AdamW)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], scalers: list[Any | None]) -> None:
        self._optimizers = optimizers
        self._params = [
            (p, to_host(p))
            for opt in optimizers
            for group in opt.param_groups
            for p in group["params"]
        ]
        self._states = [
            {p: {k: _host_copy(v) for k, v in entries.items()} for p, entries in opt.state.items()}
            for opt in optimizers
        ]
        self._settings: list[list[Settings]] = [
            [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            for opt in optimizers
        ]
        self._scalers = [(s, s.state_dict()) for s in scalers if s is not None]
        self._rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    @torch.no_grad()
    def restore(self) -> None:
        """Put everything back as it was; gradients dropped."""
        for param, saved in self._params:
            param.copy_(saved)
        for opt, state, settings in zip(
            self._optimizers, self._states, self._settings, strict=True
        ):
            opt.zero_grad(set_to_none=True)
            opt.state.clear()  # entries a failed first step made are gone too
            for param, entries in state.items():
                opt.state[param] = {k: _put_back(v) for k, v in entries.items()}
            for group, saved in zip(opt.param_groups, settings, strict=True):
                group.update(copy.deepcopy(saved))
        for scaler, saved in self._scalers:
            scaler.load_state_dict(saved)
        forget_unscale([scaler for scaler, _ in self._scalers])
        torch.set_rng_state(self._rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
