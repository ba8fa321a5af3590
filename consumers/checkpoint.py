"""Trainer checkpoints without pickle: safetensors for tensors, JSON for the rest.

``<run dir>/checkpoints/step_00000050/``:
- ``model.safetensors``: the policy's weights (tied aliases stored once);
- ``optimizer.safetensors``: every optimizer state tensor, named ``<param index>.<key>``;
- ``optimizer.json``: the optimizer's hyper-parameters and scalar state;
- ``state.json``: the :class:`~streamrft.consumers.state.TrainerState` (step, version,
  resume offsets, the dedup window, counters);
- ``<name>.safetensors``, ``<name>_optimizer.safetensors``, ``<name>_optimizer.json``: a
  second model trained beside the policy (``critic``: PPO's value model) and its optimizer,
  in the same formats, when the engine has one (``extras``);
- ``keep`` (optional, made by hand): the folder is never deleted by retention.
``latest`` names the newest complete folder.

Atomic and durable: a checkpoint is written to a temporary folder, every file and the
folder are fsynced, it is renamed into place, then ``latest`` is replaced the same way
(temporary file, fsync, rename, fsync of the parent). The folder ``latest`` names is
never deleted before its successor is in place: saving a step again first renames the
old folder aside to ``step_N.prev``, which
:func:`~streamrft.consumers.checkpoint_folders.latest_checkpoint` reads if a crash came
between the two renames. Only after ``latest`` names the new folder are older ones
deleted: all but the newest ``keep`` (0: none deleted) and those holding a ``keep`` file.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from streamrft.consumers.checkpoint_folders import step_folders
from streamrft.consumers.state import STATE_DECODER, STATE_ENCODER, TrainerState, from_legacy
from streamrft.infra.durable import fsync_path, replace_durably
from streamrft.schemas.errors import StreamRFTError, SyncError
from streamrft.sync.payload import ModuleTarget, WeightTarget
from streamrft.sync.weights import apply_state_dict, unique_state_dict

log = logging.getLogger(__name__)

Extras = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
"""Models trained beside the policy, by file name prefix (``critic``), with their
optimizers."""

KEEP_MARKER = "keep"
"""A file of this name in a checkpoint folder exempts it from retention."""


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


# -- durable files ---------------------------------------------------------------------------
def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def point_latest(root: Path, name: str) -> None:
    """Make ``latest`` in ``root`` name the checkpoint folder ``name`` (durably)."""
    replace_durably(root / "latest", name.encode())


def _write_model(folder: Path, name: str, opt_name: str, model, optimizer) -> None:
    """``<name>.safetensors``, ``<opt_name>.safetensors`` and ``<opt_name>.json``, synced."""
    save_file(unique_state_dict(model), str(folder / f"{name}.safetensors"))
    opt_tensors, opt_meta = _optimizer_split(optimizer)
    save_file(opt_tensors, str(folder / f"{opt_name}.safetensors"))
    for file in (f"{name}.safetensors", f"{opt_name}.safetensors"):
        fsync_path(folder / file)
    _write_durably(folder / f"{opt_name}.json", msgspec.json.encode(opt_meta))


def _write_folder(
    folder: Path, state: TrainerState, model, optimizer, marked: bool, extras: Extras
) -> None:
    """Every file of a checkpoint into a fresh ``folder``, all of them on disk at return."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    _write_model(folder, "model", "optimizer", model, optimizer)
    for name, (extra, extra_opt) in extras.items():
        _write_model(folder, name, f"{name}_optimizer", extra, extra_opt)
    _write_durably(folder / "state.json", STATE_ENCODER.encode(state))
    if marked:
        mark_keep(folder)
    fsync_path(folder)


def mark_keep(folder: Path) -> None:
    """Mark the checkpoint ``folder`` to be kept (retention passes it by)."""
    _write_durably(folder / KEEP_MARKER, b"")


def unmark_keep(folder: Path) -> None:
    """Take the keep mark off the checkpoint ``folder`` (if it is still there)."""
    (folder / KEEP_MARKER).unlink(missing_ok=True)


