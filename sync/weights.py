"""State dicts to verified safetensors shards and back. Pure apart from torch.

No pickle: shards are safetensors, the manifest is JSON (see ``schemas.weights``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from streamrft.schemas.errors import IntegrityError, SyncError


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def shared_aliases(model: torch.nn.Module) -> set[str]:
    """Names in ``state_dict`` that alias an earlier tensor (tied embeddings).

    They are published once, under their first name, and restored by the tie itself.
    """
    seen: set[int] = set()
    aliases = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            aliases.add(name)
        seen.add(ptr)
    return aliases


def unique_state_dict(
    model: torch.nn.Module,
    dtype: torch.dtype | None = None,
    keep_dtype: Callable[[str], bool] = lambda name: False,
) -> dict[str, torch.Tensor]:
    """The model's tensors without tied aliases, detached and contiguous (CPU); floating
    ones cast to ``dtype`` when given, except those ``keep_dtype`` names."""

    def cast(name: str, v: torch.Tensor) -> torch.dtype | None:
        keep = not dtype or not v.is_floating_point() or keep_dtype(name)
        return None if keep else dtype

    aliases = shared_aliases(model)
    return {
        k: v.detach().to("cpu", dtype=cast(k, v)).contiguous()
        for k, v in model.state_dict().items()
        if k not in aliases
    }


def tensors_dtype(tensors: Mapping[str, torch.Tensor]) -> str:
    """The one floating dtype of ``tensors`` (``bfloat16``...), ``mixed``, or ``""`` (none)."""
    kinds = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "")


def shard_state_dict(
    tensors: Mapping[str, torch.Tensor], max_shard_bytes: int
) -> Iterator[tuple[list[str], bytes]]:
    """Serialise tensors into safetensors shards of at most ~``max_shard_bytes`` each.

    A tensor larger than the limit gets a shard of its own.
    """
    names: list[str] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if names and size + nbytes > max_shard_bytes:
            yield names, st_save({n: tensors[n] for n in names})
            names, size = [], 0
        names.append(name)
        size += nbytes
    if names:
        yield names, st_save({n: tensors[n] for n in names})


def verify(data: bytes, expected_sha256: str, what: str, actual: str | None = None) -> None:
    """Raise :class:`IntegrityError` unless ``data`` (or its known digest) matches."""
    actual = actual or sha256_hex(data)
    if actual != expected_sha256:
        raise IntegrityError(
            f"{what}: sha256 {actual[:16]}... does not match the manifest's "
            f"{expected_sha256[:16]}...; refusing to apply it"
        )


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def decode_shard(data: bytes | bytearray, what: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in memory.

    A ``bytearray`` (what the parallel downloader fills) is decoded without copying: every
    tensor is a view of the buffer. ``bytes`` go through the safetensors library.
    """
    if not isinstance(data, bytearray):
        try:
            return st_load(data)
        except Exception as exc:  # safetensors raises its own SafetensorError and others
            raise IntegrityError(f"{what}: not a valid safetensors file: {exc}") from exc
    try:
        n = int.from_bytes(data[:8], "little")
        if not 2 <= n <= len(data) - 8:
            raise ValueError(f"header length {n} out of range")
        header = json.loads(bytes(data[8 : 8 + n]))
        view, base, out = memoryview(data), 8 + n, {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            dtype = _DTYPES[info["dtype"]]
            if not 0 <= start <= end <= len(data) - base:
                raise ValueError(f"{name}: data offsets {start}..{end} out of range")
            shape = [int(d) for d in info["shape"]]
            if end == start:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = torch.frombuffer(view[base + start : base + end], dtype=dtype).view(
                    shape
                )
        return out
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise IntegrityError(f"{what}: not a valid safetensors file: {exc}") from exc


@torch.no_grad()
def copy_into(
    own: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    what: str,
    optional: set[str] = frozenset(),
    hint: str = "",
) -> None:
    """Copy ``tensors`` into the live tensors ``own`` (views of a model) in place.

    Every name of ``own`` but the ``optional`` ones must come, none may be extra, and
    shapes must agree; all of it is checked before the first copy, so a mismatch raises
    :class:`SyncError` and leaves the model exactly as it was.
    """
    missing = set(own) - set(optional) - set(tensors)
    unexpected = set(tensors) - set(own)
    if missing or unexpected:
        raise SyncError(
            f"{what} do not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}{hint}"
        )
    for name, tensor in tensors.items():
        if own[name].shape != tensor.shape:
            raise SyncError(
                f"{what} do not fit the model: {name} is {tuple(tensor.shape)}, "
                f"model has {tuple(own[name].shape)}{hint}"
            )
    for name, tensor in tensors.items():
        own[name].copy_(tensor)


def apply_state_dict(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model`` in place; every non-alias tensor must be present."""
    copy_into(model.state_dict(), tensors, "weights", optional=shared_aliases(model))
