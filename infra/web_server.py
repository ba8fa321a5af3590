"""The uvicorn server every HTTP API of streamrft runs on (serve mode, the dashboard): one
that leaves signals alone. The process's own stop handlers set its stop flag and tell the
server to exit from there; uvicorn's handling would re-raise the signal after serving and
skip what the process does on the way out (serve mode's final publication)."""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Iterator
from typing import Any

from streamrft.schemas.errors import StreamRFTError


def quiet_server(app: Any, graceful_s: float, **options: Any) -> Any:
    """A ``uvicorn.Server`` for ``app`` that installs no signal handler, giving requests in
    flight up to ``graceful_s`` (whole seconds, rounded up) on exit; ``options`` go to
    ``uvicorn.Config`` (``limit_concurrency``...)."""
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    config = uvicorn.Config(
        app,
        log_level="warning",
        log_config=None,  # its lines go through the process's logging (monitor.log_format)
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=math.ceil(graceful_s),
        **options,
    )
    return Quiet(config)


def listening_socket(host: str, port: int, hint: str, backlog: int = 128) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port) and listening, for ``serve(sockets=)``:
    a port that is taken is a clear error ending with ``hint`` (which setting to change), not
    uvicorn's exit from inside the event loop."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StreamRFTError(f"cannot listen on {host}:{port} ({exc.strerror}); {hint}") from exc
    sock.listen(backlog)
    return sock
