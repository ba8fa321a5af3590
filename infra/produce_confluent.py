"""The data producer on librdkafka (``confluent-kafka``), behind aiokafka's producer interface.

Selected by ``kafka.producer: confluent`` (:func:`streamrft.infra.kafka.data_producer`);
an optional extra (``pip install -e '.[kafka-fast]'``). librdkafka builds, batches and
sends produce requests on its own threads, in C, so the event loop only hands it each
record's bytes: the aiokafka producer builds every batch in Python on the loop, which is
what limited the experience path.

The interface is the part of :class:`aiokafka.AIOKafkaProducer` streamrft uses, so the
produce path (:mod:`streamrft.infra.produce`) does not know which one it has:

- :meth:`start` connects (a metadata request) and raises aiokafka's
  ``KafkaConnectionError`` while the broker is unreachable, so
  :func:`~streamrft.infra.kafka.start_client` retries it and then raises the same
  :class:`~streamrft.schemas.errors.ServiceError` as for aiokafka;
- :meth:`send` queues one record and returns a future that resolves to its metadata once
  the broker acknowledged it (acks=all), or fails with a ``ServiceError`` (``retriable``
  as librdkafka says, and for timeouts and transport errors) that
  :func:`~streamrft.infra.retry.retrying` treats as it treats aiokafka's errors;
- :meth:`partitions_for` lists a topic's partitions (the feeder's placement);
- :meth:`flush_lingering` sends what lingers now (the caller waits for these acks next);
- :meth:`stop` delivers what is queued (up to the request timeout), fails what is left
  (purged), then closes.

Every librdkafka option is chosen in :func:`streamrft.infra.kafka.confluent_options`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaConnectionError

from streamrft.infra import access
from streamrft.schemas.errors import ConfigError, ServiceError


def _optional_module() -> Any:
    """librdkafka's Python module; None without the kafka-fast extra (``available()``)."""
    try:
        import confluent_kafka
    except ImportError:
        return None
    return confluent_kafka


confluent_kafka: Any = _optional_module()

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How long the delivery thread blocks in librdkafka's poll between checks for stop."""
QUEUE_FULL_WAIT_S = 0.01
"""Back-off of :meth:`ConfluentProducer.send` while librdkafka's local queue is full."""
PURGE_WAIT_S = 1.0
"""How long :meth:`ConfluentProducer.stop` waits for the reports of the records it purged."""

_RETRIABLE_CODES = frozenset(
    {"_MSG_TIMED_OUT", "_TIMED_OUT", "_TRANSPORT", "_ALL_BROKERS_DOWN", "REQUEST_TIMED_OUT"}
)
"""Delivery failures a retry may fix even when librdkafka does not flag them retriable
(aiokafka's timeouts and connection errors are retried the same way)."""


def available() -> bool:
    """Whether ``confluent-kafka`` is installed."""
    return confluent_kafka is not None