def marked_keep(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` is marked to be kept."""
    return (folder / KEEP_MARKER).exists()


# -- saving ----------------------------------------------------------------------------------
def save_checkpoint(
    root: Path,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    keep: int,
    extras: Extras | None = None,
) -> Path:
    """Write ``root/step_<state.step>`` durably (with the ``extras`` models and
    optimizers), point ``latest`` at it, then delete the checkpoints older than the newest
    ``keep`` (0: keep all) that hold no ``keep`` file."""
    if not root.is_dir():
        root.mkdir(parents=True)
        fsync_path(root.parent)  # the new folder's entry, before anything inside it counts
    final = root / f"step_{state.step:08d}"
    tmp = root / f".tmp_{final.name}"
    marked = marked_keep(final)
    try:
        _write_folder(tmp, state, model, optimizer, marked, extras or {})
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint only takes space
        if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in str(exc):
            free = shutil.disk_usage(root).free / 2**30
            raise CheckpointError(
                f"checkpoint {final.name}: no space left on the device of {root} "
                f"({free:.1f} GiB free; a checkpoint holds the model and its optimizer state). "
                "Free space, lower trainer.keep_checkpoints, or put run.dir on a larger disk; "
                "the run resumes from its last complete checkpoint"
            ) from exc
        raise
    if final.exists():  # this step saved again: set aside, deleted once latest moves on
        aside = root / f"{final.name}.prev"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_path(root)
    point_latest(root, final.name)
    _prune(root, state.step, keep)
    return final


def _prune(root: Path, step: int, keep: int) -> None:
    """Delete what the save at ``step`` (now ``latest``) made obsolete: folders set aside
    or left half-written by earlier saves, and checkpoints of earlier steps beyond the
    newest ``keep`` unless marked. Later steps (an earlier run in this folder) stay."""
    for leftover in [*root.glob("step_*.prev"), *root.glob(".tmp_step_*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    if keep == 0:
        return
    older = [path for s, path in step_folders(root) if s < step]
    for path in older[: max(len(older) - (keep - 1), 0)]:
        if not marked_keep(path):
            shutil.rmtree(path, ignore_errors=True)


# -- loading ---------------------------------------------------------------------------------
_READ_ERRORS = (OSError, ValueError, KeyError, SafetensorError, msgspec.MsgspecError)
"""What reading a damaged or missing checkpoint file raises."""


def _read_state(path: Path) -> tuple[TrainerState, dict[str, Any]]:
    """The trainer state and optimizer meta of ``path``, in either layout."""
    raw = (path / "state.json").read_bytes()
    meta_file = path / "optimizer.json"
    if meta_file.is_file():
        return STATE_DECODER.decode(raw), msgspec.json.decode(meta_file.read_bytes())
    # written before TrainerState: one dict, the optimizer meta inside
    old = msgspec.json.decode(raw, type=dict[str, Any])
    return from_legacy(old), old["optimizer"]


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extras: Extras | None = None,
) -> TrainerState:
    """Restore model and optimizer (and the ``extras`` the checkpoint holds) from ``path``;
    returns the rest of the trainer state.

    Every file is read and decoded before anything is applied, so a damaged checkpoint
    raises :class:`CheckpointError` and leaves model and optimizer untouched. A checkpoint
    written before :class:`TrainerState` existed loads too. An extra the checkpoint lacks
    (written by a run without a critic) keeps its current weights and optimizer, with a
    warning.
    """
    try:
        state, opt_meta = _read_state(path)
        weights = load_file(str(path / "model.safetensors"))
        opt_state = _optimizer_join(load_file(str(path / "optimizer.safetensors")), opt_meta)
        found = {name: _read_extra(path, name) for name in extras or {}}
    except _READ_ERRORS as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    targets = {"model": (model, optimizer), **(extras or {})}
    for name, saved in {"model": (weights, opt_state), **found}.items():
        if saved is None:
            log.warning("checkpoint %s holds no %s: it starts fresh", path, name)
            continue
        _apply(path, name, targets[name], saved)
    return state


def _read_extra(path: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The weights and optimizer state of extra ``name`` in ``path``; None if it has none."""
    if not (path / f"{name}.safetensors").is_file():
        return None
    meta = msgspec.json.decode((path / f"{name}_optimizer.json").read_bytes())
    opt = _optimizer_join(load_file(str(path / f"{name}_optimizer.safetensors")), meta)
    return load_file(str(path / f"{name}.safetensors")), opt


def _apply(
    path: Path,
    name: str,
    target: tuple[torch.nn.Module, torch.optim.Optimizer],
    saved: tuple[dict[str, torch.Tensor], dict[str, Any]],
) -> None:
    model, optimizer = target
    apply_state_dict(model, saved[0])
    try:
        optimizer.load_state_dict(saved[1])
    except (ValueError, KeyError) as exc:
        what = "optimizer" if name == "model" else f"{name} optimizer"
        raise CheckpointError(f"checkpoint {path}: {what} state does not fit: {exc}") from exc


def load_weights(path: Path, model: torch.nn.Module | WeightTarget) -> TrainerState:
    """The weights of checkpoint ``path`` into ``model``, for evaluation (no optimizer);
    returns the checkpoint's trainer state (its step and version).

    ``model`` must be built as the trainer built it: from the run's ``model`` section,
    wrapped with its LoRA adapter (``sync.lora.attach_lora``) when ``model.lora.enabled``,
    since a LoRA run checkpoints the whole wrapped model. Or it is a rollout engine around
    such a model (a ``sync.payload.WeightTarget``): the weights go in as a full version of
    the checkpoint's version number, as an explorer takes one. Everything is read and checked
    before the first copy: a damaged checkpoint, or one that does not fit ``model``, raises
    :class:`CheckpointError` and leaves ``model`` untouched.
    """
    try:
        state, _ = _read_state(path)
        weights = load_file(str(path / "model.safetensors"))
    except _READ_ERRORS as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    target = ModuleTarget(model) if isinstance(model, torch.nn.Module) else model
    try:
        target.load_weights(state.version, weights)
    except SyncError as exc:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model of this config (model.* and "
            f"model.lora.* must be the run's): {exc}"
        ) from exc
    return state
