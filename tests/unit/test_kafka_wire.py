"""The hand-written Kafka wire code: framing over a real socket pair, request encoding,
response parsing (checked against byte layouts written out here field by field)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from streamrft.infra.local import kafka_wire

pytestmark = pytest.mark.unit


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5.0)
    b.settimeout(5.0)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def _frame(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


def _answer(sock: socket.socket, correlation_id: int, body: bytes) -> threading.Thread:
    """Play the broker: read one request frame, answer it with ``correlation_id``."""

    def run() -> None:
        kafka_wire.read_frame(sock)
        sock.sendall(_frame(struct.pack(">i", correlation_id) + body))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# --------------------------------------------------------------------------- framing


def test_read_exactly_joins_pieces_and_reports_end_of_stream(pair) -> None:
    a, b = pair
    b.sendall(b"abc")
    b.sendall(b"defg")
    assert kafka_wire.read_exactly(a, 5) == b"abcde"
    assert kafka_wire.read_exactly(a, 0) == b""
    b.shutdown(socket.SHUT_WR)
    assert kafka_wire.read_exactly(a, 3) is None  # only "fg" left
    assert kafka_wire.read_exactly(a, 1) is None


def test_read_frame_returns_whole_frames_prefix_included(pair) -> None:
    a, b = pair
    big = bytes(range(256)) * 8192  # 2 MiB: more than one recv
    one, two = _frame(b"\x00\x00\x00\x07hello"), _frame(big)
    writer = threading.Thread(target=b.sendall, args=(one + two,), daemon=True)
    writer.start()
    assert kafka_wire.read_frame(a) == one
    assert kafka_wire.read_frame(a) == two
    writer.join(5.0)
    b.sendall(struct.pack(">i", 10) + b"cut")  # the stream ends inside a frame
    b.shutdown(socket.SHUT_WR)
    assert kafka_wire.read_frame(a) is None


@pytest.mark.parametrize("size", [-1, 0, 3, kafka_wire.MAX_FRAME + 1])
def test_read_frame_refuses_a_bad_size(pair, size: int) -> None:
    a, b = pair
    b.sendall(struct.pack(">i", size) + b"\x00" * 8)
    with pytest.raises(ConnectionError, match=f"bad Kafka frame size {size}"):
        kafka_wire.read_frame(a)


# --------------------------------------------------------------------------- requests


def test_encode_request_writes_header_v1() -> None:
    frame = kafka_wire.encode_request(3, 0, 0x01020304, b"me", b"BODY")
    payload = struct.pack(">hhi", 3, 0, 0x01020304) + _s("me") + b"BODY"
    assert frame == struct.pack(">i", len(payload)) + payload
    assert kafka_wire.request_header(frame) == (3, 0x01020304)


def test_request_returns_the_body_after_the_correlation_id(pair) -> None:
    a, b = pair
    t = _answer(b, 42, b"answer")
    got = kafka_wire.request(a, 18, 0, b"", correlation_id=42, client_id=b"c")
    t.join(5.0)
    assert got == b"answer"


def test_request_refuses_a_response_to_another_request(pair) -> None:
    a, b = pair
    t = _answer(b, 41, b"answer")
    with pytest.raises(ConnectionError, match="bad correlation id 41 \\(sent 42\\)"):
        kafka_wire.request(a, 18, 0, b"", correlation_id=42, client_id=b"c")
    t.join(5.0)


def test_request_reports_a_closed_connection(pair) -> None:
    a, b = pair
    b.close()
    with pytest.raises(OSError):  # ConnectionError, or EPIPE from sendall
        kafka_wire.request(a, 18, 0, b"", correlation_id=1, client_id=b"c")


def test_metadata_v0_response_is_parsed() -> None:
    def partition(pid: int, replicas: list[int], isr: list[int]) -> bytes:
        out = struct.pack(">hii", 0, pid, 1)
        for nodes in (replicas, isr):
            out += struct.pack(">i", len(nodes)) + b"".join(struct.pack(">i", n) for n in nodes)
        return out

    data = struct.pack(">i", 2)
    data += struct.pack(">i", 1) + _s("127.0.0.1") + struct.pack(">i", 9092)
    data += struct.pack(">i", 2) + _s("localhost") + struct.pack(">i", 9093)
    data += struct.pack(">i", 3)
    data += struct.pack(">h", 0) + _s("a") + struct.pack(">i", 2)
    data += partition(0, [1, 2], [1]) + partition(1, [], [])
    data += struct.pack(">h", 0) + _s("bb") + struct.pack(">i", 1) + partition(0, [1], [1, 2])
    data += struct.pack(">h", 5) + _s("sick") + struct.pack(">i", 0)
    meta = kafka_wire.parse_metadata(data)
    assert meta.brokers == [("127.0.0.1", 9092), ("localhost", 9093)]
    assert meta.partitions == {"a": 2, "bb": 1, "sick": 0}
    assert meta.topic_errors == {"sick": 5}
    with pytest.raises(struct.error):
        kafka_wire.parse_metadata(data[:-3])


def test_metadata_round_trip_over_a_socket(pair) -> None:
    a, b = pair
    body = struct.pack(">i", 1) + struct.pack(">i", 0) + _s("h") + struct.pack(">ii", 7, 0)
    seen: list[bytes] = []

    def broker() -> None:
        frame = kafka_wire.read_frame(b)
        assert frame is not None
        seen.append(frame)
        b.sendall(_frame(frame[8:12] + body))  # echo the correlation id

    t = threading.Thread(target=broker, daemon=True)
    t.start()
    meta = kafka_wire.metadata(a, correlation_id=99, client_id=b"probe")
    t.join(5.0)
    assert meta == kafka_wire.Metadata([("h", 7)], {}, {})
    # Metadata v0 for all topics: an empty topic array
    assert seen == [kafka_wire.encode_request(3, 0, 99, b"probe", struct.pack(">i", 0))]


def test_list_offsets_v1_request_and_response() -> None:
    body = kafka_wire.list_offsets_request("tp", 2)
    assert body == (
        struct.pack(">ii", -1, 1)
        + _s("tp")
        + struct.pack(">i", 2)
        # partition, timestamp -1 = latest
        + struct.pack(">iq", 0, -1)
        + struct.pack(">iq", 1, -1)
    )
    reply = struct.pack(">i", 1) + _s("tp") + struct.pack(">i", 2)
    reply += struct.pack(">ihqq", 1, 0, -1, 17) + struct.pack(">ihqq", 0, 0, -1, 3)
    assert kafka_wire.parse_list_offsets(reply, "tp", 2) == [3, 17]
    not_loaded = struct.pack(">i", 1) + _s("tp") + struct.pack(">i", 1)
    not_loaded += struct.pack(">ihqq", 0, 0, -1, -1)
    with pytest.raises(ConnectionError, match=r"end offset of tp\[0\]: error code 0"):
        kafka_wire.parse_list_offsets(not_loaded, "tp", 1)
    failed = struct.pack(">i", 1) + _s("tp") + struct.pack(">i", 1)
    failed += struct.pack(">ihqq", 0, 3, -1, 5)
    with pytest.raises(ConnectionError, match="error code 3"):
        kafka_wire.parse_list_offsets(failed, "tp", 1)


def test_fetch_v4_request() -> None:
    body = kafka_wire.fetch_request("tp", 3, 41, 5000)
    assert body == (
        struct.pack(">iiiib", -1, 5000, 1, 1 << 20, 0)  # replica, wait, min/max bytes, isolation
        + struct.pack(">i", 1)
        + _s("tp")
        + struct.pack(">i", 1)
        + struct.pack(">iqi", 3, 41, 1 << 20)
    )


# --------------------------------------------------------------------------- produce acks


def _produce(version: int, acks: int, transactional_id: str | None = None) -> bytes:
    body = b""
    if version >= 3:
        body += struct.pack(">h", -1) if transactional_id is None else _s(transactional_id)
    body += struct.pack(">hi", acks, 30000) + struct.pack(">i", 0)  # acks, timeout, no topics
    return kafka_wire.encode_request(kafka_wire.PRODUCE, version, 7, b"producer-1", body)


@pytest.mark.parametrize("version", [0, 1, 2])
@pytest.mark.parametrize("acks", [0, 1, -1])
def test_produce_acks_before_v3(version: int, acks: int) -> None:
    assert kafka_wire.produce_acks(_produce(version, acks)) == acks


@pytest.mark.parametrize("version", [3, 7, 8])
@pytest.mark.parametrize("acks", [0, 1, -1])
@pytest.mark.parametrize("transactional_id", [None, "", "tx-123"])
def test_produce_acks_from_v3_skip_the_transactional_id(
    version: int, acks: int, transactional_id: str | None
) -> None:
    assert kafka_wire.produce_acks(_produce(version, acks, transactional_id)) == acks


def test_produce_acks_of_a_cut_frame_is_an_error() -> None:
    frame = _produce(3, 0, "tx-123")
    assert kafka_wire.request_header(frame) == (kafka_wire.PRODUCE, 7)
    with pytest.raises(struct.error):
        kafka_wire.produce_acks(frame[:20])
