"""The uvicorn server every HTTP API of streamrft runs on (serve mode, the dashboard): one
that leaves signals alone. The process's own stop handlers set its stop flag and tell the
server to exit from there; uvicorn's handling would re-raise the signal after serving and
skip what the process does on the way out (serve mode's final publication)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any


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
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=math.ceil(graceful_s),
        **options,
    )
    return Quiet(config)
