"""LoRA adapters (peft): attach, extract, apply in place, switch off, merge and export.

With ``model.lora.enabled`` the trainer trains only the adapter tensors and publishes
only them; the base weights stay where they are on every process.

Two namings of the adapter tensors exist; both are deterministic for a given config:

- :func:`adapter_state_dict` uses peft's file format (``get_peft_model_state_dict``):
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, without the adapter
  name. A published version (these tensors in a safetensors file, renamed
  ``adapter_model.safetensors``, beside :func:`adapter_config_json` saved as
  ``adapter_config.json``) is a folder ``peft.PeftModel.from_pretrained`` reads.
- ``unique_state_dict(peft_model)`` (checkpoints) holds every tensor under the module
  names of the wrapped model: ``...q_proj.base_layer.weight``,
  ``...q_proj.lora_A.default.weight`` and so on, all with the ``base_model.model.`` prefix.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict

from streamrft.infra.modeling import save_policy
from streamrft.schemas.errors import ConfigError
from streamrft.sync.weights import copy_into

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from streamrft.infra.config import LoraConfig

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""First part of every tensor name of a peft-wrapped model."""


def _matches(module_name: str, target: str) -> bool:
    # peft's rule for a list of targets: the full name, or its last dotted parts.
    return module_name == target or module_name.endswith(f".{target}")


def attach_lora(model: PreTrainedModel, cfg: LoraConfig) -> PeftModel:
    """Wrap ``model`` with a fresh LoRA adapter; only the adapter tensors stay trainable.

    ``model`` is changed in place (its target layers become LoRA layers) and is the
    returned model's ``get_base_model()``. ``lora_A`` is drawn from torch's global RNG and
    ``lora_B`` is zero, so the wrapped model's outputs equal the base model's and two
    processes that attach in the same RNG state get the same adapter.
    """
    names = [name for name, _ in model.named_modules() if name]
    targets = list(dict.fromkeys(cfg.target_modules))
    found = [t for t in targets if any(_matches(n, t) for n in names)]
    if not found:
        raise ConfigError(
            f"model.lora.target_modules: none of {targets} names a module of the model "
            f"(layers such as {sorted({n.rsplit('.', 1)[-1] for n in names})[:12]})"
        )
    if len(found) < len(targets):
        log.warning(
            "model.lora.target_modules: %s name no module of the model; adapting %s",
            [t for t in targets if t not in found],
            found,
        )
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=found,
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():
            # transformers 5 deprecates an attribute peft still reads; nothing to act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            peft_model = get_peft_model(model, peft_cfg)
    except ValueError as exc:  # e.g. a target that is not a Linear/Embedding/Conv layer
        raise ConfigError(f"model.lora.target_modules: {exc}") from exc
    return peft_model


def adapter_state_dict(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors only (peft file naming), detached, contiguous CPU copies."""
    return {
        k: v.detach().to("cpu", copy=True).contiguous()
        for k, v in get_peft_model_state_dict(peft_model).items()
    }


def adapter_views(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors under :func:`adapter_state_dict`'s names, detached views of the
    live parameters (no copy)."""
    return {k: v.detach() for k, v in get_peft_model_state_dict(peft_model).items()}


def adapter_config_dict(peft_model: PeftModel) -> dict[str, Any]:
    """The active adapter's config as peft saves it (``inference_mode`` on, sets as lists)."""
    cfg = copy.deepcopy(peft_model.peft_config[peft_model.active_adapter])
    cfg.inference_mode = True
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = getattr(peft_model.get_base_model(), "name_or_path", None)
    out = cfg.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = sorted(value)  # peft writes list(set): sorted keeps the bytes stable
    return out


def adapter_config_json(peft_model: PeftModel) -> bytes:
    """``adapter_config.json`` of the active adapter, as peft's ``save_pretrained`` writes it."""
    return json.dumps(adapter_config_dict(peft_model), indent=2, sort_keys=True).encode()


def is_adapter_state(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``tensors`` hold only LoRA adapter tensors (a published adapter version)."""
    return bool(tensors) and all(".lora_" in name for name in tensors)


@torch.no_grad()
def apply_adapter(peft_model: PeftModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors (:func:`adapter_state_dict` naming) into ``peft_model`` in place.

    Names and shapes are checked first: a mismatch raises :class:`SyncError` and leaves
    the model exactly as it was. The base weights are never touched.
    """
    # peft's state-dict values are views of the live parameters: copy_ writes through.
    copy_into(
        get_peft_model_state_dict(peft_model),
        tensors,
        "adapter tensors",
        hint=" (same model.lora settings on both sides?)",
    )


@contextmanager
def adapter_disabled(peft_model: PeftModel) -> Iterator[PeftModel]:
    """Run the base model: inside the block the adapter has no effect on outputs."""
    with peft_model.disable_adapter():
        yield peft_model


class BaseModelView:
    """A callable that forwards through ``peft_model`` with its adapter switched off.

    Pass it where a reference model is wanted (``policy_step(..., ref_model=...)``): the
    reference log-probs then come from the base weights, with no second copy of them.
    Not an ``nn.Module`` on purpose: it owns no parameters and must not be deep-copied.
    """

    def __init__(self, peft_model: PeftModel) -> None:
        self.peft_model = peft_model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with adapter_disabled(self.peft_model):
            return self.peft_model(*args, **kwargs)


def merged_copy(peft_model: PeftModel) -> PreTrainedModel:
    """A plain transformers model with the adapter merged in; ``peft_model`` is unchanged."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        merged = copy.deepcopy(peft_model).merge_and_unload()
    return merged.eval()


def merge_and_export(peft_model: PeftModel, tokenizer: Any, out_dir: str | Path) -> Path:
    """Merge the adapter into a copy of the base and write a Hugging Face folder.

    The folder (safetensors weights, config, tokenizer) loads with
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` and gives the peft model's logits.
    """
    return save_policy(merged_copy(peft_model), tokenizer, out_dir)
