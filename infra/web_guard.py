"""What every HTTP server of streamrft checks before a request reaches its app.

A server on loopback with no API key (serve mode's default, the dashboard, an explorer's
recording endpoint) is reachable from any web page the user opens: the browser sends
"simple" cross-site requests (a ``text/plain`` POST, no preflight) and, with DNS
rebinding (a name of the attacker's that resolves to 127.0.0.1), reads the answers too.
:class:`WebGuard` (ASGI middleware) refuses, before the app sees them:

- a request whose ``Host`` is not one of the server's names (421): the address it is
  bound to, the loopback names when that is a loopback address, and the configured names
  (Kubernetes service names, a proxy's); any host when bound to every address
  (``0.0.0.0``, ``::``) and no names are configured (such a server needs a key anyway);
- a request with an ``Origin`` header that is neither the server's own origin nor on the
  allow-list (403): browsers send it on cross-site requests, the ``openai`` client and
  other programs do not;
- a POST, PUT or PATCH whose body is not ``application/json`` (415): a page cannot send
  that cross-site without a CORS preflight, which nothing here answers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from streamrft.infra.net import canonical_host, is_loopback

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")
BODY_METHODS = (b"POST", b"PUT", b"PATCH")


def host_name(value: str) -> str:
    """The name of a ``Host`` header or an origin's authority: lower case, port and IPv6
    brackets removed."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


def _canonical(name: str) -> str:
    return canonical_host(name).rstrip(".")  # "example.com." is "example.com"


class WebGuard:
    """ASGI middleware around ``app`` (see the module docstring). ``bound``: the address
    the server listens on; ``hosts``, ``origins``: the configured allow-lists (an origin
    as ``scheme://host[:port]``; ``*`` allows every origin)."""

    def __init__(
        self,
        app: Any,
        bound: str,
        hosts: Iterable[str] = (),
        origins: Iterable[str] = (),
        error: Callable[[int, str], dict] | None = None,
    ) -> None:
        self.app = app
        names = {_canonical(host_name(h)) for h in hosts}
        if bound not in WILDCARDS:
            names.add(_canonical(host_name(bound)))
            if is_loopback(bound):
                names.update(_canonical(n) for n in LOOPBACK_NAMES)
        self.any_host = bound in WILDCARDS and not names
        self.hosts = frozenset(names)
        self.origins = frozenset(o.rstrip("/").lower() for o in origins)
        self.error = error or (lambda status, message: {"error": message})

    def refusal(self, scope: dict) -> tuple[int, str] | None:
        """Why the request of ``scope`` is refused (status, message), or None."""
        headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get(b"host", "")
        if not self.any_host and _canonical(host_name(host)) not in self.hosts:
            return 421, (
                f"Host {host[:100]!r} is not a name of this server (allowed: "
                f"{sorted(self.hosts)}; add names in serve.allowed_hosts)"
            )
        origin = headers.get(b"origin")
        if origin is not None:
            own = {f"{scheme}://{host.lower()}" for scheme in ("http", "https")}
            allowed = "*" in self.origins or origin.rstrip("/").lower() in self.origins | own
            if not allowed:
                return 403, (
                    f"cross-site request from {origin[:100]!r} refused (allowed origins: "
                    f"{sorted(self.origins) or 'none'}; serve.allowed_origins)"
                )
        if scope.get("method", "").encode() in BODY_METHODS:
            kind = headers.get(b"content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return 415, f"Content-Type {kind or 'missing'!r}: send application/json"
        return None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.refusal(scope)
        if refused is None:
            return await self.app(scope, receive, send)
        status, message = refused
        body = json.dumps(self.error(status, message)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
