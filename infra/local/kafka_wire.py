"""The few pieces of Kafka's wire protocol that the local services write by hand.

Two users, both needing one exact broker port rather than the address the broker advertises:

- the readiness probe of :mod:`streamrft.infra.local.services` asks a just-started broker
  for its metadata (Metadata v0) and checks which address it advertises;
- :mod:`streamrft.infra.local.broker_gate` relays client connections frame by frame (it reads
  frames, their correlation ids and a produce request's ``acks``) and warms a restarted
  broker up over its private port (Metadata v0, ListOffsets v1, Fetch v4).

Framing: every request and response is a big-endian int32 size, then that many bytes. A
request starts with header v1 (api key, api version, correlation id, client id), a response
with its correlation id (header v0). Only these old, non-flexible versions are used, so
there are no tagged fields and no compact strings. Everything here is blocking, one request
at a time on a plain socket, and reads only the fields its callers need.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

PRODUCE = 0
FETCH = 1
LIST_OFFSETS = 2
METADATA = 3

MAX_FRAME = 256 << 20
"""The largest frame :func:`read_frame` accepts (the relay passes client batches through)."""
_CHUNK = 1 << 20
_LATEST = -1
"""ListOffsets timestamp meaning "the log end offset"."""
_NO_REPLICA = -1
"""replica_id of a consumer (not a follower broker)."""


# --------------------------------------------------------------------------- framing


def read_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from ``sock``, or None if the stream ends before them."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> bytes | None:
    """One size-prefixed frame (prefix included), or None at end of stream.

    Raises ConnectionError for a size below 4 (no room for a correlation id) or above
    :data:`MAX_FRAME`.
    """
    head = read_exactly(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">i", head)
    if size < 4 or size > MAX_FRAME:
        raise ConnectionError(f"bad Kafka frame size {size}")
    body = read_exactly(sock, size)
    return None if body is None else head + body


def encode_request(
    api_key: int, version: int, correlation_id: int, client_id: bytes, body: bytes
) -> bytes:
    """A request frame: size prefix, header v1, then ``body``."""
    payload = struct.pack(">hhih", api_key, version, correlation_id, len(client_id))
    payload += client_id + body
    return struct.pack(">i", len(payload)) + payload


def request(
    sock: socket.socket,
    api_key: int,
    version: int,
    body: bytes,
    *,
    correlation_id: int,
    client_id: bytes,
) -> bytes:
    """Send one request and read its response; returns the response after its correlation id.

    Raises ConnectionError when the connection ends first or the response carries another
    correlation id.
    """
    sock.sendall(encode_request(api_key, version, correlation_id, client_id, body))
    frame = read_frame(sock)
    if frame is None:
        raise ConnectionError("broker closed the connection")
    got = response_correlation_id(frame)
    if got != correlation_id:
        raise ConnectionError(f"bad correlation id {got} (sent {correlation_id})")
    return frame[8:]


def request_header(frame: bytes) -> tuple[int, int]:
    """The api key and correlation id of a request frame (prefix included)."""
    api_key, correlation_id = struct.unpack_from(">hxxi", frame, 4)
    return api_key, correlation_id


def response_correlation_id(frame: bytes) -> int:
    """The correlation id of a response frame (prefix included)."""
    (correlation_id,) = struct.unpack_from(">i", frame, 4)
    return correlation_id


def produce_acks(frame: bytes) -> int:
    """The ``acks`` of a Produce request frame (prefix included); struct.error if cut short."""
    r = _Reader(frame, 4)
    r.skip(2)  # api key
    version = r.int16()
    r.skip(4)  # correlation id
    r.string()  # client id
    if version >= 3:  # transactional_id (nullable string) comes first
        r.string()
    return r.int16()


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Metadata:
    """What a Metadata v0 response says, as far as the local services need it."""

    brokers: list[tuple[str, int]]
    """The advertised brokers, as (host, port)."""
    partitions: dict[str, int]
    """Each topic's partition count."""
    topic_errors: dict[str, int]
    """Topics answered with a non-zero error code, and the code."""


