"""``streamrft status --run-id ID``: one screen on a run's components, from its status topic.

Each component's newest heartbeat: role, state, step, model version (and its lag behind
the trainer's), heartbeat age, the tasks partitions an explorer holds, its last note. The
table is built by pure code (``Components.table``) from the events read off the topic.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import yaml

from streamrft.app.watch.run_events import read_events
from streamrft.infra.config import KafkaConfig
from streamrft.schemas.events import DeadLetter, ModelVersionReady, RunDefined, StatusEvent
from streamrft.schemas.topics import TopicNames

PARTITIONS_NOTE = "tasks partitions "
"""How a task intake's status detail names the partitions it was given (``task_intake``)."""


@dataclass
class Components:
    """The newest status per component, the partitions each explorer last reported, the
    newest version announced, and the dead letters, folded from the run's topics."""

    status: dict[str, StatusEvent] = field(default_factory=dict)
    partitions: dict[str, str] = field(default_factory=dict)
    newest_version: int = -1
    dead_letters: int = 0
    record: RunDefined | None = None
    """The run's newest definition (its trainer publishes it when it starts)."""

    def apply(self, kind: str, ev: object) -> None:
        if isinstance(ev, StatusEvent):
            self.status[ev.component] = ev
            if ev.detail.startswith(PARTITIONS_NOTE):
                self.partitions[ev.component] = ev.detail[len(PARTITIONS_NOTE) :]
            elif ev.counters.get("tasks_partitions") == 0 and ev.role == "explorer":
                self.partitions[ev.component] = "-"
        elif isinstance(ev, ModelVersionReady):
            self.newest_version = max(self.newest_version, ev.version)
        elif isinstance(ev, DeadLetter):
            self.dead_letters += 1
        elif isinstance(ev, RunDefined):
            self.record = ev

    def trainer_version(self) -> int:
        trainer = self.status.get("trainer")
        return max(self.newest_version, trainer.version if trainer else -1)

    def rows(self, now: float) -> list[list[str]]:
        head = self.trainer_version()
        order = sorted(self.status.values(), key=lambda s: (s.role != "trainer", s.component))
        out = []
        for s in order:
            lag = (
                ""
                if s.role == "trainer" or s.version < 0 or head < 0
                else f" (-{head - s.version})"
            )
            out.append(
                [
                    s.component,
                    s.role,
                    s.state.value,
                    str(s.step),
                    f"{s.version}{lag}",
                    age(now - s.created_at),
                    self.partitions.get(s.component, ""),
                    s.detail[:60],
                ]
            )
        return out

    def table(self, run: str, now: float | None = None) -> str:
        rows = self.rows(time.time() if now is None else now)
        header = ["component", "role", "state", "step", "version", "heartbeat", "partitions"]
        cells = [[*header, "note"], *rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        lines = [
            f"run {run}: {len(rows)} components, newest version {self.trainer_version()}, "
            f"{self.dead_letters} dead letters"
        ]
        for r in cells:
            line = "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False))
            lines.append(f"{line}  {r[-1]}".rstrip())
        if self.record is not None:  # below the table: what a joiner would take
            lines.append(self.defined(time.time() if now is None else now))
        return "\n".join(lines)

    def defined(self, now: float) -> str:
        """One line on the run's newest record: when, where its config is, the trainer's
        shape and the sync method (what a process joining with --run-id will take)."""
        assert self.record is not None
        try:
            tree = yaml.safe_load(self.record.config_yaml) or {}
        except yaml.YAMLError:
            tree = {}
        t, sync = tree.get("trainer") or {}, tree.get("synchronizer") or {}
        where = self.record.store_uri or "the control topic"
        return (
            f"defined {age(now - self.record.created_at)} (config at {where}): trainer "
            f"{t.get('nproc', 1)} rank(s) x {t.get('nnodes', 1)} host(s), sync "
            f"{sync.get('method', '?')}"
        )


def age(seconds: float) -> str:
    """How long ago, in the unit that reads best (``42s ago``, ``17m ago``, ``3.5h ago``)."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


async def read_components(kafka_cfg: KafkaConfig, topics: TopicNames) -> Components:
    """The run's status, control and dead-letter topics read to their end, folded."""
    comps = Components()
    await read_events(
        kafka_cfg,
        topics,
        ["status", "control", "dead_letters"],
        comps.apply,
        follow=False,
        client_id="streamrft-status",
    )
    return comps


def status_table(kafka_cfg: KafkaConfig, topics: TopicNames) -> str:
    comps = asyncio.run(read_components(kafka_cfg, topics))
    if not comps.status:
        return f"run {topics.run}: no status yet on {topics.status}"
    return comps.table(topics.run)
