"""Trainer checkpoints without pickle: safetensors for tensors, JSON for the rest.

``<run dir>/checkpoints/step_00000050/``:
- ``model.safetensors``: the policy's weights (tied aliases stored once);
- ``optimizer.safetensors``: every optimizer state tensor, named ``<param index>.<key>``;
- ``state.json``: step, version, optimizer hyper-parameters and scalar state, consumed
  offsets, seen experience ids, counters.
A checkpoint is written to a temporary folder and renamed into place, then ``latest``
is updated: a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from streamrft.schemas.errors import StreamRFTError
from streamrft.sync.weights import apply_state_dict, unique_state_dict


class CheckpointError(StreamRFTError):
    """A checkpoint could not be written or read."""


def _optimizer_split(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_join(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(unique_state_dict(model), str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _optimizer_split(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "optimizer": opt_meta}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def latest_checkpoint(root: Path) -> Path | None:
    marker = root / "latest"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore model and optimizer from ``path``; returns the rest of the trainer state.

    Every file is read and decoded before anything is applied, so a damaged checkpoint
    raises :class:`CheckpointError` and leaves model and optimizer untouched.
    """
    try:
        state = json.loads((path / "state.json").read_text())
        weights = load_file(str(path / "model.safetensors"))
        opt_state = _optimizer_join(
            load_file(str(path / "optimizer.safetensors")), state.pop("optimizer")
        )
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    apply_state_dict(model, weights)
    try:
        optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path}: optimizer state does not fit: {exc}") from exc
    return state
