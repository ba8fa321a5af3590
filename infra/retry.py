"""Riding out an outage of the broker or the object store: retry with backoff, then fail.

Processes keep running through an outage of up to ``run.outage_timeout_s``: an operation
that fails for a reason that may pass (connection refused, a request timeout, a 5xx from
the store) is tried again after 0.5 s, 1 s, 2 s ... 5 s, with one log line per attempt
that says what is being retried and why. Errors that retrying cannot fix (a bad message,
a bad config, a corrupt shard) are raised at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

from streamrft.schemas.errors import ServiceError, StreamRFTError

log = logging.getLogger(__name__)
T = TypeVar("T")

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 5.0


def is_retriable(exc: BaseException) -> bool:
    """Whether trying the same operation again may succeed once a service is back."""
    if isinstance(exc, StreamRFTError):
        return exc.retriable
    if isinstance(exc, KafkaError):
        return bool(exc.retriable) or isinstance(exc, KafkaTimeoutError | KafkaConnectionError)
    return False


def backoff_delays(first: float = FIRST_DELAY_S, most: float = MAX_DELAY_S):
    """0.5, 1, 2, 4, 5, 5, ... seconds."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, most)


async def retrying(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    timeout_s: float,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``await attempt()`` until it succeeds, retrying retriable failures for ``timeout_s``.

    Raises :class:`ServiceError` naming ``what`` once the outage has lasted longer than
    ``timeout_s`` (see ``run.outage_timeout_s``); a non-retriable error is raised as is.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    for n, delay in enumerate(backoff_delays(), start=1):
        try:
            result = await attempt()
        except (StreamRFTError, KafkaError) as exc:
            if not is_retriable(exc):
                if isinstance(exc, KafkaError):  # callers handle streamrft errors only
                    error = ServiceError(f"{what}: {exc}")
                    error.retriable = False
                    raise error from exc
                raise
            waited = loop.time() - started
            if waited + delay > timeout_s:
                error = ServiceError(
                    f"{what}: still failing after {waited:.0f}s ({exc}); see run.outage_timeout_s"
                )
                error.retriable = False  # the outage budget is spent; no outer retry
                raise error from exc
            if on_retry is not None:
                on_retry(exc)
            log.warning("%s failed (%s); retry %d in %.1fs", what, exc, n, delay)
            await asyncio.sleep(delay)
            continue
        if n > 1:
            log.info("%s: succeeded after %.1fs of retries", what, loop.time() - started)
        return result
    raise AssertionError("unreachable")  # pragma: no cover
