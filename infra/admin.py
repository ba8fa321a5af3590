"""Topic admin: partitions, configs and creation of a run's seven topics (their names come
from ``schemas.topics``). Tasks and experiences are partitioned (explorers share the tasks
through one consumer group; a partition goes to one member at a time); the event topics
(control, status, metrics, dead letters) have one partition each, so every reader sees one
total order.
"""

from __future__ import annotations

from aiokafka.admin import NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from streamrft.infra import access
from streamrft.infra.config import KafkaConfig
from streamrft.infra.consume import assign_from_beginning, consume
from streamrft.infra.kafka import admin_client, group_reader, start_client
from streamrft.schemas.errors import ServiceError
from streamrft.schemas.topics import TopicNames


def tasks_partitions(cfg: KafkaConfig, explorers: int = 1) -> int:
    """Partitions of the tasks topic: ``kafka.partitions``, raised to ``explorers``.

    Explorers share the tasks through one consumer group, and a partition goes to one
    member at a time, so at most this many explorers work at once; more idle until one
    leaves. Set ``kafka.partitions`` to the most explorers a run will have at any time,
    hand-started ones included (``streamrft run --explorers N`` raises it to N).
    """
    return max(cfg.partitions, explorers)


def topic_specs(cfg: KafkaConfig, topics: TopicNames, explorers: int = 1) -> list[NewTopic]:
    """The seven topics of a run: tasks and experiences partitioned, events and samples
    single-partition.

    Tasks get :func:`tasks_partitions`, experiences ``kafka.partitions``. Single-partition
    event topics keep a total order of control events for every reader.
    """
    specs = []
    for kind, name in topics.all().items():
        parts = 1
        if kind == "tasks":
            parts = tasks_partitions(cfg, explorers)
        elif kind == "experiences":
            parts = cfg.partitions
        config = {"max.message.bytes": str(cfg.max_request_bytes)}
        specs.append(NewTopic(name, parts, cfg.replication_factor, topic_configs=config))
    return specs


async def ensure_topics(cfg: KafkaConfig, topics: TopicNames, explorers: int = 1) -> list[str]:
    """Create the run's topics that do not exist yet; returns the names created.

    ``explorers``: how many the run starts (see :func:`tasks_partitions`).
    """
    admin = admin_client(cfg)
    await start_client(admin, "topic admin")
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in topic_specs(cfg, topics, explorers) if s.name not in existing]
        if missing:
            access.check("create", topics.run)
            try:
                await admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
            except KafkaError as exc:
                raise ServiceError(f"creating topics {[s.name for s in missing]}: {exc}") from exc
        return [s.name for s in missing]
    finally:
        await admin.close()


async def unexplored_tasks(cfg: KafkaConfig, topics: TopicNames) -> int:
    """Tasks on ``tasks`` past the offsets the run's explorers committed (from the first
    offset of a partition with none), counted by reading them: the embedded broker's end
    offset is wrong after a multi-record batch. Read by a consumer that names the group
    but never joins it (partitions assigned by hand, no commit): no explorer is
    rebalanced."""
    reader = group_reader(cfg, topics.explorers_group, "streamrft-lag")
    await start_client(reader, "lag reader")
    try:
        await assign_from_beginning(reader, topics.tasks)
        for tp in sorted(reader.assignment()):
            done = await reader.committed(tp)
            if done is not None:
                reader.seek(tp, done)
        return await consume(reader, None, lambda _rec: None, on_bad=lambda _rec: None,
                             until_quiet=3)  # fmt: skip
    finally:
        await reader.stop()


async def list_topics(cfg: KafkaConfig) -> list[str]:
    access.check("list", cfg.topic_prefix)
    admin = admin_client(cfg)
    await start_client(admin, "topic admin")
    try:
        return sorted(await admin.list_topics())
    finally:
        await admin.close()
