"""Control, status, metrics and dead-letter events.

Control events are a tagged union decoded by one typed decoder and dispatched with
``match``. Every struct here is plain msgspec: no torch, no aiokafka.
"""

from __future__ import annotations

import enum

import msgspec


class ModelVersionReady(msgspec.Struct, tag="model_version_ready", kw_only=True):
    """A new model version is published and verified-readable at ``uri``."""

    version: int
    method: str
    """How the weights travel: ``object_store`` (issue 2), ``filesystem``, ``nccl``."""
    uri: str
    """Where the manifest lies, e.g. ``s3://bucket/run/v000012/manifest.json``."""
    manifest_sha256: str
    """sha256 of the manifest object's bytes; the loader checks it first."""
    bytes: int
    """Total bytes of the weight shards."""
    step: int
    """Trainer step after which these weights were taken."""
    lora: bool = False
    created_at: float = 0.0


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    """Ask every component of the run to stop after its current unit of work."""

    reason: str = ""
    created_at: float = 0.0


class SyncRequest(msgspec.Struct, tag="sync_request", kw_only=True):
    """An explorer asks the trainer for a version at least ``min_version``."""

    explorer: str
    min_version: int
    created_at: float = 0.0


ControlEvent = ModelVersionReady | Shutdown | SyncRequest


class RunState(str, enum.Enum):
    RUNNING = "RUNNING"
    REQUIRE_SYNC = "REQUIRE_SYNC"
    WAITING_SYNC = "WAITING_SYNC"
    STOPPED = "STOPPED"


class StatusEvent(msgspec.Struct, kw_only=True):
    """Heartbeat of one component, keyed by component id on ``<ns>.status``."""

    component: str
    """``trainer``, ``explorer-0``, ``feeder``..."""
    role: str
    state: RunState
    step: int
    version: int
    """Model version the component holds (-1 before its first)."""
    created_at: float = 0.0
    detail: str = ""
    counters: dict[str, float] = {}
    """Running totals (groups published, versions applied, ...)."""


class TrainedGroup(msgspec.Struct, array_like=True):
    """Ledger row: one group a trainer step used, and the version it was sampled with."""

    group_id: str
    model_version: int


class MetricsEvent(msgspec.Struct, kw_only=True):
    """Per-step numbers from a component, keyed by run on ``<ns>.metrics``."""

    run: str
    component: str
    step: int
    version: int
    values: dict[str, float]
    created_at: float = 0.0
    trained: list[TrainedGroup] = []
    """Trainer only: the ledger of groups this step trained on."""


class DeadLetter(msgspec.Struct, kw_only=True):
    """A message that failed to decode or validate, kept whole with the reason."""

    source_topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str
    error_type: str
    component: str
    created_at: float = 0.0
