"""A gate in front of the embedded broker on ``s3://`` storage, so a restart loses nothing.

Tansu on ``s3://`` storage over the local S3 server has one dangerous moment: after a
restart, the first produce to a partition it has not read yet starts again at offset 0
and overwrites the records there (it loads a partition's high watermark on its first
fetch; its first produce relies on a conditional write that the local S3 server does not
enforce). Seen here: 165 acknowledged records gone after a restart under load.

So clients never talk to that broker directly. :class:`BrokerGate` listens on the
broker's public (advertised) port and relays every connection to the broker's private
port. When the broker goes down the gate closes (client connections are dropped, as a
dead broker would drop them); when it is back, :func:`warm_partitions` fetches from every
partition over a private connection, and only then does the gate open again. Clients see
a broker that was down a little longer, never one that forgets.

The two Kafka requests here are written by hand (Metadata v0, Fetch v4) because the
warm-up must not follow the broker's advertised address: that is the closed gate.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

from streamrft.schemas.errors import ServiceError

_CLIENT_ID = b"streamrft-gate"
_BUFFER = 1 << 20


# --------------------------------------------------------------------------- wire


def _request(sock: socket.socket, api_key: int, version: int, body: bytes, cid: int) -> bytes:
    header = struct.pack(">hhih", api_key, version, cid, len(_CLIENT_ID)) + _CLIENT_ID
    payload = header + body
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    (size,) = struct.unpack(">i", _recv(sock, 4))
    data = _recv(sock, size)
    (got,) = struct.unpack_from(">i", data, 0)
    if got != cid:
        raise ConnectionError(f"bad correlation id {got} (sent {cid})")
    return data[4:]


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return bytes(buf)


def _string(data: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from(">h", data, pos)
    pos += 2
    return data[pos : pos + n].decode(), pos + max(n, 0)


def topic_partitions(sock: socket.socket) -> dict[str, int]:
    """Every topic and its partition count (a Metadata v0 request)."""
    data = _request(sock, 3, 0, struct.pack(">i", 0), 0x6A7E)
    pos = 0
    (n_brokers,) = struct.unpack_from(">i", data, pos)
    pos += 4
    for _ in range(n_brokers):
        pos += 4  # node id
        _, pos = _string(data, pos)
        pos += 4  # port
    (n_topics,) = struct.unpack_from(">i", data, pos)
    pos += 4
    out: dict[str, int] = {}
    for _ in range(n_topics):
        pos += 2  # error code
        name, pos = _string(data, pos)
        (n_parts,) = struct.unpack_from(">i", data, pos)
        pos += 4
        for _ in range(n_parts):
            pos += 2 + 4 + 4  # error, partition, leader
            for _ in range(2):  # replicas, isr
                (k,) = struct.unpack_from(">i", data, pos)
                pos += 4 + 4 * k
        out[name] = n_parts
    return out


def fetch_once(sock: socket.socket, topic: str, partitions: int, cid: int) -> None:
    """A Fetch v4 from offset 0 of every partition of ``topic`` (the reply is not needed,
    only that the broker served it: that loads each partition's watermark)."""
    name = topic.encode()
    parts = b"".join(struct.pack(">iqi", p, 0, 1 << 20) for p in range(partitions))
    body = struct.pack(">iiiib", -1, 100, 1, 64 << 20, 0)  # max wait, min bytes: a real read
    body += struct.pack(">i", 1) + struct.pack(">h", len(name)) + name
    body += struct.pack(">i", partitions) + parts
    _request(sock, 1, 4, body, cid)


def warm_partitions(port: int, timeout_s: float = 30.0) -> int:
    """Fetch once from every partition of the broker on ``127.0.0.1:port``; returns how
    many partitions were warmed. Retries until the broker answers, for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
                sock.settimeout(10.0)
                topics = topic_partitions(sock)
                for cid, (topic, n) in enumerate(sorted(topics.items()), start=1):
                    fetch_once(sock, topic, n, cid)
                return sum(topics.values())
        except (OSError, ConnectionError, struct.error) as exc:
            if time.monotonic() > deadline:
                raise ServiceError(f"broker warm-up on port {port} failed: {exc}") from exc
            time.sleep(0.1)


# --------------------------------------------------------------------------- the gate


class BrokerGate:
    """A TCP relay from ``127.0.0.1:public_port`` to the broker's private port.

    Closed: new connections are accepted and dropped at once, open ones are cut.
    Open: each connection is relayed byte for byte by two threads.
    """

    def __init__(self, public_port: int) -> None:
        self.public_port = public_port
        self.target_port: int | None = None
        self._listener = socket.create_server(("127.0.0.1", public_port), backlog=128)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopped = False
        self._accepting = threading.Thread(target=self._accept, name="broker-gate", daemon=True)
        self._accepting.start()

    @property
    def is_open(self) -> bool:
        return self.target_port is not None

    def open(self, target_port: int) -> None:
        with self._lock:
            self.target_port = target_port

    def close(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            self.target_port = None
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.close()

    def stop(self) -> None:
        self._stopped = True
        self.close()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                target = self.target_port
            if target is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", target), timeout=5.0)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self.target_port != target:  # closed meanwhile
                    client.close()
                    upstream.close()
                    continue
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_BUFFER)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
