"""Riding out outages: which errors are retried, the backoff, and the give-up error."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError

from streamrft.infra import retry
from streamrft.schemas.errors import (
    IntegrityError,
    SchemaError,
    ServiceError,
    StoreUnavailable,
)


def test_what_is_retriable():
    assert retry.is_retriable(KafkaConnectionError())
    assert retry.is_retriable(KafkaTimeoutError())
    assert retry.is_retriable(StoreUnavailable("store down"))
    assert retry.is_retriable(ServiceError("broker down"))
    assert not retry.is_retriable(MessageSizeTooLargeError())
    assert not retry.is_retriable(IntegrityError("bad sha256"))
    assert not retry.is_retriable(SchemaError("bad message"))
    assert not retry.is_retriable(ValueError("a bug"))


def test_backoff_doubles_up_to_the_cap():
    assert list(itertools.islice(retry.backoff_delays(), 6)) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_retries_until_the_service_is_back(monkeypatch):
    slept: list[float] = []
    real_sleep, here = asyncio.sleep, threading.get_ident()

    async def no_sleep(s: float, *args, **kwargs):
        # asyncio.sleep is patched for the whole process: a loop left running in another
        # thread by an earlier test (a server's) must keep sleeping for real, not spin here
        if threading.get_ident() != here:
            return await real_sleep(s, *args, **kwargs)
        slept.append(s)

    monkeypatch.setattr(retry.asyncio, "sleep", no_sleep)
    calls, seen = {"n": 0}, []

    async def attempt() -> str:
        calls["n"] += 1
        if calls["n"] < 4:
            raise KafkaConnectionError("refused")
        return "sent"

    result = asyncio.run(retry.retrying("sending", attempt, 60, seen.append))
    assert result == "sent"
    assert calls["n"] == 4
    assert slept == [0.5, 1.0, 2.0]
    assert len(seen) == 3


def test_gives_up_after_the_outage_timeout_naming_it():
    async def attempt() -> None:
        raise StoreUnavailable("uploading s3://b/k: connection refused")

    with pytest.raises(
        ServiceError, match=r"publishing v3: still failing .*outage_timeout_s"
    ) as info:
        asyncio.run(retry.retrying("publishing v3", attempt, 1.2))
    assert info.value.retriable is False


def test_a_permanent_error_is_raised_at_once():
    calls = {"n": 0}

    async def corrupt() -> None:
        calls["n"] += 1
        raise IntegrityError("shard sha256 mismatch")

    with pytest.raises(IntegrityError):
        asyncio.run(retry.retrying("fetching", corrupt, 60))
    assert calls["n"] == 1

    async def too_big() -> None:
        raise MessageSizeTooLargeError()

    with pytest.raises(ServiceError) as info:
        asyncio.run(retry.retrying("sending", too_big, 60))
    assert info.value.retriable is False