def parse_metadata(data: bytes) -> Metadata:
    """A Metadata v0 response body (after the correlation id)."""
    r = _Reader(data)
    brokers = []
    for _ in range(r.int32()):
        r.skip(4)  # node id
        host = r.string()
        brokers.append((host, r.int32()))
    partitions: dict[str, int] = {}
    errors: dict[str, int] = {}
    for _ in range(r.int32()):
        error = r.int16()
        name = r.string()
        n_parts = r.int32()
        for _ in range(n_parts):
            r.skip(2 + 4 + 4)  # error, partition, leader
            for _ in range(2):  # replicas, isr
                r.skip(4 * max(r.int32(), 0))
        partitions[name] = n_parts
        if error:
            errors[name] = error
    return Metadata(brokers, partitions, errors)


def metadata(sock: socket.socket, *, correlation_id: int, client_id: bytes) -> Metadata:
    """Every broker and topic the broker knows (a Metadata v0 request for all topics)."""
    all_topics = struct.pack(">i", 0)  # an empty array means all topics in v0
    data = request(
        sock, METADATA, 0, all_topics, correlation_id=correlation_id, client_id=client_id
    )
    return parse_metadata(data)


def list_offsets_request(topic: str, partitions: int) -> bytes:
    """A ListOffsets v1 body asking for the log end offset of partitions 0..n-1 of a topic."""
    body = struct.pack(">ii", _NO_REPLICA, 1) + _string(topic)
    body += struct.pack(">i", partitions)
    body += b"".join(struct.pack(">iq", p, _LATEST) for p in range(partitions))
    return body


def parse_list_offsets(data: bytes, topic: str, partitions: int) -> list[int]:
    """A ListOffsets v1 response body for one topic: the offset of each partition.

    Raises ConnectionError for a partition answered with an error or no offset (a broker
    that has not loaded it yet: better to ask again than to guess "empty").
    """
    r = _Reader(data)
    r.skip(4)  # one topic
    r.string()
    ends = [0] * partitions
    for _ in range(r.int32()):
        partition, error = r.int32(), r.int16()
        r.skip(8)  # timestamp
        offset = r.int64()
        if error or offset < 0:
            raise ConnectionError(f"end offset of {topic}[{partition}]: error code {error}")
        if 0 <= partition < partitions:
            ends[partition] = offset
    return ends


def end_offsets(
    sock: socket.socket, topic: str, partitions: int, *, correlation_id: int, client_id: bytes
) -> list[int]:
    """The log end offset of each partition of ``topic`` (a ListOffsets v1 request)."""
    body = list_offsets_request(topic, partitions)
    data = request(sock, LIST_OFFSETS, 1, body, correlation_id=correlation_id, client_id=client_id)
    return parse_list_offsets(data, topic, partitions)


def fetch_request(topic: str, partition: int, offset: int, wait_ms: int) -> bytes:
    """A Fetch v4 body: up to 1 MiB of one partition from ``offset``, waiting up to
    ``wait_ms`` for at least one byte (read uncommitted)."""
    max_bytes = 1 << 20
    body = struct.pack(">iiiib", _NO_REPLICA, wait_ms, 1, max_bytes, 0)
    body += struct.pack(">i", 1) + _string(topic)
    body += struct.pack(">i", 1) + struct.pack(">iqi", partition, offset, max_bytes)
    return body


def fetch(
    sock: socket.socket,
    topic: str,
    partition: int,
    offset: int,
    wait_ms: int,
    *,
    correlation_id: int,
    client_id: bytes,
) -> bytes:
    """A Fetch v4 of one partition; returns the response body unparsed."""
    body = fetch_request(topic, partition, offset, wait_ms)
    return request(sock, FETCH, 4, body, correlation_id=correlation_id, client_id=client_id)


# --------------------------------------------------------------------------- primitives


def _string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">h", len(raw)) + raw


class _Reader:
    """Big-endian fields read one after another from ``data`` (struct.error past its end)."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self._data = data
        self._pos = pos

    def _unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def int16(self) -> int:
        return self._unpack(">h")

    def int32(self) -> int:
        return self._unpack(">i")

    def int64(self) -> int:
        return self._unpack(">q")

    def skip(self, n: int) -> None:
        if n < 0 or self._pos + n > len(self._data):
            raise struct.error(f"need {n} bytes at {self._pos}, have {len(self._data)}")
        self._pos += n

    def string(self) -> str:
        """A (nullable) string; null reads as ""."""
        n = max(self.int16(), 0)
        self.skip(n)
        return self._data[self._pos - n : self._pos].decode()
