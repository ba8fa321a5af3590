"""State dicts to verified safetensors shards and back. Pure apart from torch.

No pickle: shards are safetensors, the manifest is JSON (see ``schemas.manifest``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load

from streamrft.schemas.errors import IntegrityError, SyncError


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state's tensor data."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sha256_hex(data: bytes | bytearray | memoryview | torch.Tensor) -> str:
    """sha256 of bytes, or of a tensor's raw bytes."""
    if isinstance(data, torch.Tensor):
        data = tensor_bytes(data)
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


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors without tied aliases, detached, where they are: no copy."""
    aliases = shared_aliases(model)
    return {k: v.detach() for k, v in model.state_dict().items() if k not in aliases}


def snapshot_tensors(
    live: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    keep_dtype: Callable[[str], bool] = lambda name: False,
) -> dict[str, torch.Tensor]:
    """Host copies of ``live``, floating ones in ``dtype`` when given, except those
    ``keep_dtype`` names (the cast is the
    copy: one pass), written into ``buffers`` where a buffer of the same name, shape and
    dtype is there (so a snapshot taken every version allocates nothing after the first),
    else into a new one: pinned memory for a tensor on a GPU, whose copy is then
    asynchronous until the one synchronisation at the end."""
    out: dict[str, torch.Tensor] = {}
    devices = set()
    for name, tensor in live.items():
        cast = dtype is not None and tensor.is_floating_point() and not keep_dtype(name)
        want = dtype if cast else tensor.dtype
        buf = buffers.get(name) if buffers is not None else None
        if buf is None or buf.shape != tensor.shape or buf.dtype != want:
            buf = torch.empty(tensor.shape, dtype=want, pin_memory=tensor.is_cuda)
        buf.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            devices.add(tensor.device)
        out[name] = buf
    for device in devices:  # every GPU the copies came from, not only the current one
        torch.cuda.synchronize(device)
    return out


def tensors_dtype(tensors: Mapping[str, torch.Tensor]) -> str:
    """The one floating dtype of ``tensors`` (``bfloat16``...), ``mixed``, or ``""`` (none)."""
    kinds = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "")


_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in (
        ("F64", "float64"),
        ("F32", "float32"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U64", "uint64"),
        ("U32", "uint32"),
        ("U16", "uint16"),
        ("U8", "uint8"),
        ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("C64", "complex64"),
    )
    if hasattr(torch, attr)
}
"""safetensors dtype names -> torch dtypes (those this torch has)."""
_ST_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw (little-endian) bytes of a tensor: a view of its memory, no copy unless it
    is not contiguous or not on the CPU. The view keeps the tensor alive."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def safetensors_header(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """The head of a safetensors file whose data is ``tensors``' bytes in this order: the
    8-byte little-endian length, then the JSON header padded with spaces so that the data
    starts 8-byte aligned (as the safetensors library writes it)."""
    header, offset = {}, 0
    for name, tensor in tensors:
        if tensor.dtype not in _ST_NAMES:
            raise SyncError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _ST_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


@dataclass(frozen=True)
class Shard:
    """One safetensors file as its pieces, never joined: the header, then every tensor's
    bytes (views of the tensors' memory). Writers send the pieces one after the other."""

    names: list[str]
    """Tensor names in the order they were given (the file orders them for alignment)."""
    chunks: list[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for chunk in self.chunks:
            digest.update(chunk)  # releases the GIL on large buffers
        return digest.hexdigest()

    def to_bytes(self) -> bytes:
        return b"".join(self.chunks)


def make_shard(tensors: Mapping[str, torch.Tensor], names: list[str]) -> Shard:
    """A shard of ``names``; in the file, wider dtypes first so that every tensor's data
    is aligned to its element size (safetensors' own order)."""
    ordered = sorted(((n, tensors[n]) for n in names), key=lambda nt: -nt[1].element_size())
    chunks = [memoryview(safetensors_header(ordered))]
    chunks += [tensor_bytes(t) for _, t in ordered if t.numel()]
    return Shard(names=list(names), chunks=chunks)


def shards_of(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[Shard]:
    """``tensors`` split into safetensors shards of at most ~``max_shard_bytes`` each (a
    tensor larger than the limit gets a shard of its own). No tensor byte is copied:
    the shards hold views, so the tensors must not change until the shards are written
    (if they do, the sha256 computed at publication no longer matches what was written,
    and every reader rejects the version)."""
    groups: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not groups or size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return [make_shard(tensors, names) for names in groups]


def shard_state_dict(
    tensors: Mapping[str, torch.Tensor], max_shard_bytes: int
) -> Iterator[tuple[list[str], bytes]]:
    """:func:`shards_of`, each shard joined into one ``bytes`` (a safetensors file)."""
    for shard in shards_of(tensors, max_shard_bytes):
        yield shard.names, shard.to_bytes()


def verify(
    data: bytes | bytearray | torch.Tensor, expected_sha256: str, what: str, actual: str = ""
) -> None:
    """Raise :class:`IntegrityError` unless ``data`` (or its known digest) matches."""
    actual = actual or sha256_hex(data)
    if actual != expected_sha256:
        raise IntegrityError(
            f"{what}: sha256 {actual[:16]}... does not match the manifest's "
            f"{expected_sha256[:16]}...; refusing to apply it"
        )


def decode_shard(data: bytes | bytearray | torch.Tensor, what: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in memory.

    A ``bytearray`` or a uint8 tensor (what the stores download into; on any device: only
    the header is read to the host) is decoded without copying: every tensor is a view of
    the buffer (a copy only for data that is not aligned to its element size). ``bytes`` go
    through the safetensors library.
    """
    if isinstance(data, bytes):
        try:
            return st_load(data)
        except Exception as exc:  # safetensors raises its own SafetensorError and others
            raise IntegrityError(f"{what}: not a valid safetensors file: {exc}") from exc
    try:
        buf = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or len(buf) < 10:
            raise ValueError(f"not a byte buffer of at least 10 bytes ({buf.dtype}, {buf.shape})")
        n = int.from_bytes(buf[:8].cpu().numpy().tobytes(), "little")
        if not 2 <= n <= len(buf) - 8:
            raise ValueError(f"header length {n} out of range")
        header = json.loads(buf[8 : 8 + n].cpu().numpy().tobytes())
        base = 8 + n
        return {
            name: _tensor_at(buf[base:], name, info)
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise IntegrityError(f"{what}: not a valid safetensors file: {exc}") from exc


def _tensor_at(data: torch.Tensor, name: str, info: dict) -> torch.Tensor:
    """The tensor ``info`` (one header entry) describes, a view of ``data`` (the bytes
    after the header) when its offset is aligned to its element size."""
    start, end = info["data_offsets"]
    dtype = _DTYPES[info["dtype"]]
    shape = [int(d) for d in info["shape"]]
    itemsize = dtype.itemsize
    if not 0 <= start <= end <= len(data) or end - start != math.prod(shape) * itemsize:
        raise ValueError(f"{name}: data offsets {start}..{end} do not fit {shape} {dtype}")
    raw = data[start:end]
    if (raw.storage_offset() % itemsize) != 0:
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def checked_image(
    buf: torch.Tensor,
    digest: str,
    expected: str,
    what: str,
    like: Mapping[str, torch.Tensor],
    why: str,
) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors image in ``buf`` (views of it) once ``digest`` (what
    the receiver computed as it copied) is the event's ``expected`` and, when ``like`` is
    given, they fit the model's names and shapes; else an :class:`IntegrityError` naming
    ``why`` a mismatch may come (a same-host copy: the slot rewritten while read)."""
    if digest != expected:
        raise IntegrityError(
            f"{what}: digest {digest[:16]}... does not match the event's "
            f"{expected[:16]}... ({why}); refusing to apply it"
        )
    tensors = decode_shard(buf, what)
    if like:  # the model's names and shapes, before any copy
        check_fits(like, tensors, what, error=IntegrityError)
    return tensors


FILE_SLACK = 64 << 10
"""Bytes a version's files may hold beyond its tensors, at most: safetensors headers."""
TENSOR_SLACK = 2048
"""And per tensor of the model: its names and offsets in a header (three for a delta's
indices, mask and values)."""


def largest_version(own: Mapping[str, torch.Tensor]) -> int:
    """The most bytes a version of a model whose tensors are ``own`` can announce: its
    tensors (a delta is never larger: each tensor goes whole when that is smaller) plus the
    headers. An event announcing more is refused before anything is allocated."""
    return nbytes(own) + FILE_SLACK + TENSOR_SLACK * len(own)


def check_fits(
    own: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    what: str,
    optional: AbstractSet[str] = frozenset(),
    hint: str = "",
    error: type[SyncError] = SyncError,
) -> None:
    """Raise ``error`` unless ``tensors`` have every name of ``own`` (but the ``optional``
    ones), no other, and ``own``'s shapes."""
    missing = set(own) - set(optional) - set(tensors)
    unexpected = set(tensors) - set(own)
    if missing or unexpected:
        raise error(
            f"{what} do not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}{hint}"
        )
    for name, tensor in tensors.items():
        if own[name].shape != tensor.shape:
            raise error(
                f"{what} do not fit the model: {name} is {tuple(tensor.shape)}, "
                f"model has {tuple(own[name].shape)}{hint}"
            )


@torch.no_grad()
def copy_into(
    own: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    what: str,
    optional: AbstractSet[str] = frozenset(),
    hint: str = "",
) -> None:
    """Copy ``tensors`` into the live tensors ``own`` (views of a model) in place.

    Every name of ``own`` but the ``optional`` ones must come, none may be extra, and
    shapes must agree; all of it is checked before the first copy (:func:`check_fits`),
    so a mismatch raises :class:`SyncError` and leaves the model exactly as it was.
    Into a GPU, copies from pinned host memory (a staging copy) or from the GPU are queued
    without waiting, then waited for once: when it returns, ``tensors`` may be reused.
    """
    check_fits(own, tensors, what, optional, hint)
    devices = set()
    for name, tensor in tensors.items():
        dst = own[name]
        if dst.is_cuda:
            devices.add(dst.device)
            dst.copy_(tensor, non_blocking=tensor.is_cuda or tensor.is_pinned())
        else:
            dst.copy_(tensor)
    for device in devices:
        torch.cuda.synchronize(device)


def apply_state_dict(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model`` in place; every non-alias tensor must be present."""
    copy_into(model.state_dict(), tensors, "weights", optional=shared_aliases(model))
