"""A gate in front of the embedded broker on ``s3://`` storage, so that it loses nothing.

Tansu's S3 engine keeps each partition's high watermark in an object that it updates with
conditional writes; the local S3 server (the JuiceFS gateway) does not enforce them. Two
ways that loses acknowledged records, both seen here:

- **Concurrent producers.** Two produce requests for one partition in flight at once can
  get the same offset, and the later batch overwrites the earlier: 4 producers sending
  single events to one partition lost 173 of 459 acknowledged records, with no restart.
- **A restart.** The restarted broker's first produce to a partition it has not read yet
  starts again at offset 0 (it loads a partition's watermark on its first fetch): 165 of
  300 acknowledged records gone after one restart under load.

So clients never talk to that broker directly. :class:`BrokerGate` listens on the
broker's public (advertised) port and relays every connection, frame by frame, to the
broker's private port. It lets **one produce request at a time** into the broker (a produce
waits until the previous one's response has gone back). When the broker goes down the
gate closes (connections are dropped, as a dead broker drops them); when it is back,
:func:`warm_partitions` reads every non-empty partition once over a private connection,
and only then does the gate open again. The same two experiments then lose 0 records.
The price: produce requests are serialised (this is a durability mode for tests and
single-machine runs, not the fast path), and the relay costs a thread pair per connection.

The Kafka requests here are written by hand (Metadata v0, ListOffsets v1, Fetch v4)
because the warm-up must not follow the broker's advertised address: that is the gate.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
import time

from streamrft.schemas.errors import ServiceError

_CLIENT_ID = b"streamrft-gate"
FETCH_WAIT_MS = 5000
ORPHAN_WAIT_S = 60.0
"""How long a produce whose client went away may keep the produce lock, waiting for the
broker's answer (aiokafka gives up on a request after 30 s)."""
_MAX_FRAME = 256 << 20


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
        (error,) = struct.unpack_from(">h", data, pos)
        pos += 2
        name, pos = _string(data, pos)
        if error:
            raise ConnectionError(f"metadata of topic {name!r}: error code {error}")
        (n_parts,) = struct.unpack_from(">i", data, pos)
        pos += 4
        for _ in range(n_parts):
            pos += 2 + 4 + 4  # error, partition, leader
            for _ in range(2):  # replicas, isr
                (k,) = struct.unpack_from(">i", data, pos)
                pos += 4 + 4 * k
        out[name] = n_parts
    return out


def end_offsets(sock: socket.socket, topic: str, partitions: int, cid: int) -> list[int]:
    """The log end offset of each partition (a ListOffsets v1 request for "latest")."""
    name = topic.encode()
    body = struct.pack(">i", -1) + struct.pack(">i", 1) + struct.pack(">h", len(name)) + name
    body += struct.pack(">i", partitions)
    body += b"".join(struct.pack(">iq", p, -1) for p in range(partitions))
    data = _request(sock, 2, 1, body, cid)
    ends = [0] * partitions
    pos = 4  # one topic
    _, pos = _string(data, pos)
    (n,) = struct.unpack_from(">i", data, pos)
    pos += 4
    for _ in range(n):
        partition, error, _ts, offset = struct.unpack_from(">ihqq", data, pos)
        pos += 22
        if error or offset < 0:  # not loaded yet: better to retry than to guess "empty"
            raise ConnectionError(f"end offset of {topic}[{partition}]: error code {error}")
        if 0 <= partition < partitions:
            ends[partition] = offset
    return ends


def fetch_once(sock: socket.socket, topic: str, partition: int, offset: int, cid: int) -> None:
    """A Fetch v4 of one partition from ``offset`` that waits for data (the reply is not
    needed, only that the broker read its storage: that loads the partition's watermark).
    On s3 storage a fetch given too little time reads nothing, so it may wait 5 s."""
    name = topic.encode()
    body = struct.pack(">iiiib", -1, FETCH_WAIT_MS, 1, 1 << 20, 0)
    body += struct.pack(">i", 1) + struct.pack(">h", len(name)) + name
    body += struct.pack(">i", 1) + struct.pack(">iqi", partition, offset, 1 << 20)
    _request(sock, 1, 4, body, cid)


