"""Raw little-endian arrays on the wire.

Token ids travel as int32, log-probs as float32 and masks as uint8, each as plain bytes, so
a group of thousands of tokens is one memcpy to decode, not a list of Python numbers.
Only the standard library is used; torch/numpy users call ``frombuffer`` on the bytes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_LITTLE = sys.byteorder == "little"


def _pack(typecode: str, values: Iterable[float] | Iterable[int]) -> bytes:
    arr = array(typecode, values)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def _unpack(typecode: str, data: bytes) -> array:
    arr = array(typecode)
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr


def pack_i32(values: Iterable[int]) -> bytes:
    """Token ids to int32 little-endian bytes."""
    return _pack("i", values)


def unpack_i32(data: bytes) -> list[int]:
    return _unpack("i", data).tolist()


def pack_f32(values: Iterable[float]) -> bytes:
    """Log-probs (or any float series) to float32 little-endian bytes."""
    return _pack("f", values)


def unpack_f32(data: bytes) -> list[float]:
    return _unpack("f", data).tolist()


def pack_u8(values: Iterable[int]) -> bytes:
    """A 0/1 mask to one byte per element."""
    return bytes(values)


def unpack_u8(data: bytes) -> list[int]:
    return list(data)
