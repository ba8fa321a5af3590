"""The checks every HTTP server of streamrft makes before its app sees a request."""

from __future__ import annotations

import pytest

from streamrft.infra.web_guard import WebGuard, host_name

pytestmark = pytest.mark.unit


def _scope(method="GET", host="127.0.0.1:8000", origin=None, content_type=None) -> dict:
    headers = [(b"host", host.encode())] if host is not None else []
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    return {"type": "http", "method": method, "headers": headers}


def _status(guard: WebGuard, **request) -> int | None:
    refused = guard.refusal(_scope(**request))
    return None if refused is None else refused[0]


def test_host_names_of_a_loopback_server():
    guard = WebGuard(None, "127.0.0.1")
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "127.0.0.1"):
        assert _status(guard, host=host) is None, host
    for host in ("rebind.test:8000", "127.0.0.2:8000", "evil.localhost", "", None):
        assert _status(guard, host=host) == 421, host
    named = WebGuard(None, "127.0.0.1", hosts=["serve.ns.svc.cluster.local"])
    assert _status(named, host="serve.ns.svc.cluster.local:8000") is None


def test_a_server_on_every_address_takes_any_host_unless_names_are_given():
    assert _status(WebGuard(None, "0.0.0.0"), host="10.1.2.3:8000") is None
    limited = WebGuard(None, "0.0.0.0", hosts=["api.example.com"])
    assert _status(limited, host="api.example.com") is None
    assert _status(limited, host="10.1.2.3:8000") == 421
    assert _status(WebGuard(None, "10.1.2.3"), host="10.1.2.3:9000") is None


def test_cross_site_origins_are_refused_unless_allowed():
    guard = WebGuard(None, "127.0.0.1", origins=["https://app.example.com/"])
    assert _status(guard) is None  # programs send no Origin
    assert _status(guard, origin="http://127.0.0.1:8000") is None  # its own page
    assert _status(guard, origin="https://app.example.com") is None
    assert _status(guard, origin="http://127.0.0.1:5173") == 403  # another local origin
    assert _status(guard, origin="null") == 403  # a sandboxed frame or a file
    assert _status(WebGuard(None, "127.0.0.1", origins=["*"]), origin="http://x.test") is None


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/json", None),
        ("Application/JSON; charset=utf-8", None),
        ("text/plain", 415),
        ("text/plain; charset=utf-8", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        (None, 415),
    ],
)
def test_bodies_must_be_json(content_type, status):
    guard = WebGuard(None, "127.0.0.1")
    assert _status(guard, method="POST", content_type=content_type) == status
    assert _status(guard, method="GET", content_type=content_type) is None


def test_host_name_parsing():
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("::1") == "::1"
