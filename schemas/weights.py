"""The weight manifest: written last, after every shard, so its presence means complete."""

from __future__ import annotations

import msgspec


class ShardInfo(msgspec.Struct, kw_only=True):
    name: str
    """Object name relative to the version prefix, e.g. ``model-00001.safetensors``."""
    sha256: str
    bytes: int
    tensors: list[str] = []


class WeightManifest(msgspec.Struct, kw_only=True):
    version: int
    step: int
    run: str
    format: str = "safetensors"
    shards: list[ShardInfo] = []
    total_bytes: int = 0
    lora: bool = False
    created_at: float = 0.0