def warm_partitions(port: int, timeout_s: float = 30.0) -> int:
    """Fetch once from every non-empty partition of the broker on ``127.0.0.1:port``;
    returns how many. Retries until the broker answers, for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
                sock.settimeout(FETCH_WAIT_MS / 1000 + 10.0)
                warmed, cid = 0, 1
                for topic, n in sorted(topic_partitions(sock).items()):
                    ends = end_offsets(sock, topic, n, cid)
                    for partition, end in enumerate(ends):
                        cid += 1
                        if end > 0:
                            fetch_once(sock, topic, partition, end - 1, cid)  # the last record
                            warmed += 1
                return warmed
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
        self._produce_lock = threading.Lock()
        """One produce request in the broker at a time (see the module docstring)."""
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
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._accepting.join(5.0)

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
            client.settimeout(None)
            with self._lock:
                if self.target_port != target:  # closed meanwhile
                    client.close()
                    upstream.close()
                    continue
                self._conns.update((client, upstream))
            link = _Link()
            threading.Thread(
                target=self._requests, args=(client, upstream, link), daemon=True
            ).start()
            threading.Thread(
                target=self._responses, args=(upstream, client, link), daemon=True
            ).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, link: _Link) -> None:
        """Client to broker, frame by frame; a produce waits for the produce lock."""
        try:
            while True:
                frame = _read_frame(client)
                if frame is None:
                    break
                api_key, corr = struct.unpack_from(">hxxi", frame, 4)
                serial = api_key == _PRODUCE and _expects_response(frame)
                if serial:
                    self._produce_lock.acquire()
                link.sent(corr, serial)
                upstream.sendall(frame)
        except (OSError, struct.error):
            pass
        finally:
            # a produce still inside the broker keeps the lock until the broker answers
            # (or goes away): releasing it now would let another produce run beside it
            link.settled.wait(ORPHAN_WAIT_S)
            self._hang_up(client, upstream, link)

    def _responses(self, upstream: socket.socket, client: socket.socket, link: _Link) -> None:
        """Broker to client, frame by frame; a produce's response frees the produce lock."""
        try:
            while True:
                frame = _read_frame(upstream)
                if frame is None:
                    break
                (corr,) = struct.unpack_from(">i", frame, 4)
                if link.answered(corr):  # the broker is done with it, client there or not
                    self._produce_lock.release()
                client.sendall(frame)
        except (OSError, struct.error):
            pass
        finally:
            self._hang_up(client, upstream, link)

    def _hang_up(self, client: socket.socket, upstream: socket.socket, link: _Link) -> None:
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if link.drop():  # a produce of this connection will never be answered now
            self._produce_lock.release()
        with self._lock:
            self._conns.discard(client)
            self._conns.discard(upstream)
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.close()


_PRODUCE = 0


class _Link:
    """The requests of one client connection awaiting their responses, in order (Kafka
    answers a connection's requests in the order they were sent)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[int, bool]] = collections.deque()
        self._holding = False
        self.settled = threading.Event()
        """Set while this connection holds no produce lock."""
        self.settled.set()

    def sent(self, corr: int, holds_produce_lock: bool) -> None:
        with self._lock:
            self._pending.append((corr, holds_produce_lock))
            if holds_produce_lock:
                self._holding = True
                self.settled.clear()

    def answered(self, corr: int) -> bool:
        """Whether this response (or one it implies was skipped) frees the produce lock."""
        with self._lock:
            frees = False
            while self._pending:
                got, holds = self._pending.popleft()
                frees = frees or holds
                if got == corr:
                    break
            if frees:
                self._holding = False
                self.settled.set()
            return frees

    def drop(self) -> bool:
        """On hang-up: whether this connection still held the produce lock (once)."""
        with self._lock:
            holding, self._holding = self._holding, False
            self._pending.clear()
            self.settled.set()
            return holding


def _read_frame(sock: socket.socket) -> bytes | None:
    """One size-prefixed Kafka frame (prefix included), or None at end of stream."""
    head = _read_exactly(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">i", head)
    if size < 4 or size > _MAX_FRAME:
        raise OSError(f"bad Kafka frame size {size}")
    body = _read_exactly(sock, size)
    return None if body is None else head + body


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _expects_response(frame: bytes) -> bool:
    """A produce request with acks != 0 (acks=0 gets no response); unparsed: True."""
    try:
        return _produce_acks(frame) != 0
    except struct.error:
        return True


def _produce_acks(frame: bytes) -> int:
    version = struct.unpack_from(">h", frame, 6)[0]
    pos = 4 + 8
    (client_len,) = struct.unpack_from(">h", frame, pos)
    pos += 2 + max(client_len, 0)
    if version >= 3:  # transactional_id (nullable string) comes first
        (tx_len,) = struct.unpack_from(">h", frame, pos)
        pos += 2 + max(tx_len, 0)
    (acks,) = struct.unpack_from(">h", frame, pos)
    return acks