@dataclass(frozen=True, slots=True)
class RecordMetadata:
    """Where an acknowledged record landed (the fields of aiokafka's that streamrft reads)."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None


def delivery_error(err: Any, topic: str) -> ServiceError:
    """A librdkafka error as the ``ServiceError`` the produce path retries or raises."""
    error = ServiceError(f"Kafka delivery to {topic!r} failed: {err.str()} ({err.name()})")
    error.retriable = bool(err.retriable()) or err.name() in _RETRIABLE_CODES
    return error


class ConfluentProducer:
    """A librdkafka producer for one asyncio loop; options from ``kafka.confluent_options``."""

    def __init__(self, options: dict[str, Any], connect_timeout_s: float) -> None:
        if confluent_kafka is None:
            raise ImportError("confluent-kafka is not installed")
        self._options = dict(options)
        self._connect_timeout_s = connect_timeout_s
        try:  # librdkafka's log lines go to this module's logger, not straight to stderr
            self._producer: Any = confluent_kafka.Producer(self._options, logger=log)
        except confluent_kafka.KafkaException as exc:
            raise ConfigError(
                f"kafka (producer: confluent): librdkafka refuses the options: {exc.args[0].str()}"
            ) from exc
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None
        self._flush_wanted = threading.Event()
        """Set by :meth:`flush_lingering`: the flush worker flushes (again)."""
        self._flusher: threading.Thread | None = None

    async def start(self) -> None:
        """Connect; ``KafkaConnectionError`` while no broker answers (call again to retry,
        as :func:`~streamrft.infra.kafka.start_client` does). Delivery reports are served
        by a thread from here on."""
        if self._producer is None:
            raise ServiceError("Kafka producer started after stop()")
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._producer.list_topics, timeout=self._connect_timeout_s)
        except confluent_kafka.KafkaException as exc:
            raise KafkaConnectionError(
                f"{self._options['bootstrap.servers']}: {exc.args[0].str()}"
            ) from exc
        self._stopping.clear()
        self._poller = threading.Thread(
            target=self._serve_deliveries,
            args=(self._producer,),
            name=f"{self._options['client.id']}-deliveries",
        )
        self._poller.daemon = True
        self._poller.start()

    def _serve_deliveries(self, producer: Any) -> None:
        """The delivery thread: librdkafka calls each record's callback from ``poll``."""
        while not self._stopping.is_set():
            producer.poll(POLL_S)

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Queue one record; the returned future resolves once the broker acknowledged it."""
        access.check("write", topic)
        if self._producer is None or self._poller is None or self._loop is None:
            raise ServiceError("Kafka producer used before start() or after stop()")
        future: asyncio.Future[RecordMetadata] = self._loop.create_future()
        loop = self._loop

        def delivered(err: Any, msg: Any) -> None:  # on the delivery thread
            loop.call_soon_threadsafe(_settle, future, err, msg, topic)

        extra: dict[str, Any] = {}
        if partition is not None:
            extra["partition"] = partition
        if timestamp_ms is not None:
            extra["timestamp"] = timestamp_ms
        while True:
            try:
                self._producer.produce(
                    topic,
                    value,
                    key,
                    headers=list(headers) if headers else None,
                    on_delivery=delivered,
                    **extra,
                )
                return future
            except BufferError:  # local queue full: let librdkafka send some first
                await asyncio.sleep(QUEUE_FULL_WAIT_S)
            except confluent_kafka.KafkaException as exc:  # e.g. a record over the limit
                raise delivery_error(exc.args[0], topic) from exc

    async def partitions_for(self, topic: str) -> set[int]:
        """The partition ids of ``topic``, from the broker's metadata (aiokafka's
        ``partitions_for``, which the feeder places its tasks with); a retriable
        ``ServiceError`` while the broker or the topic's metadata is not there."""
        if self._producer is None:
            raise ServiceError("Kafka producer used after stop()")
        try:
            metadata = await asyncio.to_thread(
                self._producer.list_topics, topic, self._connect_timeout_s
            )
        except confluent_kafka.KafkaException as exc:
            raise delivery_error(exc.args[0], topic) from exc
        info = metadata.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            error = ServiceError(f"Kafka topic {topic!r}: no partitions in the broker's metadata")
            error.retriable = True
            raise error
        return set(info.partitions)

    def flush_lingering(self) -> None:
        """Send the records that wait for ``linger.ms`` now: the caller is about to wait
        for their acknowledgements. librdkafka skips the linger only while a ``flush`` call
        is in progress (``flush(0)`` returns before its broker thread looks), so a thread
        flushes until what is queued is delivered (or failed: the request timeout)."""
        if self._poller is None or not self._options.get("linger.ms"):
            return
        self._flush_wanted.set()
        if self._flusher is None:  # one worker for the producer's life, however many sends
            self._flusher = threading.Thread(
                target=self._flush_when_wanted,
                args=(self._producer,),
                name=f"{self._options['client.id']}-flush",
                daemon=True,
            )
            self._flusher.start()

    def _flush_when_wanted(self, producer: Any) -> None:
        """The flush worker: flush each time :meth:`flush_lingering` asks (asks made during
        a flush make one more), until the producer stops. While the broker is down a
        flush lasts up to the connect timeout; the asks meanwhile cost nothing."""
        while not self._stopping.is_set():
            if self._flush_wanted.wait(POLL_S):
                self._flush_wanted.clear()
                producer.flush(self._connect_timeout_s)

    async def flush(self) -> None:
        """Wait until every queued record is delivered or failed."""
        if self._producer is not None:
            await asyncio.to_thread(self._producer.flush, self._connect_timeout_s)

    async def stop(self) -> None:
        """Deliver what is queued (up to the connect timeout), then close; safe to call twice.
        A record still undelivered then is purged: its future fails (a non-retriable
        ``ServiceError``), as aiokafka fails the batches its stop cannot deliver, rather
        than leaving its sender waiting for ever."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            await asyncio.to_thread(producer.flush, self._connect_timeout_s)
        finally:
            producer.purge()  # what the broker did not take: its delivery reports fail it
            await asyncio.to_thread(producer.flush, PURGE_WAIT_S)  # serves those reports
            self._stopping.set()
            if self._poller is not None:
                await asyncio.to_thread(self._poller.join)
                self._poller = None
            if self._flusher is not None:  # done before the loop its callbacks use closes
                await asyncio.to_thread(self._flusher.join)
                self._flusher = None
            producer.poll(0)  # the last delivery reports


def _settle(future: asyncio.Future, err: Any, msg: Any, topic: str) -> None:
    if future.done():  # the caller gave up on it (cancelled)
        return
    if err is not None:
        future.set_exception(delivery_error(err, topic))
        return
    timestamp = msg.timestamp()[1]
    future.set_result(RecordMetadata(msg.topic(), msg.partition(), msg.offset(), timestamp))
