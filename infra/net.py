"""Network helpers for any layer (infra core: the standard library and schemas only)."""

from __future__ import annotations

import ipaddress
import socket
import threading

from streamrft.schemas.errors import ServiceError

_recent_ports: list[int] = []
_recent_ports_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (a local service's port, a
    process group's rendezvous).

    The port is released before returning, so another process may take it before the
    caller binds it; a caller that can retry with a new port does (``LocalServices``).
    Ports handed out recently by this process are not handed out again.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _recent_ports_lock:
            if port in _recent_ports:
                continue
            _recent_ports.append(port)
            del _recent_ports[:-64]
        return port
    raise ServiceError(f"could not find a free TCP port on {host}")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine (``localhost``, 127.x, ::1):
    what decides whether serve mode needs an API key and the dashboard warns."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def canonical_host(host: str) -> str:
    """One spelling of a host: lower case, IPv6 brackets gone, an IP address in its short
    form (``[0:0::1]`` and ``::1`` are one)."""
    host = host.strip("[]").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def split_host_port(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (an IPv6 address in brackets: ``[::1]:PORT``) as its parts; None when
    it is not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    elif not host or ":" in host or not host.isascii() or any(c.isspace() for c in host):
        return None  # an IPv6 address without brackets is ambiguous
    return host, int(port)


def local_address_towards(host: str) -> str:
    """The local address the OS would send from to reach ``host`` ('' if unknown): this
    host's address as ``host`` sees it (no packet is sent)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return ""


_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The network interface holding the IPv4 ``address`` as its primary address (Linux;
    None elsewhere, for IPv6, or for a secondary address: then name it in
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``)."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:  # no IPv4 address
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None
