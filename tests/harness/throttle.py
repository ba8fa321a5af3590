"""TCP relays in front of a real server, for drills that change what reaches it.

:class:`ThrottledRelay` slows what clients send: a slow uplink. Put in front of the object
store, it makes every upload (the trainer publishing a version) take ``bytes / rate``
seconds while downloads (explorers fetching) pass at full speed: a publisher slower than
the training steps, with nothing in the code under test changed. :class:`LaggedRelay` holds
each request a while instead: a server that answers late. :class:`Relay` is the plain relay
they and ``tests/harness/store_relay.py`` build on: a subclass changes how the bytes from the
client go up (:meth:`Relay._up`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Self, TypeVar

CHUNK = 16 << 10


class Relay:
    """Listens on a free port of ``host`` (loopback by default) and relays every connection
    to ``target``, each way in a thread of its own; the answers pass unchanged."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self.host = host
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Self:
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            if up:
                self._up(src, dst)
            else:
                while data := src.recv(CHUNK):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        """Relay what the client sends to ``target`` until it closes."""
        while data := src.recv(CHUNK):
            dst.sendall(data)


class ThrottledRelay(Relay):
    """A :class:`Relay` whose bytes from the client to ``target`` pass at most
    ``bytes_per_s``, the answers unthrottled."""

    def __init__(self, target: tuple[str, int], bytes_per_s: float) -> None:
        super().__init__(target)
        self.rate = bytes_per_s
        self.sent = 0
        """Bytes relayed towards ``target`` (all connections)."""
        self._lock = threading.Lock()
        self._free_at = 0.0
        """When the uplink is free again (monotonic seconds)."""

    def _slot(self, n: int) -> float:
        """Seconds to wait before ``n`` more bytes go up: one uplink shared by every
        connection, with no credit saved while idle."""
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at, now)
            self._free_at = start + n / self.rate
            self.sent += n
            return start - now

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(CHUNK):
            time.sleep(self._slot(len(data)))
            dst.sendall(data)


class LaggedRelay(Relay):
    """A :class:`Relay` that holds what the client sends ``delay_s`` before it goes on (a
    slow or loaded server: every request answered late); the answers pass at once."""

    def __init__(self, target: tuple[str, int], delay_s: float = 0.0) -> None:
        super().__init__(target)
        self.delay_s = delay_s

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(CHUNK):
            time.sleep(self.delay_s)
            dst.sendall(data)


R = TypeVar("R", bound=Relay)


@contextlib.contextmanager
def _running(relay: R) -> Iterator[R]:
    relay.start()
    try:
        yield relay
    finally:
        relay.close()


def _target(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def throttled(
    endpoint: str, bytes_per_s: float
) -> contextlib.AbstractContextManager[ThrottledRelay]:
    """A :class:`ThrottledRelay` in front of ``host:port``, closed on exit."""
    return _running(ThrottledRelay(_target(endpoint), bytes_per_s))


def lagged(endpoint: str, delay_s: float = 0.0) -> contextlib.AbstractContextManager[LaggedRelay]:
    """A :class:`LaggedRelay` in front of ``host:port``, closed on exit."""
    return _running(LaggedRelay(_target(endpoint), delay_s))
