"""Models by name, for sizing without their files: ``streamrft plan --model qwen2.5-1.5b``
plans a recipe before anything is downloaded, and a model folder not downloaded yet is
planned by its name (``models/qwen2.5-1.5b-instruct``).

Each entry holds the fields of the model's ``config.json`` that the planner reads, as the
model's publisher writes them; base and instruct models share a shape. The families are
the recipes' (Qwen2.5, SmolLM2) and their usual neighbours (Qwen3, Llama 3).
"""

from __future__ import annotations

import re
from typing import Any

from streamrft.infra.memory_plan import ModelShape, llama_shape
from streamrft.schemas.errors import ConfigError


def _conf(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    tied: bool,
    context: int,
    head_dim: int | None = None,
) -> dict[str, Any]:
    conf = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": context,
    }
    if head_dim:
        conf["head_dim"] = head_dim
    return conf


KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _conf(896, 4864, 24, 14, 2, 151936, True, 32768),
    "qwen2.5-1.5b": _conf(1536, 8960, 28, 12, 2, 151936, True, 32768),
    "qwen2.5-3b": _conf(2048, 11008, 36, 16, 2, 151936, True, 32768),
    "qwen2.5-7b": _conf(3584, 18944, 28, 28, 4, 152064, False, 32768),
    "qwen3-0.6b": _conf(1024, 3072, 28, 16, 8, 151936, True, 40960, head_dim=128),
    "qwen3-1.7b": _conf(2048, 6144, 28, 16, 8, 151936, True, 40960, head_dim=128),
    "qwen3-4b": _conf(2560, 9728, 36, 32, 8, 151936, True, 40960, head_dim=128),
    "qwen3-8b": _conf(4096, 12288, 36, 32, 8, 151936, False, 40960, head_dim=128),
    "llama-3.2-1b": _conf(2048, 8192, 16, 32, 8, 128256, True, 131072),
    "llama-3.2-3b": _conf(3072, 8192, 28, 24, 8, 128256, True, 131072),
    "llama-3.1-8b": _conf(4096, 14336, 32, 32, 8, 128256, False, 131072),
    "smollm2-135m": _conf(576, 1536, 30, 9, 3, 49152, True, 8192),
    "smollm2-360m": _conf(960, 2560, 32, 15, 5, 49152, True, 8192),
    "smollm2-1.7b": _conf(2048, 8192, 24, 32, 32, 49152, True, 8192),
}
"""Name -> the planner's fields of the model's ``config.json``."""

_SUFFIXES = re.compile(r"[-_](instruct|chat|it|base)$")


def known_name(text: str) -> str | None:
    """The :data:`KNOWN_MODELS` name ``text`` spells (a hub id such as
    ``Qwen/Qwen2.5-1.5B-Instruct``, a folder's name, any case), else None."""
    name = text.rstrip("/").rsplit("/", 1)[-1].lower().replace("_", "-")
    name = name.replace("meta-llama-", "llama-").replace("llama3", "llama-3")
    while _SUFFIXES.search(name):
        name = _SUFFIXES.sub("", name)
    return name if name in KNOWN_MODELS else None


def shape_of_config(conf: dict[str, Any], where: str) -> ModelShape:
    """The shape a ``config.json``'s fields describe (``where`` names them in errors)."""
    try:
        heads = int(conf["num_attention_heads"])
        return llama_shape(
            int(conf["vocab_size"]),
            int(conf["hidden_size"]),
            int(conf["intermediate_size"]),
            int(conf["num_hidden_layers"]),
            heads,
            int(conf.get("num_key_value_heads") or heads),
            tied=bool(conf.get("tie_word_embeddings", False)),
            head_dim=int(conf["head_dim"]) if conf.get("head_dim") else None,
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: cannot read the model's shape: no field {exc}") from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: cannot read the model's shape: {exc}") from exc


def context_of(conf: dict[str, Any]) -> int:
    """The positions the model reads (``max_position_embeddings``; 0: not said)."""
    value = conf.get("max_position_embeddings") or 0
    return int(value) if isinstance(value, int | float) else 0
