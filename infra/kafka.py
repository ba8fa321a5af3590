"""Every aiokafka option streamrft uses, chosen on purpose, in one place.

Three producer roles and five consumer roles; no other module constructs an aiokafka
client. Choices that matter for correctness:

- ``acks="all"`` everywhere: an experience counts as published only once the broker has it.
- No idempotence or transactions: the embedded Tansu broker fails InitProducerId, so
  correctness rests on at-least-once delivery plus deduplication by experience id.
- Auto-commit off for tasks and experiences: offsets are committed only after the work
  they stand for is done (a group acknowledged; a step checkpointed).
- A replay (``streamrft train --from-*``) reads experiences without a group and commits
  nothing: it leaves every group's offsets as they were.
- Control and status topics are read without a group from the beginning (Tansu's "latest"
  offset is unreliable) with a short long-poll wait, so version events arrive promptly.
- Each control event is sent as its own batch (``linger_ms=0``, then awaited).
- Data producers (:func:`data_producer`) are aiokafka's or, with ``kafka.producer:
  confluent``, librdkafka's (:mod:`streamrft.infra.produce_confluent`, options in
  :func:`confluent_options`), with the same guarantees; both send their lingering batches
  at once when the sender is about to wait for the acks (``flush_lingering``).
- Every client gets the same security options (:func:`security_options`): protocol, SASL
  credentials and a TLS context from ``kafka.*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.group import JoinGroupRequest, LeaveGroupRequest

from streamrft.infra import access, produce_confluent
from streamrft.infra.config import KafkaConfig
from streamrft.infra.produce_confluent import ConfluentProducer
from streamrft.schemas.errors import ConfigError, ServiceError

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_MS = 30_000
CONNECT_RETRY_S = 30.0
CONNECT_TIMEOUT_S = REQUEST_TIMEOUT_MS / 1000
"""librdkafka producer: longest wait for the first metadata answer, and for the queue to
drain on stop."""


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


class CheckedProducer(AIOKafkaProducer):
    """aiokafka's producer, each send checked against the process's role
    (:mod:`streamrft.infra.access`: the table the run's ACLs come from)."""

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        access.check("write", topic)
        return await super().send(topic, *args, **kwargs)


class CheckedConsumer(AIOKafkaConsumer):
    """aiokafka's consumer, its topics and group checked against the process's role."""

    def __init__(self, *topics: str, **options: Any) -> None:
        for topic in topics:
            access.check("read", topic)
        if options.get("group_id") is not None:
            access.check("group", options["group_id"])
        super().__init__(*topics, **options)

    def subscribe(self, topics: Any = (), pattern: Any = None, listener: Any = None) -> None:
        for topic in topics:
            access.check("read", topic)
        super().subscribe(topics, pattern, listener)

    def assign(self, partitions: Any) -> None:
        for tp in partitions:
            access.check("read", tp.topic)
        super().assign(partitions)


def _producer(
    cfg: KafkaConfig,
    client_id: str,
    cls: type[AIOKafkaProducer] = CheckedProducer,
    request_timeout_ms: int = REQUEST_TIMEOUT_MS,
    **batching,
) -> Any:
    """acks=all, no idempotence (the embedded broker lacks InitProducerId), bounded retries;
    a batch not acknowledged within ``request_timeout_ms`` fails (aiokafka's expiry)."""
    return cls(
        bootstrap_servers=_servers(cfg),
        client_id=client_id,
        acks="all",
        enable_idempotence=False,
        max_request_size=cfg.max_request_bytes,
        request_timeout_ms=request_timeout_ms,
        retry_backoff_ms=200,
        **security_options(cfg),
        **batching,
    )


DATA_BATCH_BYTES = 1 << 20
"""Largest batch of data records per partition (one produce request carries several)."""


class DataProducer(CheckedProducer):
    """aiokafka's producer of data records, plus :meth:`flush_lingering`."""

    def flush_lingering(self) -> None:
        """Close the batches that wait for ``linger_ms`` and wake the sender, so they go
        out now: the caller is about to wait for their acks, and a step that waits for its
        own records gains nothing from lingering (what aiokafka's ``flush_for_commit``
        does, without waiting). It reaches into aiokafka's accumulator (the pinned range,
        ``pyproject.toml``); should those internals move, the batches just linger."""
        try:
            accumulator = self._message_accumulator
            for batches in accumulator._batches.values():
                for batch in batches:
                    batch._builder.close()
            if not accumulator._waiter_future.done():
                accumulator._waiter_future.set_result(None)
        except AttributeError as exc:  # pragma: no cover - another aiokafka's internals
            log.debug("flush_lingering: %s; batches wait out linger_ms", exc)


def data_producer(
    cfg: KafkaConfig, client_id: str, request_timeout_ms: int = REQUEST_TIMEOUT_MS
) -> DataProducer | ConfluentProducer:
    """Producer of tasks and experience groups: batched, optionally compressed; aiokafka's
    or librdkafka's (``kafka.producer``). A record not acknowledged within
    ``request_timeout_ms`` fails (serve mode's ``serve.publish_attempt_s``: the record is
    then no longer queued, so what failed can be kept elsewhere without being sent twice)."""
    if cfg.producer == "confluent":
        if not produce_confluent.available():
            raise ConfigError(
                "kafka.producer: confluent needs the confluent-kafka package "
                "(pip install -e '.[kafka-fast]' in the streamrft clone)"
            )
        options = confluent_options(cfg, client_id, request_timeout_ms)
        return ConfluentProducer(options, CONNECT_TIMEOUT_S)
    return _producer(
        cfg,
        client_id,
        DataProducer,
        request_timeout_ms=request_timeout_ms,
        compression_type=None if cfg.compression == "none" else cfg.compression,
        linger_ms=cfg.linger_ms,
        max_batch_size=DATA_BATCH_BYTES,
    )


def confluent_options(
    cfg: KafkaConfig, client_id: str, request_timeout_ms: int = REQUEST_TIMEOUT_MS
) -> dict[str, Any]:
    """librdkafka's options for a data producer, chosen to match aiokafka's (above):
    acks=all, no idempotence, at most one request in flight per partition's connection
    (order kept across retries, as aiokafka's one batch in flight per partition does),
    a record failed after the request timeout (aiokafka's batch expiry), murmur2 over the
    key (the partition aiokafka would choose; random without a key), and
    :func:`security_options`' protocol, SASL credentials and TLS files."""
    security_options(cfg)  # the same checks and errors (a TLS file that does not load)
    options: dict[str, Any] = {
        "bootstrap.servers": _servers(cfg),
        "client.id": client_id,
        "acks": "all",
        "enable.idempotence": False,
        "max.in.flight.requests.per.connection": 1,
        "message.max.bytes": cfg.max_request_bytes,
        "batch.size": DATA_BATCH_BYTES,
        "linger.ms": cfg.linger_ms,
        "compression.type": cfg.compression,
        "partitioner": "murmur2_random",
        "request.timeout.ms": request_timeout_ms,
        "message.timeout.ms": request_timeout_ms + cfg.linger_ms,  # counts the linger too
        "retry.backoff.ms": 200,
        "socket.nagle.disable": True,
        "security.protocol": cfg.security_protocol,
    }
    if cfg.security_protocol.startswith("SASL_"):
        options["sasl.mechanism"] = cfg.sasl_mechanism
        options["sasl.username"] = cfg.sasl_username
        options["sasl.password"] = cfg.sasl_password
    if cfg.security_protocol.endswith("SSL"):
        options["ssl.ca.location"] = cfg.ssl_cafile or "probe"  # None: the system CAs
        if cfg.ssl_certfile:
            options["ssl.certificate.location"] = cfg.ssl_certfile
            options["ssl.key.location"] = cfg.ssl_keyfile or cfg.ssl_certfile
        options["ssl.endpoint.identification.algorithm"] = (
            "https" if cfg.ssl_check_hostname else "none"
        )
    return options


def event_producer(cfg: KafkaConfig, client_id: str) -> AIOKafkaProducer:
    """Producer of control, status, metrics and dead letters: each event sent at once."""
    return _producer(cfg, client_id, linger_ms=0)


def heartbeat_ms(cfg: KafkaConfig) -> int:
    """Heartbeat of group members: a tenth of the session timeout (at least 300 ms).

    A member learns that its group is rebalancing from its next heartbeat, so this bounds
    how late an explorer notices that another joined or left (the usual third of the
    session timeout made every rebalance wait up to ~2 s longer on the embedded broker).
    """
    return max(cfg.session_timeout_ms // 10, 300)


def _group_consumer(
    cfg: KafkaConfig, topic: str, group_id: str, client_id: str, **fetch: int
) -> AIOKafkaConsumer:
    """A consumer-group member that starts from the earliest offset and commits by hand."""
    return CheckedConsumer(
        topic,
        bootstrap_servers=_servers(cfg),
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=heartbeat_ms(cfg),
        max_poll_interval_ms=cfg.max_poll_interval_ms,
        fetch_max_wait_ms=cfg.data_fetch_max_wait_ms,
        request_timeout_ms=max(REQUEST_TIMEOUT_MS, cfg.session_timeout_ms + 5000),
        **security_options(cfg),
        **fetch,
    )


class TaskConsumer:
    """An explorer's membership of the run's tasks group, with the embedded broker's
    quirks handled here rather than in callers.

    - **Leaving.** The first generation of a group on the Tansu broker is 0, and aiokafka
      sends LeaveGroup on stop only when the generation is above 0: the broker then keeps
      the departed member until its session times out, and the next member's join (an
      explorer restarted, or joining later) waits for that. :meth:`stop` sends the
      LeaveGroup itself at generation 0 (aiokafka does it otherwise). Measured on the
      embedded broker, session timeout 6 s: a member that joins right after the only
      member stopped got its partitions after 11.1 s before the fix, 3.0 s after.
    - **Joining.** Tansu holds every JoinGroup until half the group's session timeout has
      passed (in 1 s steps), so that the others can join the same generation; the members
      already in the group rejoin at their next heartbeat. ``rebalance_timeout_ms`` and
      ``retry_backoff_ms`` change nothing; the session timeout and the heartbeat do.
      Measured (first join of an empty group / a second member joining / the first
      member getting all partitions back after the second left): session 10 s with the
      former heartbeat of 2 s: 5.0 / 7.1 / 7.0 s; session 6 s (now the default
      ``kafka.session_timeout_ms``) with a heartbeat of a tenth (:func:`heartbeat_ms`):
      3.0 / 4.0 / 3.2 s. Apache Kafka answers a first join after
      ``group.initial.rebalance.delay.ms`` (3 s by default) and never waits on a member
      that left.
    - **Who holds what.** Every rebalance is logged with the partitions this member
      holds; :attr:`partitions`, :attr:`generation` and :attr:`rebalances` expose them,
      and ``on_assign`` is called with the new partitions. A member with none says that
      it idles because the group has more members than the topic has partitions.

    Use ``async with`` or :meth:`start` / :meth:`stop` (safe to call twice).
    """

    def __init__(
        self,
        cfg: KafkaConfig,
        topic: str,
        group_id: str,
        client_id: str,
        on_assign: Callable[[tuple[int, ...]], None] | None = None,
    ) -> None:
        self.topic = topic
        self.group_id = group_id
        self.client_id = client_id
        self.partitions: tuple[int, ...] = ()
        """Partitions of ``topic`` this member holds now (empty before the first join)."""
        self.generation = -1
        """Group generation of the newest assignment (-1 before the first)."""
        self.rebalances = 0
        """Assignments received so far (the first join counts)."""
        self.assigned = asyncio.Event()
        """Set at every assignment (clear it to wait for the next)."""
        self.last_poll = time.monotonic()
        """When the last :meth:`getmany` returned records or none (``time.monotonic()``);
        not moved by one that raised."""
        self._on_assign = on_assign
        self._consumer = _group_consumer(cfg, topic, group_id, client_id)
        self._consumer.subscribe([topic], listener=_AssignmentListener(self))

    async def start(self) -> None:
        await start_client(self._consumer, f"{self.client_id} task consumer")
        self._leave_even_at_generation_zero()

    async def stop(self) -> None:
        """Leave the group (at any generation) and close; safe to call twice."""
        await self._consumer.stop()

    async def __aenter__(self) -> TaskConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def _client(self) -> Any:
        """The connection client inside (it holds the security settings)."""
        return self._consumer._client

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        got = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        self.last_poll = time.monotonic()  # only a poll that went through counts
        return got

    @property
    def in_group(self) -> bool:
        """Whether this member is in the group now: aiokafka resets the generation to -1
        when the member leaves (a stop, or a poll interval gone by without a poll)."""
        coordinator = self._consumer._coordinator
        return coordinator is not None and coordinator.generation >= 0

    def idle_s(self) -> float:
        """Seconds since the last :meth:`getmany` returned."""
        return time.monotonic() - self.last_poll

    async def keep_membership(self) -> bool:
        """Poll with every partition paused: the group counts this member as reading
        (``kafka.max_poll_interval_ms`` starts again) and no record moves. Which
        partitions were held back stays as it was; records fetched ahead for the others
        are fetched again. Returns False, without polling, while a rebalance is under way
        (a poll would wait for it; a member put out of the group rejoins at its next
        read). The poll never waits: nothing may cancel it half-way, because aiokafka
        would then count it as running for ever and never find this member stuck."""
        if self._consumer._subscription.reassignment_in_progress:
            return False
        every = self._consumer.assignment()
        held = self._consumer.paused()
        self._consumer.pause(*every)
        try:
            got = await self.getmany(timeout_ms=0)
        finally:
            self._consumer.resume(*(set(self._consumer.assignment()) - held))
        # nothing paused returns records; should a partition that was not be let through,
        # the next take reads it again from the first of them
        for tp, records in got.items():
            if records:
                self._consumer.seek(tp, records[0].offset)
        return True

    async def commit(self, offsets: dict) -> None:
        await self._consumer.commit(offsets)

    def unread(self) -> set[int]:
        """Partitions held and fetched (not held back) that may have records this member
        has not been given yet: no fetch answer since the assignment (position or
        high-water mark unknown), or the position below the high-water mark. Read from
        aiokafka's subscription state, which has no public accessor for it."""
        assignment = self._consumer._subscription.subscription
        assignment = assignment.assignment if assignment is not None else None
        if assignment is None:
            return set()
        out = set()
        for tp in self._consumer.assignment():
            state = assignment.state_value(tp)
            if state is None or state.paused:
                continue
            known = state.highwater is not None and state.has_valid_position
            if not known or state.position < state.highwater:
                out.add(tp.partition)
        return out

    def hold_back(self, partitions: Collection[int]) -> None:
        """Fetch nothing from ``partitions`` of the topic until the next call; fetch every
        other partition this member holds. Records fetched but not yet returned from a
        held partition are fetched again later (the position does not move)."""
        for tp in self._consumer.assignment():
            if tp.partition in partitions:
                self._consumer.pause(tp)
            else:
                self._consumer.resume(tp)

    def _assigned(self, assigned: set[TopicPartition]) -> None:
        coordinator = self._consumer._coordinator
        self.generation = coordinator.generation if coordinator is not None else -1
        self.partitions = tuple(sorted(tp.partition for tp in assigned if tp.topic == self.topic))
        self.rebalances += 1
        total = len(self._consumer.partitions_for_topic(self.topic) or ())
        if self.partitions:
            log.info(
                "%s: holds tasks partitions %s of %d (generation %d)",
                self.client_id,
                list(self.partitions),
                total,
                self.generation,
            )
        else:
            log.warning(
                "%s: holds no tasks partition (generation %d): it idles, because the group "
                "has more explorers than %s has partitions (%d); it takes over partitions "
                "when an explorer leaves",
                self.client_id,
                self.generation,
                self.topic,
                total,
            )
        self.assigned.set()
        if self._on_assign is not None:
            self._on_assign(self.partitions)

    def _leave_even_at_generation_zero(self) -> None:
        """Make the coordinator send LeaveGroup on stop at generation 0 too.

        aiokafka's ``GroupCoordinator._maybe_leave_group`` (called by ``close`` and when a
        poll interval expires) skips the request unless ``generation > 0``; on Tansu the
        first generation is 0. At generation 0 with a known member id this sends the same
        request aiokafka would, then resets the generation as aiokafka does; otherwise it
        defers to aiokafka. Static members (``group_instance_id``) never leave.
        """
        coordinator = self._consumer._coordinator
        if coordinator is None:
            return
        aiokafka_leave = coordinator._maybe_leave_group

        async def leave() -> None:
            if (
                coordinator.generation != 0
                or coordinator.member_id == JoinGroupRequest.UNKNOWN_MEMBER_ID
                or coordinator._group_instance_id is not None
            ):
                await aiokafka_leave()
                return
            try:
                await coordinator._send_req(
                    LeaveGroupRequest(coordinator.group_id, coordinator.member_id)
                )
            except KafkaError as exc:  # best effort, as aiokafka's: the session times out
                log.warning("%s: LeaveGroup at generation 0 failed: %s", self.client_id, exc)
            else:
                log.info("%s: left %s (generation 0)", self.client_id, self.group_id)
            coordinator.reset_generation()

        coordinator._maybe_leave_group = leave


class _AssignmentListener(ConsumerRebalanceListener):
    def __init__(self, owner: TaskConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        pass  # offsets are committed after each step; uncommitted tasks are explored again

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._owner._assigned(assigned)


def task_consumer(
    cfg: KafkaConfig,
    topic: str,
    group_id: str,
    client_id: str,
    on_assign: Callable[[tuple[int, ...]], None] | None = None,
) -> TaskConsumer:
    """Explorers share the tasks topic in one group; offsets committed by hand."""
    return TaskConsumer(cfg, topic, group_id, client_id, on_assign)


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


def replay_consumer(cfg: KafkaConfig, client_id: str) -> AIOKafkaConsumer:
    """A replay's reader of a recorded experiences topic (``streamrft train --from-*``,
    ``consumers/replay.py``): no consumer group (partitions assigned and sought by the
    caller, nothing committed), so a replay moves no group's offsets and reads the same
    records each time; fetches as large as the trainer's group member's."""
    return _group_less(
        cfg,
        [],
        client_id,
        cfg.data_fetch_max_wait_ms,
        fetch_max_bytes=max(cfg.max_request_bytes, 64 << 20),
    )


def event_reader(cfg: KafkaConfig, topics: Sequence[str], client_id: str) -> AIOKafkaConsumer:
    """Group-less reader of control/status/metrics topics, from the beginning, low latency."""
    return _group_less(cfg, topics, client_id, cfg.control_fetch_max_wait_ms)


def _group_less(
    cfg: KafkaConfig, topics: Sequence[str], client_id: str, fetch_wait_ms: int, **more: Any
) -> AIOKafkaConsumer:
    """A reader in no consumer group (nothing committed), from the beginning."""
    more.setdefault("group_id", None)
    return CheckedConsumer(
        *topics,
        bootstrap_servers=_servers(cfg),
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=fetch_wait_ms,
        max_partition_fetch_bytes=cfg.max_request_bytes,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
        **more,
        **security_options(cfg),
    )


def topic_reader(cfg: KafkaConfig, client_id: str) -> AIOKafkaConsumer:
    """Group-less reader for tools (``streamrft tail``); partitions assigned by the caller."""
    return event_reader(cfg, [], client_id)


def group_reader(cfg: KafkaConfig, group_id: str, client_id: str) -> AIOKafkaConsumer:
    """A reader that names consumer group ``group_id`` to read its committed offsets
    (``committed``) without joining it: partitions are assigned by the caller, and it never
    commits."""
    return _group_less(cfg, [], client_id, cfg.control_fetch_max_wait_ms, group_id=group_id)


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
                await _close_quietly(client)
                raise ServiceError(f"{what}: cannot reach the Kafka broker: {exc}") from exc
            await asyncio.sleep(0.5)
        except BaseException:
            await _close_quietly(client)
            raise


async def _close_quietly(client: Any) -> None:
    """Release a client whose start failed (its error is the one worth raising)."""
    close = getattr(client, "close", None) or client.stop
    with contextlib.suppress(Exception):
        await close()
