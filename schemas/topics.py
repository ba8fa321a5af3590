"""Topic names of a run namespace: ``<prefix>.<run>.<kind>``.

Several runs can share one Kafka cluster; each has its own seven topics.
"""

from __future__ import annotations

import re

import msgspec

from streamrft.schemas.errors import ConfigError

TOPIC_KINDS = (
    "tasks",
    "experiences",
    "control",
    "status",
    "metrics",
    "dead_letters",
    "samples",
)
NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class TopicNames(msgspec.Struct, frozen=True):
    prefix: str
    run: str

    def __post_init__(self) -> None:
        for field, value in (("kafka.topic_prefix", self.prefix), ("run.id", self.run)):
            if not NAME.match(value):
                raise ConfigError(
                    f"{field}: {value!r} may hold only letters, digits, '_' and '-' "
                    "(it becomes part of Kafka topic names)"
                )

    def of(self, kind: str) -> str:
        if kind not in TOPIC_KINDS:
            raise ConfigError(f"unknown topic kind {kind!r}; known: {', '.join(TOPIC_KINDS)}")
        return f"{self.prefix}.{self.run}.{kind}"

    @property
    def tasks(self) -> str:
        return self.of("tasks")

    @property
    def experiences(self) -> str:
        return self.of("experiences")

    @property
    def control(self) -> str:
        return self.of("control")

    @property
    def status(self) -> str:
        return self.of("status")

    @property
    def metrics(self) -> str:
        return self.of("metrics")

    @property
    def dead_letters(self) -> str:
        return self.of("dead_letters")

    @property
    def samples(self) -> str:
        return self.of("samples")

    def group(self, role: str) -> str:
        """The run's consumer group of ``role`` (``<prefix>.<run id>.<role>``): runs sharing
        a cluster never share a group."""
        return f"{self.prefix}.{self.run}.{role}"

    @property
    def explorers_group(self) -> str:
        """The consumer group the explorers of one run share on ``tasks``: runs sharing a
        cluster never rebalance each other's explorers."""
        return self.group("explorers")

    def all(self) -> dict[str, str]:
        return {kind: self.of(kind) for kind in TOPIC_KINDS}

    @staticmethod
    def kind_of(topic: str) -> str | None:
        """The kind of a full topic name (``x.y.tasks`` -> ``tasks``), or None."""
        kind = topic.rsplit(".", 1)[-1]
        return kind if kind in TOPIC_KINDS else None
