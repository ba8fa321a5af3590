"""Simulated hosts on one machine: Linux network namespaces joined by a private bridge.

Each host is a network namespace with its own loopback and one address on the bridge
(``10.A.B.2``, ``.3``, ...); the machine's own namespace holds the bridge's address
(``10.A.B.1``), where the drill's broker and object store listen. A process started on a
host (:meth:`Host.argv`: ``ip netns exec``) reaches the others only through the bridge: its
``127.0.0.1`` is its own. Hosts share the file system, so each gets its own folder,
``HOME`` and ``TMPDIR``, and its own ``run.host_id`` (the same-host shared memory of the
``auto`` method would otherwise see them as one host).

Needs root and the ``ip`` tool (``iproute2``); :func:`unavailable` says why not, for a
skip. Every name carries a random tag, and :meth:`SimulatedHosts.close` removes the
namespaces (their processes killed first) and the bridge.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "no `ip` tool (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"srft-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return f"cannot create a network namespace: {err.decode().strip() or exc}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return None


def _free_prefix() -> str:
    """A ``10.x.y`` /24 that no route of this machine reaches yet (the bridge's subnet)."""
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True, check=False
    ).stdout
    for _ in range(100):
        octets = secrets.randbelow(50 * 250)
        prefix = f"10.{200 + octets // 250}.{octets % 250}"
        if f"{prefix}." not in routes:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 for the simulated hosts' bridge")


@dataclass
class Host:
    """One simulated host: its namespace, address, folder and environment."""

    name: str
    netns: str
    address: str
    folder: Path
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host (in its namespace; the environment is the caller's)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]

    def _signal_all(self, sig: signal.Signals) -> int:
        """Send ``sig`` to every process on this host, again until no new one appears (a
        supervisor may be starting one); how many there were."""
        sent: set[int] = set()
        while fresh := [pid for pid in self.pids() if pid not in sent]:
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            sent.update(fresh)
        return len(sent)

    def freeze(self) -> int:
        """SIGSTOP every process on this host; how many there were. :meth:`kill` ends them
        frozen."""
        return self._signal_all(signal.SIGSTOP)

    def kill(self) -> int:
        """SIGKILL every process on this host (a host lost at once); how many there were."""
        return self._signal_all(signal.SIGKILL)


class SimulatedHosts:
    """A bridge and its hosts (module docstring); a context manager that removes them."""

    def __init__(self, root: Path) -> None:
        self.tag = secrets.token_hex(3)
        self.root = root
        self.prefix = _free_prefix()
        self.bridge = f"sb{self.tag}"
        self.address = f"{self.prefix}.1"
        """The machine's own address on the bridge (where shared services listen)."""
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        """Every namespace made, the half-made one included (removed by :meth:`close`)."""
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def add(self, name: str) -> Host:
        n = len(self.hosts) + 2
        netns, outside, inside = f"srft-{self.tag}-{n}", f"sv{self.tag}{n}", f"sp{self.tag}{n}"
        self._namespaces.append(netns)
        try:
            _ip("netns", "add", netns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", netns)
            _ip("addr", "add", f"{self.prefix}.{n}/24", "dev", inside, netns=netns)
            _ip("link", "set", inside, "up", netns=netns)
            _ip("link", "set", "lo", "up", netns=netns)
        except BaseException:
            subprocess.run(["ip", "link", "del", outside], capture_output=True, check=False)
            raise
        folder = self.root / name
        for sub in ("home", "tmp", "work"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        host = Host(
            name,
            netns,
            f"{self.prefix}.{n}",
            folder / "work",
            {"HOME": str(folder / "home"), "TMPDIR": str(folder / "tmp")},
        )
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
        for netns in self._namespaces:  # its end of the veth pair goes with it
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
