"""``streamrft export``: a trainer checkpoint to a plain Hugging Face model folder.

The policy is rebuilt from ``cfg.model`` exactly as the trainer built it, the checkpoint's
``model.safetensors`` is loaded into it, and the result is written with
``save_pretrained`` (safetensors) plus the tokenizer. A LoRA run's adapter is merged into
the base weights first, so the folder needs neither peft nor streamrft to load.

The checkpoint's tensor names decide how it is read:

- plain names (``model.layers.0...``): a full model, as the trainer saves it without LoRA;
- ``base_model.model.`` names: the whole peft-wrapped model (base and adapter), as the
  trainer saves it with LoRA;
- adapter tensors only (``...lora_A.weight``): an adapter on the base ``cfg.model`` names.

``export --run-id`` takes the run's newest complete checkpoint (:func:`run_checkpoint`):
its object store's, fetched into the run folder when newer than the one there, while the
store is up; the run folder's alone, with the network left alone, when the run keeps no
checkpoints in a store, when the embedded services ``streamrft run`` started stopped with
it (a finished run), or when its store does not answer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from streamrft.app.watch.run_events import reachable
from streamrft.consumers.checkpoint import CheckpointError
from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.infra.config import Config
from streamrft.infra.endpoints import resolve
from streamrft.infra.modeling import load_policy, save_policy
from streamrft.infra.service_state import status
from streamrft.schemas.errors import ConfigError, StreamRFTError, SyncError
from streamrft.sync.weights import apply_state_dict

log = logging.getLogger(__name__)


def export(cfg: Config, checkpoint_dir: Path, out_dir: Path) -> Path:
    """Write the checkpoint at ``checkpoint_dir`` as a Hugging Face folder ``out_dir``."""
    weights_file = Path(checkpoint_dir) / "model.safetensors"
    try:
        weights = load_file(str(weights_file))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(
            f"checkpoint {checkpoint_dir}: cannot read {weights_file.name}: {exc}"
        ) from exc
    # the trainer's float32 master weights, exported as they are (whatever model.dtype)
    model, tokenizer = load_policy(cfg.model, dtype=torch.float32)

    from streamrft.sync import lora  # peft is imported only when an export needs it

    adapter_only = lora.is_adapter_state(weights)
    wrapped = adapter_only or any(name.startswith(lora.PEFT_PREFIX) for name in weights)
    if wrapped and not cfg.model.lora.enabled:
        raise ConfigError(
            f"model.lora.enabled: checkpoint {checkpoint_dir} holds a LoRA adapter; "
            "export with the run's config (model.lora.enabled: true and its lora settings)"
        )
    if not wrapped:
        if cfg.model.lora.enabled:
            log.warning("checkpoint %s holds no adapter; exporting its weights", checkpoint_dir)
        _load(model, weights, checkpoint_dir)
        out = save_policy(model, tokenizer, out_dir)
    else:
        peft_model = lora.attach_lora(model, cfg.model.lora)
        _load(peft_model, weights, checkpoint_dir, lora.apply_adapter if adapter_only else None)
        out = lora.merge_and_export(peft_model, tokenizer, out_dir)
    log.info("exported %s to %s", checkpoint_dir, out)
    return out


def _load(model, weights, checkpoint_dir: Path, apply=None) -> None:
    try:
        (apply or apply_state_dict)(model, weights)
    except SyncError as exc:
        raise CheckpointError(
            f"checkpoint {checkpoint_dir} does not fit the model of this config "
            f"(model.* and model.lora.* must match the run's): {exc}"
        ) from exc


def run_checkpoint(cfg: Config) -> Path:
    """The newest complete checkpoint of run ``cfg`` (its config, endpoints resolved or
    not): see the module docstring."""
    root = cfg.run_dir / "checkpoints"
    why = services_gone(cfg)
    if why is None:
        cfg, _found = resolve(cfg, joining=True)
        why = store_unusable(cfg)
    if why is None:
        from streamrft.consumers.checkpoint_store import CheckpointStore

        CheckpointStore(cfg).fetch_newer(root)
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        where = f"nor in its object store ({why})" if why else "nor in its object store"
        raise StreamRFTError(f"run {cfg.run.id}: no complete checkpoint in {root}, {where}")
    if why is not None:
        log.info("run %s: %s; its newest checkpoint here is %s", cfg.run.id, why, ckpt)
    return ckpt


def services_gone(cfg: Config) -> str | None:
    """Why run ``cfg``'s store is gone with it, found without the network: it started
    embedded services (``<run dir>/services``) that run no more, and the config names no
    store of its own. None: not known to be gone."""
    folder = cfg.run_dir / "services"
    if cfg.object_store.endpoint or not folder.is_dir():
        return None
    own = status(folder)
    if own is not None and own.get("running"):
        return None
    return "its embedded broker and object store stopped with it (the run has ended)"


def store_unusable(cfg: Config) -> str | None:
    """Why run ``cfg``'s checkpoints cannot come from its object store (its endpoints
    resolved); None: they can."""
    endpoint = cfg.object_store.endpoint
    if not endpoint:
        return "it has no object store"
    if not cfg.stores_checkpoints:
        return "it keeps its checkpoints on its trainer's disk (trainer.checkpoint_store)"
    if not reachable(endpoint):
        return f"its object store {endpoint} does not answer"
    return None
