"""A version as the elements that changed since a base version, and back. Pure torch, no I/O.

:func:`encode` compares each tensor's bits with the base's (the same name, shape and dtype)
and writes, per tensor, the cheapest of:

- nothing, when no element changed;
- ``<name>#idx`` (int32, or int64 past 2**31 elements) + ``<name>#val``: the flat indices
  of the changed elements and their new values (few changes);
- ``<name>#mask`` (uint8, one bit per element, little-endian bit order) + ``<name>#val``
  (many changes: one bit per element beats 4 bytes per change above 1/32 of them);
- ``<name>`` itself, whole (nearly all changed; a tensor new to the base, or reshaped, or
  of a dtype wider than 8 bytes).

Values are the new elements themselves (not differences), so :func:`decode` rebuilds the
exact bits: the result is bit-identical to what was encoded whatever the dtype, as
:func:`state_sha256` of both sides shows. A delta is plain named tensors, so every store
method moves it like any version.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.sync.weights import sha256_hex

IDX, MASK, VAL = "#idx", "#mask", "#val"

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Element size -> the integer dtype the bits are compared and copied as."""
HASH_THREADS = min(4, os.cpu_count() or 1)
"""Threads hashing the tensors of a state."""
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The flat elements of ``t`` as integers of the same width (a view when contiguous)."""
    return t.contiguous().reshape(-1).view(_BITS[t.element_size()])


def pack_mask(changed: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as bits, 8 per uint8, element i at bit i % 8 of byte i // 8."""
    pad = (-changed.numel()) % 8
    bits = torch.nn.functional.pad(changed.to(torch.uint8), (0, pad)).view(-1, 8)
    return (bits * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat bool tensor :func:`pack_mask` packed (``numel`` elements)."""
    bits = packed.unsqueeze(1).bitwise_and(_BIT_WEIGHTS).ne(0)
    return bits.reshape(-1)[:numel]


def _encode_one(name: str, new: torch.Tensor, base: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The entries of one tensor (see module)."""
    if (
        base is None
        or base.shape != new.shape
        or base.dtype != new.dtype
        or new.element_size() not in _BITS
    ):
        return {name: new}
    changed = bits(new).ne(bits(base))
    count = int(torch.count_nonzero(changed))
    if count == 0:
        return {}
    numel, size = new.numel(), new.element_size()
    idx_dtype = torch.int32 if numel < 2**31 else torch.int64
    sparse = count * (idx_dtype.itemsize + size)
    masked = (numel + 7) // 8 + count * size
    if min(sparse, masked) >= numel * size:
        return {name: new}
    flat = new.contiguous().reshape(-1)
    if sparse <= masked:
        index = changed.nonzero().reshape(-1)
        return {name + IDX: index.to(idx_dtype), name + VAL: flat.index_select(0, index)}
    return {name + MASK: pack_mask(changed), name + VAL: flat[changed]}


def encode(
    new: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``new`` as its changes against ``base`` (see module). Names of ``base`` missing from
    ``new`` cannot be said by a delta, nor names holding ``#``: :class:`SyncError` (the
    caller sends ``new`` whole then)."""
    if set(base) - set(new):
        raise SyncError(f"tensors gone since the base: {sorted(set(base) - set(new))[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in new.items():
        if "#" in name:
            raise SyncError(f"tensor name {name!r} holds '#', the delta's separator")
        out.update(_encode_one(name, tensor, base.get(name)))
    return out


def _decode_one(
    name: str, base: torch.Tensor, delta: Mapping[str, torch.Tensor], what: str
) -> torch.Tensor:
    values = delta[name + VAL]
    if values.dtype != base.dtype or values.dim() != 1:
        raise IntegrityError(
            f"{what}: {name}{VAL} ({values.dtype}, {values.dim()}-d) does not fit {name} "
            f"({base.dtype})"
        )
    out = base.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    if name + IDX in delta:
        index = delta[name + IDX]
        if index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
            raise IntegrityError(f"{what}: {name}{IDX} ({index.dtype}) does not fit {name}")
        index = index.to(torch.int64)
        if index.numel() != values.numel() or (
            index.numel() and (int(index.min()) < 0 or int(index.max()) >= flat.numel())
        ):
            raise IntegrityError(f"{what}: {name}{IDX} does not fit {name}")
        flat[index] = values
        return out
    mask = delta[name + MASK]
    if mask.dtype != torch.uint8 or mask.shape != ((flat.numel() + 7) // 8,):
        raise IntegrityError(f"{what}: {name}{MASK} does not fit {name}")
    changed = unpack_mask(mask, flat.numel())
    if int(torch.count_nonzero(changed)) != values.numel():
        raise IntegrityError(f"{what}: {name}{MASK} does not fit {name}{VAL}")
    flat[changed] = values
    return out


def decode(
    delta: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], what: str = "delta"
) -> dict[str, torch.Tensor]:
    """The state ``delta`` makes of ``base``; ``base`` is never written (unchanged tensors
    are shared with it, changed ones are new). A delta that does not fit the base raises
    :class:`IntegrityError`."""
    names = {key.partition("#")[0] for key in delta}
    unknown = names - set(base) - {k for k in delta if "#" not in k}
    if unknown:
        raise IntegrityError(f"{what}: tensors not in the base: {sorted(unknown)[:5]}")
    out = dict(base)
    for name in names:
        if name in delta:
            out[name] = delta[name]
        elif name + VAL in delta and (name + IDX in delta) != (name + MASK in delta):
            out[name] = _decode_one(name, base[name], delta, what)
        else:
            raise IntegrityError(f"{what}: entries of {name} are incomplete")
    return out


def state_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a whole state: of one line per tensor in name order, its name, dtype,
    shape and the sha256 of its bytes (those hashed in parallel: hashlib releases the GIL)."""
    names = sorted(tensors)
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="state-sha256") as pool:
        digests = pool.map(sha256_hex, [tensors[n] for n in names])
        lines = [
            f"{n}|{str(tensors[n].dtype).removeprefix('torch.')}|{list(tensors[n].shape)}|{d}\n"
            for n, d in zip(names, digests, strict=True)
        ]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def verify_state(tensors: Mapping[str, torch.Tensor], expected: str, what: str) -> None:
    """Raise :class:`IntegrityError` unless ``tensors`` are the state whose digest is
    ``expected``."""
    actual = state_sha256(tensors)
    if actual != expected:
        raise IntegrityError(
            f"{what}: the state's sha256 {actual[:16]}... is not the announced {expected[:16]}..."
        )
