"""Relays in front of the object store that change what some requests do, for drills whose
fault must be in place before the run can race it.

A :class:`RequestRelay` reads each request a client sends (its head and its
``Content-Length`` body) and a subclass decides what becomes of it: passed on, passed with
its body replaced by random bytes of the same length, refused here with a ``503`` the store
never sees, or held until the relay is released (:meth:`RequestRelay.release`). Only what
this needs of HTTP/1.1 is read: a connection whose request comes with a chunked body (or a
head past :data:`HEAD_MAX`) is relayed unread from there on.

- :class:`BitRotRelay` stores weight shards rotten: every PUT of a shard
  (``<run>/vNNNNNNNN/<name>.safetensors``) of a version from ``first`` on goes up with random
  bytes until a reader has fetched a rotten shard. The version's manifest, written from the
  trainer's own bytes, then disagrees with its shard from the moment the version is in the
  store, before it is announced, so the first explorer that fetches it meets the rot
  whatever the timing. Later versions go up untouched (a version already rotten stays so).
  The store takes the changed body because uploads are presigned with ``UNSIGNED-PAYLOAD``
  (``sync/object_store.py``).
- :class:`CheckpointGate` refuses every write into a checkpoint of the run
  (``<run>/checkpoints/step_N/``) from step ``first`` on, until released: the store's newest
  checkpoint stays one from before ``first``, however far the trainer gets meanwhile. A
  drill may act on the first such write before it is answered (``on_first``: freeze the
  trainer's host there, whose steps take a tenth of a second).
- :class:`VersionGate` holds every write into a weight version of the run from ``first`` on
  until released: no such version can be announced before, and none before it is retired.
"""

from __future__ import annotations

import enum
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator

from tests.harness.throttle import CHUNK, Relay

HEAD_MAX = 64 << 10
_REFUSED = b"<Error><Code>ServiceUnavailable</Code><Message>refused by a relay</Message></Error>"
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_REFUSED), _REFUSED)
)
_SHARD = re.compile(r"/v(\d{8})/[^/]+\.safetensors$")
_CHECKPOINT = re.compile(r"/checkpoints/step_(\d+)/")
_VERSION = re.compile(r"/v(\d{8})/")


class Verdict(enum.Enum):
    PASS = "pass"
    ROT = "rot"
    """The body goes up as random bytes of its length."""
    REFUSE = "refuse"
    """Answered here with :data:`REFUSAL`; the store never sees the request."""
    HOLD = "hold"
    """Passed on once the relay is released; the client waits for its answer meanwhile."""


class _Requests:
    """The requests a client sends on one connection, read from its socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def head(self) -> bytes | None:
        """The next request's head (through its blank line); None: the client closed, or
        the head is too long to be one."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > HEAD_MAX or not (data := self.sock.recv(CHUNK)):
                return None
            self.buf += data
        head = bytes(self.buf[: end + 4])
        del self.buf[: end + 4]
        return head

    def body(self, size: int) -> Iterator[bytes]:
        """The ``size`` bytes of the request's body, as they come."""
        while size > 0:
            if not self.buf:
                if not (data := self.sock.recv(min(CHUNK, size))):
                    return
                self.buf += data
            part = bytes(self.buf[:size])
            del self.buf[: len(part)]
            size -= len(part)
            yield part


def _parse(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, path without its query, headers by lower-case name) of a request head."""
    line, *rest = head.decode("latin-1").split("\r\n")
    method, target, _ = [*line.split(" ", 2), "", ""][:3]
    headers = {}
    for field in rest:
        name, _, value = field.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return method, urllib.parse.unquote(target.split("?", 1)[0]), headers


class RequestRelay(Relay):
    """A :class:`Relay` that judges each request of run ``run_id`` (module docstring)."""

    def __init__(self, target: tuple[str, int], run_id: str, host: str = "127.0.0.1") -> None:
        super().__init__(target, host)
        self.run_id = run_id
        self._lock = threading.Lock()
        self.released = threading.Event()

    def release(self) -> None:
        """Held requests go on, and a gate lets everything pass from now on."""
        self.released.set()

    def _verdict(self, method: str, path: str) -> Verdict:
        """What becomes of a request (called under the relay's lock)."""
        return Verdict.PASS

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        requests = _Requests(src)
        while (head := requests.head()) is not None:
            method, path, headers = _parse(head)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                dst.sendall(head)
                break
            with self._lock:
                verdict = self._verdict(method, path) if f"/{self.run_id}/" in path else None
            body = requests.body(int(headers.get("content-length") or 0))
            if verdict is Verdict.REFUSE:
                for _ in body:  # read, never sent: the client waits for the answer
                    pass
                src.sendall(REFUSAL)
                continue
            if verdict is Verdict.HOLD:
                self.released.wait()
            dst.sendall(head)
            for part in body:
                dst.sendall(os.urandom(len(part)) if verdict is Verdict.ROT else part)
        dst.sendall(bytes(requests.buf))  # what was read past the last request read
        super()._up(src, dst)


class BitRotRelay(RequestRelay):
    """Stores the shards of versions from ``first`` on rotten until one is fetched."""

    def __init__(self, target: tuple[str, int], run_id: str, first: int = 1) -> None:
        super().__init__(target, run_id)
        self.first = first
        self.rotten: dict[int, list[str]] = {}
        """Version -> the paths of its shards stored rotten (bucket first)."""
        self.fetched = threading.Event()
        """Set once a GET of a rotten shard has gone by."""

    def _verdict(self, method: str, path: str) -> Verdict:
        m = _SHARD.search(path)
        if m is None:
            return Verdict.PASS
        version = int(m[1])
        if method == "GET" and version in self.rotten:
            self.fetched.set()
        elif (
            method == "PUT"
            and version >= self.first
            and (version in self.rotten or not self.fetched.is_set())
        ):
            self.rotten.setdefault(version, []).append(path)
            return Verdict.ROT
        return Verdict.PASS


def _written_at(pattern: re.Pattern, method: str, path: str) -> int | None:
    """The number ``pattern`` finds in the path of a write (an upload's part, its start or
    its end); None for a read or another path."""
    m = pattern.search(path)
    return int(m[1]) if m is not None and method in ("PUT", "POST") else None


class CheckpointGate(RequestRelay):
    """Refuses writes into the run's checkpoints from step ``first`` on until released;
    ``on_first()`` runs once, when the first of them arrives, before it is answered."""

    def __init__(
        self,
        target: tuple[str, int],
        run_id: str,
        first: int,
        host: str,
        on_first: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(target, run_id, host)
        self.first = first
        self.on_first = on_first
        self.refused: set[int] = set()
        """The steps whose checkpoint writes were refused."""

    def _verdict(self, method: str, path: str) -> Verdict:
        step = _written_at(_CHECKPOINT, method, path)
        if self.released.is_set() or step is None or step < self.first:
            return Verdict.PASS
        if not self.refused and self.on_first is not None:
            self.on_first()
        self.refused.add(step)
        return Verdict.REFUSE


class VersionGate(RequestRelay):
    """Holds writes into the run's weight versions from ``first`` on until released."""

    def __init__(self, target: tuple[str, int], run_id: str, first: int = 1) -> None:
        super().__init__(target, run_id)
        self.first = first
        self.held: set[int] = set()
        """The versions whose writes waited."""

    def _verdict(self, method: str, path: str) -> Verdict:
        version = _written_at(_VERSION, method, path)
        if self.released.is_set() or version is None or version < self.first:
            return Verdict.PASS
        self.held.add(version)
        return Verdict.HOLD
