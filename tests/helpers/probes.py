"""Asking a process's probes (``monitor.http_port``) from a test, as a kubelet or Prometheus
would: plain HTTP GETs."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    """A port free on 127.0.0.1 now (the process given it binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=5
        ) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def check(base: str, path: str) -> tuple[int, dict]:
    """A ``/healthz`` or ``/readyz`` answer: its status and JSON body."""
    status, body = get(base + path)
    return status, json.loads(body) if body else {}


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base: str) -> Samples:
    """``/metrics`` parsed by prometheus_client's own parser: (name, sorted labels) -> value."""
    status, body = get(base + "/metrics")
    assert status == 200, body[:300]
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: Samples, family: str, /, **labels: str) -> list[float]:
    """The values of ``family`` whose labels include ``labels`` (``name=`` is a label)."""
    want = set(labels.items())
    return [v for (n, ls), v in samples.items() if n == family and want <= set(ls)]
