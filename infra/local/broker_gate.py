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
A produce still waiting for its turn when its connection is cut gives the turn up: it
never reached the broker, so no answer would ever free the lock.
The price: produce requests are serialised (this is a durability mode for tests and
single-machine runs, not the fast path), and the relay costs a thread pair per connection.

The warm-up's Kafka requests are written by hand (Metadata v0, ListOffsets v1, Fetch v4,
in :mod:`streamrft.infra.local.kafka_wire`, which also reads the relayed frames) because
the warm-up must not follow the broker's advertised address: that is the gate, still closed.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import socket
import struct
import threading
import time

from streamrft.infra.local import kafka_wire
from streamrft.schemas.errors import ServiceError

_CLIENT_ID = b"streamrft-gate"
FETCH_WAIT_MS = 5000
"""How long a warm-up fetch may wait: on s3 storage a fetch given too little time reads
nothing, and reading is the point."""
ORPHAN_WAIT_S = 60.0
"""How long a produce whose client went away may keep the produce lock, waiting for the
broker's answer (aiokafka gives up on a request after 30 s)."""


# --------------------------------------------------------------------------- warm-up


def warm_partitions(port: int, timeout_s: float = 30.0) -> int:
    """Fetch once from every non-empty partition of the broker on ``127.0.0.1:port``;
    returns how many. Retries until the broker answers, for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
                sock.settimeout(FETCH_WAIT_MS / 1000 + 10.0)
                return _warm(sock)
        except (OSError, struct.error) as exc:
            if time.monotonic() > deadline:
                raise ServiceError(f"broker warm-up on port {port} failed: {exc}") from exc
            time.sleep(0.1)


def _warm(sock: socket.socket) -> int:
    """Fetch the last record of each non-empty partition; returns how many. The replies
    are not needed, only that the broker read its storage: that loads the watermarks."""
    ids = itertools.count(1)
    meta = kafka_wire.metadata(sock, correlation_id=next(ids), client_id=_CLIENT_ID)
    if meta.topic_errors:
        raise ConnectionError(f"metadata of topics: error codes {meta.topic_errors}")
    warmed = 0
    for topic, n in sorted(meta.partitions.items()):
        ends = kafka_wire.end_offsets(
            sock, topic, n, correlation_id=next(ids), client_id=_CLIENT_ID
        )
        for partition, end in enumerate(ends):
            if end > 0:
                kafka_wire.fetch(
                    sock,
                    topic,
                    partition,
                    end - 1,
                    FETCH_WAIT_MS,
                    correlation_id=next(ids),
                    client_id=_CLIENT_ID,
                )
                warmed += 1
    return warmed


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
        self._waiting = 0
        """Produce requests waiting for the produce lock (under ``_lock``)."""
        self._stopped = False
        self._accepting = threading.Thread(target=self._accept, name="broker-gate", daemon=True)
        self._accepting.start()

    @property
    def is_open(self) -> bool:
        return self.target_port is not None

    @property
    def produces_waiting(self) -> int:
        """Produce requests held back until the one in the broker is answered."""
        with self._lock:
            return self._waiting

    @property
    def produce_in_broker(self) -> bool:
        """Whether a produce request holds the produce lock now."""
        return self._produce_lock.locked()

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
                frame = kafka_wire.read_frame(client)
                if frame is None:
                    break
                api_key, corr = kafka_wire.request_header(frame)
                serial = api_key == kafka_wire.PRODUCE and _expects_response(frame)
                if serial:
                    self._wait_for_produce_lock()
                if not link.sent(corr, serial):
                    # hung up while this produce waited: it never reaches the broker, so
                    # nothing will answer it and free the lock (one lock held for the
                    # orphan wait per queued produce stalled every produce after a
                    # broker restart for minutes)
                    if serial:
                        self._produce_lock.release()
                    break
                upstream.sendall(frame)
        except (OSError, struct.error):
            pass
        finally:
            # a produce still inside the broker keeps the lock until the broker answers
            # (or goes away): releasing it now would let another produce run beside it
            link.settled.wait(ORPHAN_WAIT_S)
            self._hang_up(client, upstream, link)

    def _wait_for_produce_lock(self) -> None:
        with self._lock:
            self._waiting += 1
        try:
            self._produce_lock.acquire()
        finally:
            with self._lock:
                self._waiting -= 1

    def _responses(self, upstream: socket.socket, client: socket.socket, link: _Link) -> None:
        """Broker to client, frame by frame; a produce's response frees the produce lock."""
        try:
            while True:
                frame = kafka_wire.read_frame(upstream)
                if frame is None:
                    break
                corr = kafka_wire.response_correlation_id(frame)
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


class _Link:
    """The requests of one client connection awaiting their responses, in order (Kafka
    answers a connection's requests in the order they were sent)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[int, bool]] = collections.deque()
        self._holding = False
        self._dropped = False
        self.settled = threading.Event()
        """Set while this connection holds no produce lock."""
        self.settled.set()

    def sent(self, corr: int, holds_produce_lock: bool) -> bool:
        """Record a request about to go to the broker; False once the connection was
        hung up (the request must not be sent, and a produce lock taken for it is the
        caller's to release)."""
        with self._lock:
            if self._dropped:
                return False
            self._pending.append((corr, holds_produce_lock))
            if holds_produce_lock:
                self._holding = True
                self.settled.clear()
            return True

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
            self._dropped = True
            self._pending.clear()
            self.settled.set()
            return holding


def _expects_response(frame: bytes) -> bool:
    """A produce request with acks != 0 (acks=0 gets no response); unparsed: True."""
    try:
        return kafka_wire.produce_acks(frame) != 0
    except struct.error:
        return True
