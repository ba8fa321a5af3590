"""Every aiokafka option streamrft uses, chosen on purpose, in one place.

Three producer roles and four consumer roles; no other module constructs an aiokafka
client. Choices that matter for correctness:

- ``acks="all"`` everywhere: an experience counts as published only once the broker has it.
- No idempotence or transactions: the embedded Tansu broker fails InitProducerId, so
  correctness rests on at-least-once delivery plus deduplication by experience id.
- Auto-commit off for tasks and experiences: offsets are committed only after the work
  they stand for is done (a group acknowledged; a step checkpointed).
- Control and status topics are read without a group from the beginning (Tansu's "latest"
  offset is unreliable) with a short long-poll wait, so version events arrive promptly.
- Each control event is sent as its own batch (``linger_ms=0``, then awaited).
- Every client gets the same security options (:func:`security_options`): protocol, SASL
  credentials and a TLS context from ``kafka.*``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError
from aiokafka.helpers import create_ssl_context

from streamrft.infra.config import KafkaConfig
from streamrft.schemas.errors import ConfigError, ServiceError
from streamrft.schemas.topics import TopicNames

REQUEST_TIMEOUT_MS = 30_000
CONNECT_RETRY_S = 30.0


def _servers(cfg: KafkaConfig) -> str:
    if not cfg.bootstrap_servers:
        raise ServiceError("kafka.bootstrap_servers: no broker configured or started")
    return cfg.bootstrap_servers


def security_options(cfg: KafkaConfig) -> dict[str, Any]:
    """The keyword arguments that make a client speak ``kafka.security_protocol``: SASL
    mechanism and credentials for ``SASL_*``, an ``ssl.SSLContext`` (CA, client certificate,
    hostname check) for ``*SSL``."""
    options: dict[str, Any] = {"security_protocol": cfg.security_protocol}
    if cfg.security_protocol.startswith("SASL_"):
        options["sasl_mechanism"] = cfg.sasl_mechanism
        options["sasl_plain_username"] = cfg.sasl_username
        options["sasl_plain_password"] = cfg.sasl_password
    if cfg.security_protocol.endswith("SSL"):
        try:
            context = create_ssl_context(
                cafile=cfg.ssl_cafile, certfile=cfg.ssl_certfile, keyfile=cfg.ssl_keyfile
            )
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"kafka.ssl_cafile / ssl_certfile / ssl_keyfile: cannot load: {exc}"
            ) from exc
        context.check_hostname = cfg.ssl_check_hostname
        options["ssl_context"] = context
    return options


def _producer(cfg: KafkaConfig, client_id: str, **batching) -> AIOKafkaProducer:
    """acks=all, no idempotence (the embedded broker lacks InitProducerId), bounded retries."""
    return AIOKafkaProducer(
        bootstrap_servers=_servers(cfg),
        client_id=client_id,
        acks="all",
        enable_idempotence=False,
        max_request_size=cfg.max_request_bytes,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
        retry_backoff_ms=200,
        **security_options(cfg),
        **batching,
    )


def data_producer(cfg: KafkaConfig, client_id: str) -> AIOKafkaProducer:
    """Producer of tasks and experience groups: batched, optionally compressed."""
    return _producer(
        cfg,
        client_id,
        compression_type=None if cfg.compression == "none" else cfg.compression,
        linger_ms=cfg.linger_ms,
        max_batch_size=1 << 20,
    )


def event_producer(cfg: KafkaConfig, client_id: str) -> AIOKafkaProducer:
    """Producer of control, status, metrics and dead letters: each event sent at once."""
    return _producer(cfg, client_id, linger_ms=0)


def _group_consumer(
    cfg: KafkaConfig, topic: str, group_id: str, client_id: str, **fetch: int
) -> AIOKafkaConsumer:
    """A consumer-group member that starts from the earliest offset and commits by hand."""
    return AIOKafkaConsumer(
        topic,
        bootstrap_servers=_servers(cfg),
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=max(cfg.session_timeout_ms // 5, 500),
        max_poll_interval_ms=cfg.max_poll_interval_ms,
        fetch_max_wait_ms=cfg.data_fetch_max_wait_ms,
        request_timeout_ms=max(REQUEST_TIMEOUT_MS, cfg.session_timeout_ms + 5000),
        **security_options(cfg),
        **fetch,
    )


def task_consumer(cfg: KafkaConfig, topic: str, group_id: str, client_id: str) -> AIOKafkaConsumer:
    """Explorers share the tasks topic in one group; offsets committed by hand."""
    return _group_consumer(cfg, topic, group_id, client_id)


def experience_consumer(
    cfg: KafkaConfig, topic: str, group_id: str, client_id: str
) -> AIOKafkaConsumer:
    """The trainer's consumer: manual commit after checkpoint, fetches as large as a message."""
    return _group_consumer(
        cfg,
        topic,
        group_id,
        client_id,
        max_partition_fetch_bytes=cfg.max_request_bytes,
        fetch_max_bytes=max(cfg.max_request_bytes, 64 << 20),
    )


def event_reader(cfg: KafkaConfig, topics: Sequence[str], client_id: str) -> AIOKafkaConsumer:
    """Group-less reader of control/status/metrics topics, from the beginning, low latency."""
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=_servers(cfg),
        client_id=client_id,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=cfg.control_fetch_max_wait_ms,
        max_partition_fetch_bytes=cfg.max_request_bytes,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
        **security_options(cfg),
    )


def topic_reader(cfg: KafkaConfig, client_id: str) -> AIOKafkaConsumer:
    """Group-less reader for tools (``streamrft tail``); partitions assigned by the caller."""
    return event_reader(cfg, [], client_id)


def admin_client(cfg: KafkaConfig, client_id: str = "streamrft-admin") -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=_servers(cfg),
        client_id=client_id,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
        **security_options(cfg),
    )


async def start_client(
    client: AIOKafkaProducer | AIOKafkaConsumer | AIOKafkaAdminClient, what: str
) -> None:
    """Start a client, retrying while the broker is not reachable yet, then a clear error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_RETRY_S
    while True:
        try:
            await client.start()
            return
        except KafkaConnectionError as exc:
            if loop.time() > deadline:
                raise ServiceError(f"{what}: cannot reach the Kafka broker: {exc}") from exc
            await asyncio.sleep(0.5)


def topic_specs(cfg: KafkaConfig, topics: TopicNames) -> list[NewTopic]:
    """The six topics of a run: tasks and experiences partitioned, events single-partition.

    Single-partition event topics keep a total order of control events for every reader.
    """
    specs = []
    for kind, name in topics.all().items():
        parts = cfg.partitions if kind in ("tasks", "experiences") else 1
        config = {"max.message.bytes": str(cfg.max_request_bytes)}
        specs.append(NewTopic(name, parts, cfg.replication_factor, topic_configs=config))
    return specs


async def ensure_topics(cfg: KafkaConfig, topics: TopicNames) -> list[str]:
    """Create the run's topics that do not exist yet; returns the names created."""
    admin = admin_client(cfg)
    await start_client(admin, "topic admin")
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in topic_specs(cfg, topics) if s.name not in existing]
        if missing:
            try:
                await admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
            except KafkaError as exc:
                raise ServiceError(f"creating topics {[s.name for s in missing]}: {exc}") from exc
        return [s.name for s in missing]
    finally:
        await admin.close()


async def list_topics(cfg: KafkaConfig) -> list[str]:
    admin = admin_client(cfg)
    await start_client(admin, "topic admin")
    try:
        return sorted(await admin.list_topics())
    finally:
        await admin.close()
