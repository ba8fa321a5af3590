"""The weight manifest: written last, after every shard, so its presence means complete."""

from __future__ import annotations

import msgspec


class ShardInfo(msgspec.Struct, kw_only=True):
    """One safetensors file of a version."""

    name: str
    """Object name relative to the version prefix, e.g. ``model-00001-of-00002.safetensors``."""
    sha256: str
    """Hex sha256 of the whole object; the loader refuses a shard that does not match."""
    bytes: int
    """Object size."""
    tensors: list[str] = []
    """Names of the tensors it holds."""


class WeightManifest(msgspec.Struct, kw_only=True):
    """``manifest.json`` of a version, written after every shard (its presence = complete)."""

    version: int
    """Model version."""
    step: int
    """Trainer step the weights were taken after."""
    run: str
    """Run id."""
    format: str = "safetensors"
    """Shard format."""
    shards: list[ShardInfo] = []
    """Every shard with its digest."""
    total_bytes: int = 0
    """Sum of the shard sizes."""
    lora: bool = False
    """True when the shards hold a LoRA adapter only."""
    created_at: float = 0.0
    """Unix time of publication."""
    files: list[ShardInfo] = []
    """Other files of the version (e.g. a LoRA ``adapter_config.json``), with digests."""
    dtype: str = ""
    """Floating dtype of the weights (``float32``, ``bfloat16``, ``float16``): the
    explorers' ``model.dtype`` for full weights; ``mixed`` or empty when not one."""
